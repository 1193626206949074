"""BlockPool: states, ref counts, the eviction queue, errors that change nothing; and pool sizing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmjax.kv import (
    NULL_BLOCK,
    BlockPool,
    num_blocks_from_budget,
)


def pool_state(pool: BlockPool) -> tuple:
    return (
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        [pool.content(b) for b in range(pool.num_blocks)],
        pool.eviction_order(),
        pool.num_free,
        pool.num_in_use,
        pool.num_extra_refs,
    )


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4]
    assert NULL_BLOCK not in blocks
    assert pool.num_free == 0 and pool.num_in_use == 4
    pool.check_invariants()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    before = pool_state(pool)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks"):
        pool.allocate(2)
    assert pool_state(pool) == before


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError, match="at least one usable block"):
        BlockPool(1)


def test_sharing_counts_references():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_count(b) == 2 and pool.num_extra_refs == 1 and pool.num_in_use == 1
    pool.decref([b])
    assert pool.ref_count(b) == 1 and pool.num_extra_refs == 0
    pool.decref([b])
    assert pool.ref_count(b) == 0 and pool.num_free == 3
    pool.check_invariants()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.decref([a])
    before = pool_state(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.decref([b, a])
    assert pool_state(pool) == before
    with pytest.raises(ValueError, match="listed twice"):
        pool.decref([b, b])
    with pytest.raises(ValueError, match="null block"):
        pool.decref([NULL_BLOCK])
    assert pool_state(pool) == before


def test_a_free_block_cannot_be_shared():
    pool = BlockPool(4)
    before = pool_state(pool)
    with pytest.raises(ValueError, match="neither in use nor cached"):
        pool.incref([1])
    assert pool_state(pool) == before


def test_cached_blocks_become_evictable_in_the_order_released():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.mark_cached(b, (i, i))
    pool.decref(blocks[::-1])  # tail first
    assert pool.eviction_order() == blocks[::-1]
    assert pool.num_evictable == 3 and pool.num_free == 2 and pool.num_cached == 3
    pool.check_invariants()
    # A hit revives an evictable block from the middle of the queue.
    pool.incref([blocks[1]])
    assert pool.eviction_order() == [blocks[2], blocks[0]]
    assert pool.evict_lru() == blocks[2]
    assert pool.content(blocks[2]) is None and pool.num_free == 3
    pool.check_invariants()


def test_uncached_blocks_go_back_to_the_free_list():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.decref(blocks)
    assert pool.num_free == 2 and pool.eviction_order() == []
    with pytest.raises(ValueError, match="no evictable block"):
        pool.evict_lru()


def test_mark_cached_needs_a_held_uncached_block():
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.mark_cached(1, (0,))
    (b,) = pool.allocate(1)
    pool.mark_cached(b, (0,))
    with pytest.raises(ValueError):
        pool.mark_cached(b, (0,))


def test_check_invariants_catches_corruption():
    pool = BlockPool(4)
    pool.allocate(1)
    pool._free.append(pool._free[-1])  # a block on the free list twice
    with pytest.raises(AssertionError, match="free list twice"):
        pool.check_invariants()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "release", "cache", "evict"]), st.integers(0, 7)), max_size=60))
def test_pool_matches_a_naive_model(ops):
    """Random operations against a dict of ref counts and a list of evictable blocks."""
    pool = BlockPool(8)
    refs: dict[int, int] = {}  # in-use block -> ref count
    cached: set[int] = set()
    evictable: list[int] = []
    for op, arg in ops:
        held = sorted(refs)
        if op == "alloc":
            free = 7 - len(refs) - len(evictable)
            if arg > free:
                with pytest.raises(ValueError):
                    pool.allocate(arg)
            else:
                for b in pool.allocate(arg):
                    assert b not in refs and b not in cached and b != NULL_BLOCK
                    refs[b] = 1
        elif op == "share" and (held or evictable):
            b = (held + evictable)[arg % (len(held) + len(evictable))]
            pool.incref([b])
            if b in evictable:
                evictable.remove(b)
            refs[b] = refs.get(b, 0) + 1
        elif op == "release" and held:
            b = held[arg % len(held)]
            pool.decref([b])
            refs[b] -= 1
            if not refs[b]:
                del refs[b]
                if b in cached:
                    evictable.append(b)
        elif op == "cache" and held:
            b = held[arg % len(held)]
            if b in cached:
                with pytest.raises(ValueError):
                    pool.mark_cached(b, (arg,))
            else:
                pool.mark_cached(b, (arg,))
                cached.add(b)
        elif op == "evict" and evictable:
            b = evictable.pop(0)
            assert pool.evict_lru() == b
            cached.discard(b)
        assert {b: pool.ref_count(b) for b in refs} == refs
        assert pool.eviction_order() == evictable
        assert pool.num_in_use == len(refs) and pool.num_cached == len(cached)
        pool.check_invariants()


def test_bytes_per_token():
    import dataclasses

    from llmjax.config import PRESETS

    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 -> 128 KiB per token.
    llama = dataclasses.replace(PRESETS["tiny-gqa"], num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
    assert llama.kv_bytes_per_token(2) == 131072
    # DeepSeek-V2: 60 layers, latent 512 + RoPE key 64, bf16.
    deepseek = dataclasses.replace(PRESETS["tiny-mla"], num_layers=60, kv_lora_rank=512, qk_rope_head_dim=64)
    assert deepseek.kv_bytes_per_token(2) == 69120


def test_num_blocks_from_budget():
    # 1 GiB of 16-token blocks at 128 KiB per token: 2 MiB per block.
    assert num_blocks_from_budget(1 << 30, 16, 131072) == 512
    assert num_blocks_from_budget(2 * 16 * 100 + 99, 16, 100) == 2
    with pytest.raises(ValueError, match="at least 2 are needed"):
        num_blocks_from_budget(2 * 16 * 100 - 1, 16, 100)
    with pytest.raises(ValueError, match="block_size"):
        num_blocks_from_budget(1 << 30, 0, 100)
