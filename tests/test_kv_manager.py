"""KVCacheManager: block tables, growth, sharing, admission, usage figures and errors that change nothing."""

from __future__ import annotations

import numpy as np
import pytest

from llmjax.kv import KVCacheManager, KVUsage
from llmjax.kv.radix_cache import Node


def _tree(node: Node) -> tuple:
    children = sorted((_tree(c) for c in node.children.values()), key=repr)
    return (tuple(node.pages), tuple(node.blocks), node.lock_count, node.last_access, tuple(children))


def snapshot(m: KVCacheManager) -> tuple:
    """Everything observable about a manager, to assert that a failed call changed nothing."""
    pool = m.block_pool
    seqs = {r: (tuple(s.block_table), m.num_tokens(r), s.cached_pages, s.namespace) for r, s in m._seqs.items()}
    tree = {ns: _tree(root) for ns, root in m.prefix_cache._roots.items()} if m.prefix_cache else None
    return (
        m.usage(),
        m.stats(),
        m.slot_usage(),
        seqs,
        tuple(pool.ref_count(b) for b in range(pool.num_blocks)),
        tuple(pool.content(b) for b in range(pool.num_blocks)),
        tuple(pool.eviction_order()),
        tuple(pool._free),
        tree,
    )


def test_allocate_without_prefix_caching():
    m = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    assert m.allocate("a", list(range(10)), max_new_tokens=100) == (0, 10)
    assert len(m.block_table("a")) == 3 and m.num_tokens("a") == 10
    assert m.usage() == KVUsage(num_blocks=9, used=3, cached=0, free=6, usage=3 / 9)
    m.free("a", list(range(10)))
    assert m.usage().free == 9 and m.stats().queries == 0 and m.peek_prefix_len(list(range(10))) == 0
    assert m.reset_prefix_cache()
    m.check_invariants()


def test_chunked_prefill_and_decode_add_a_block_only_at_a_boundary():
    m = KVCacheManager(num_blocks=10, block_size=4)
    assert m.allocate("a", list(range(10)), max_new_tokens=3) == (0, 3)
    assert len(m.block_table("a")) == 1
    assert m.grow("a", 4) and len(m.block_table("a")) == 1
    assert m.grow("a", 5) and len(m.block_table("a")) == 2
    table = list(m.block_table("a"))
    assert m.grow("a", 8) and m.block_table("a") == table
    assert m.grow("a", 8) and m.num_tokens("a") == 8
    m.check_invariants()


def test_num_blocks_for():
    m = KVCacheManager(num_blocks=4, block_size=16)
    assert [m.num_blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_a_hit_shares_the_matched_blocks_at_the_head_of_the_table():
    m = KVCacheManager(num_blocks=12, block_size=4)
    prompt = list(range(12))
    m.allocate("a", prompt, 100)
    m.cache_blocks("a", prompt)
    assert m.allocate("b", prompt + [99, 98], 100) == (12, 2)
    shared = m.block_table("a")
    assert m.block_table("b")[:3] == shared
    assert all(m.block_pool.ref_count(b) == 2 for b in shared)
    assert m.block_table("b")[3] not in shared  # token 12 goes to a fresh block
    assert m.slot_usage() == (14, 2)  # 12 shared slots counted once + 2 own; 2 empty in b's last block
    m.check_invariants()


def test_preempted_request_is_readmitted_with_hits_on_its_own_pages():
    m = KVCacheManager(num_blocks=12, block_size=4)
    seq = list(range(10))
    m.allocate("a", seq, 100)
    m.grow("a", 11)
    seq.append(42)
    table = list(m.block_table("a"))
    m.free("a", seq)  # preemption: 2 full pages are cached
    assert m.allocate("a", seq, 100) == (8, 3)
    assert m.block_table("a")[:2] == table[:2]
    m.check_invariants()


def test_cache_blocks_swaps_duplicates_for_the_canonical_blocks():
    m = KVCacheManager(num_blocks=12, block_size=4)
    prompt = list(range(9))
    m.allocate("a", prompt, 100)
    m.allocate("b", prompt, 100)  # no hit yet: b computes its own copy
    m.cache_blocks("a", prompt)
    b_own = list(m.block_table("b"))
    free_before = m.usage().free
    m.cache_blocks("b", prompt)
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.block_table("b")[2] == b_own[2]
    assert all(m.block_pool.ref_count(b) == 0 for b in b_own[:2])
    assert m.usage().free == free_before + 2
    m.check_invariants()


def test_cache_blocks_validates_before_changing_anything():
    m = KVCacheManager(num_blocks=12, block_size=4)
    m.allocate("a", list(range(8)), 100)
    before = snapshot(m)
    with pytest.raises(ValueError, match="holds 8 tokens"):
        m.cache_blocks("a", list(range(9)))
    assert snapshot(m) == before
    m.cache_blocks("a", list(range(8)))
    m.allocate("b", list(range(8)) + [5], 100)
    m.grow("b", 12)
    before = snapshot(m)
    with pytest.raises(ValueError, match="cached elsewhere"):
        m.cache_blocks("b", [7] * 12)  # contradicts the tokens its shared blocks hold
    assert snapshot(m) == before


def test_allocate_evicts_cached_blocks_when_the_pool_runs_short():
    m = KVCacheManager(num_blocks=5, block_size=2)
    m.allocate("a", [1, 2, 3, 4, 5], 100)
    m.free("a", [1, 2, 3, 4, 5])
    assert m.usage() == KVUsage(num_blocks=4, used=0, cached=2, free=2, usage=0.0)
    assert m.allocate("b", [9, 9, 9, 9, 9, 9, 9], 100) == (0, 7)
    assert m.usage().cached == 0 and m.stats().cached_blocks == 0
    m.check_invariants()


def test_allocate_returns_none_and_changes_nothing_when_full():
    m = KVCacheManager(num_blocks=5, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    m.allocate("a", prompt, 100)
    m.cache_blocks("a", prompt)
    before = snapshot(m)
    assert m.allocate("b", prompt + [6, 7, 8], 100) is None  # 2 cached blocks + 3 fresh > 1 free
    assert snapshot(m) == before
    assert m.allocate("b", prompt + [6, 7, 8], 2) == (4, 2)  # a smaller chunk fits
    m.check_invariants()


def test_asking_for_more_than_the_pool_can_ever_hold():
    m = KVCacheManager(num_blocks=5, block_size=2)
    before = snapshot(m)
    for chunk in (100, 2):  # the whole prompt is checked, not only its first chunk
        with pytest.raises(ValueError, match="pool has 4 usable blocks"):
            m.allocate("a", list(range(9)), chunk)
        assert snapshot(m) == before
    m.allocate("a", list(range(8)), 8)
    before = snapshot(m)
    with pytest.raises(ValueError, match="pool has 4 usable blocks"):
        m.grow("a", 9)
    assert snapshot(m) == before


def test_grow_returns_false_and_changes_nothing_without_room():
    m = KVCacheManager(num_blocks=4, block_size=2)
    m.allocate("a", [1, 2, 3], 100)
    m.allocate("b", [4], 100)
    before = snapshot(m)
    assert not m.grow("b", 3)
    assert snapshot(m) == before
    assert m.grow("b", 2)


def test_bad_requests_raise_and_change_nothing():
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("a", [1, 2, 3], 100)
    m.free("a", [1, 2, 3])
    m.allocate("b", [1, 2, 3], 100)
    before = snapshot(m)
    with pytest.raises(KeyError, match="unknown request 'a'"):
        m.free("a")  # double free
    with pytest.raises(KeyError):
        m.grow("zzz", 4)
    with pytest.raises(KeyError):
        m.block_table("zzz")
    with pytest.raises(ValueError, match="already holds blocks"):
        m.allocate("b", [1, 2, 3], 100)
    with pytest.raises(ValueError, match="cannot shrink"):
        m.grow("b", 2)
    with pytest.raises(ValueError):
        m.allocate("c", [], 100)
    with pytest.raises(ValueError):
        m.allocate("c", [1], 0)
    assert snapshot(m) == before
    assert not m.has_request("a") and m.has_request("b")


def test_unlocking_below_zero_raises_and_changes_nothing():
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("a", [1, 2, 3], 100)
    m.free("a", [1, 2, 3])
    (root,) = m.prefix_cache._roots.values()
    (node,) = root.children.values()
    assert node.lock_count == 0
    before = snapshot(m)
    with pytest.raises(ValueError, match="not locked"):
        m.prefix_cache.unlock(node)
    assert snapshot(m) == before


def test_usage_and_slot_usage():
    m = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    m.allocate("a", list(range(5)), 100)  # 2 blocks, 3 empty slots
    m.allocate("b", list(range(8)), 100)  # 2 blocks, full
    assert m.slot_usage() == (13, 3)
    assert m.usage() == KVUsage(num_blocks=8, used=4, cached=0, free=4, usage=0.5)


def test_check_invariants_catches_a_corrupted_table():
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("a", [1, 2, 3], 100)
    m._seqs["a"].block_table.append(7)
    with pytest.raises(AssertionError, match="block 7: ref count 0, 1 tables hold it"):
        m.check_invariants()


def test_check_invariants_catches_a_block_twice_or_shared_past_the_cached_pages():
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("a", [1, 2, 3, 4, 5], 100)
    m.check_invariants()
    table = m._seqs["a"].block_table
    m.block_pool.incref([table[0]])
    m.block_pool.decref([table[1]])
    table[1] = table[0]  # one block twice, the ref counts made to match the tables
    with pytest.raises(AssertionError, match="a block twice in its table"):
        m.check_invariants()
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("t", [1, 2, 3], 100, "t")
    m.allocate("u", [7, 8, 9], 100, "u")
    shared = m.block_table("t")[0]
    m.block_pool.decref([m.block_table("u")[0]])
    m.block_pool.incref([shared])
    m._seqs["u"].block_table[0] = shared  # an uncached block written by two tenants' requests
    with pytest.raises(AssertionError, match="'t': a block past its cached pages is shared or cached"):
        m.check_invariants()


def test_check_invariants_catches_a_path_in_another_namespace():
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("a", [1, 2, 3], 100, "tenant")
    m.cache_blocks("a", [1, 2, 3])
    m.check_invariants()
    m._seqs["a"].namespace = "other"
    with pytest.raises(AssertionError, match="'a' of namespace 'other' holds a path of 'tenant'"):
        m.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_grow_each_is_sequential_grows_all_or_nothing(seed):
    """`grow_each` against `grow` called request by request on a copy: the same state when every grow
    fits (blocks taken in the same order, evicting the same cached blocks), no change otherwise."""
    import copy
    import random

    rng = random.Random(seed)
    m = KVCacheManager(num_blocks=24, block_size=4)
    for i in range(4):  # cached pages that growth may evict
        m.allocate(f"old{i}", [50 + i] * 8, 100)
        m.free(f"old{i}", [50 + i] * 8)
    keys = []
    for i in range(5):
        prompt = [i] * rng.randint(1, 9)
        m.allocate(i, prompt, 100)
        keys.append(i)
    keys = tuple(keys)  # one object every call, as the scheduler's steady decodes pass it
    for _ in range(12):
        totals = [m.num_tokens(k) + rng.choice([0, 1, 1, 1, 4, 7]) for k in keys]
        reference = copy.deepcopy(m)
        fits = True
        for k, n in zip(keys, totals):
            if not reference.grow(k, n):
                fits = False
                break
        before = snapshot(m)
        assert m.grow_each(keys, totals) == fits
        assert snapshot(m) == (snapshot(reference) if fits else before)
        m.check_invariants()
        if not fits:
            return
    pytest.fail("the pool never ran out")


def test_grow_each_works_on_arrays_only_while_nothing_else_changes_a_request():
    """Called again with the same tuple, `grow_each` updates its arrays and leaves the requests'
    own counts stale; every other method sees the true counts, and one that changes a request (or
    a request coming or going) ends the fast path."""
    m = KVCacheManager(num_blocks=16, block_size=2)
    m.allocate("a", [1, 2], 100)
    m.allocate("b", [3], 100)
    keys = ("a", "b")
    assert m.grow_each(keys, [3, 2]) and m.grow_each(keys, np.array([4, 3]))
    assert m._group is not None and m._group.stale  # the second call took the fast path
    assert (m.num_tokens("a"), m.num_tokens("b")) == (4, 3) and m.slot_usage() == (7, 1)
    assert m.grow_each(keys, [5, 5])  # both cross into a new block
    assert [len(m.block_table(k)) for k in keys] == [3, 3]
    m.grow("a", 6)  # another method changed a request: the next call looks the requests up again
    assert m._group is None and m.grow_each(keys, [6, 6]) and m.num_tokens("b") == 6
    m.check_invariants()
    m.free("b")
    before = snapshot(m)
    with pytest.raises(KeyError):
        m.grow_each(keys, [7, 7])  # b is gone: the earlier lookup is not used
    assert snapshot(m) == before
    m.allocate("b", [7, 8, 9], 100)  # another request under the same id
    assert m.grow_each(keys, [7, 6]) and m.grow_each(keys, [8, 7])
    assert (m.num_tokens("a"), m.num_tokens("b")) == (8, 7) and len(m.block_table("b")) == 4
    with pytest.raises(ValueError):
        m.grow_each(keys, [7, 8])  # a would shrink: reported as by the general path
    with pytest.raises(ValueError):
        m.grow_each(keys, [8, 100])  # more blocks than the pool has
    assert (m.num_tokens("a"), m.num_tokens("b")) == (8, 7)
    m.check_invariants()


def test_grow_each_validates_before_changing_anything():
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("a", [1, 2, 3], 100)
    m.allocate("b", [4], 100)
    before = snapshot(m)
    with pytest.raises(KeyError):
        m.grow_each(["a", "nobody"], [4, 4])
    with pytest.raises(ValueError):
        m.grow_each(["a", "b"], [4, 0])  # b would shrink
    with pytest.raises(ValueError):
        m.grow_each(["a", "b"], [4, 100])  # more blocks than the pool has
    assert snapshot(m) == before
    with pytest.raises(ValueError, match="one token count per request and distinct requests"):
        m.grow_each(["a", "a"], [4, 4])
    with pytest.raises(ValueError, match="one token count per request"):
        m.grow_each(["a", "b"], [4])
    assert snapshot(m) == before
    ids = ("a", "b")
    assert m.grow_each(ids, np.array([4, 2]))  # the array path from here on
    with pytest.raises(ValueError, match="one token count per request"):
        m.grow_each(ids, np.array([5]))  # not broadcast over the group
    m.check_invariants()


def test_grow_each_keeps_no_reference_to_the_callers_array():
    """A caller that grows its array in place between calls (`n += 1`) still has every token counted."""
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.allocate("a", [1, 2, 3], 100)
    m.allocate("b", [4, 5, 6], 100)
    ids, n = ("a", "b"), np.array([4, 4], np.int64)
    for _ in range(5):
        assert m.grow_each(ids, n)
        n += 1
    assert m.slot_usage()[0] == 16 and [m.num_tokens(r) for r in ids] == [8, 8]
    m.check_invariants()
