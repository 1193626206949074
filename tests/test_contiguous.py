"""Contiguous KV allocators: the buddy allocator against a naive slot-array model; reservations; breakdowns."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from llmjax.kv.contiguous import BuddyAllocator, ContiguousKVCache, SlotBreakdown, next_pow2, reservation


class NaiveBuddy:
    """Slot ownership as a plain list. A buddy system with full coalescing can place a request of n slots
    iff some range of next_pow2(n) slots, aligned to its size and inside one of the starting blocks (the
    aligned powers of two that `size`'s binary digits cut), is entirely free."""

    def __init__(self, size: int) -> None:
        self.owner: list[int | None] = [None] * size
        self.tops, start = [], 0
        for order in reversed(range(size.bit_length())):
            if size >> order & 1:
                self.tops.append((start, 1 << order))
                start += 1 << order

    def fits(self, width: int) -> bool:
        return any(all(o is None for o in self.owner[a : a + width])
                   for start, size in self.tops if size >= width for a in range(start, start + size, width))

    def largest_fit(self) -> int:
        return max((w for w in (1 << k for k in range(len(self.owner).bit_length())) if self.fits(w)), default=0)


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 100), data=st.data())
def test_buddy_matches_naive_model(size: int, data: st.DataObject) -> None:
    buddy, naive = BuddyAllocator(size), NaiveBuddy(size)
    live: dict[int, int] = {}  # offset -> width
    for step in range(data.draw(st.integers(1, 40))):
        if live and data.draw(st.booleans()):
            offset = data.draw(st.sampled_from(sorted(live)))
            buddy.free(offset)
            width = live.pop(offset)
            naive.owner[offset : offset + width] = [None] * width
        else:
            n = data.draw(st.integers(1, size))
            width = next_pow2(n)
            fits = naive.fits(width)
            offset = buddy.allocate(n)
            assert (offset is not None) == fits, f"allocate({n}) -> {offset}, the model says fits={fits}"
            if offset is not None:
                assert offset % width == 0 and buddy.block_size(offset) == width
                assert any(s <= offset and offset + width <= s + z for s, z in naive.tops), "crosses a starting block"
                assert all(o is None for o in naive.owner[offset : offset + width]), "block overlaps a live one"
                naive.owner[offset : offset + width] = [step] * width
                live[offset] = width
        buddy.check_invariants()
        assert buddy.num_free == naive.owner.count(None)
        assert buddy.largest_free() == naive.largest_fit()
    for offset in list(live):
        buddy.free(offset)
    assert buddy.largest_free() == naive.tops[0][1] and buddy.num_free == size  # fully coalesced again


def test_buddy_errors() -> None:
    buddy = BuddyAllocator(16)
    with pytest.raises(ValueError):
        buddy.allocate(0)
    assert buddy.allocate(17) is None
    offset = buddy.allocate(3)
    with pytest.raises(KeyError):
        buddy.free(offset + 1)
    buddy.free(offset)
    with pytest.raises(KeyError):
        buddy.free(offset)
    with pytest.raises(ValueError):
        BuddyAllocator(0)


def test_reservations_follow_the_paper() -> None:
    # Orca (Pow2): "if the true output length is 25, it reserves 32 positions for outputs"
    assert reservation("pow2", 100, 25, 2048) == 132
    assert reservation("pow2", 100, 32, 2048) == 132
    assert reservation("pow2", 1500, 600, 2048) == 2048  # capped at the maximum length
    assert reservation("max", 100, 25, 2048) == 2048
    assert reservation("oracle", 100, 25, 2048) == 125
    with pytest.raises(ValueError):
        reservation("lifo", 1, 1, 8)


def test_contiguous_cache_lifecycle_and_breakdown() -> None:
    lengths = {"a": (5, 10), "b": (3, 4), "c": (40, 20)}
    kv = ContiguousKVCache(64, "pow2", 64, lengths)  # a: 5 + 16 = 21 -> block 32; b: 3 + 4 = 7 -> block 8
    assert kv.allocate("a", list(range(5)), 2) == (0, 2)  # the chunk is what the budget allows
    assert kv.allocate("b", list(range(3)), 16) == (0, 3)
    assert kv.allocate("c", list(range(40)), 64) is None  # 60 slots need a 64-block; only 24 are free
    assert not kv.has_request("c")
    assert kv.grow("a", 5)
    assert kv.breakdown() == SlotBreakdown(total=64, token_states=5 + 3, reservation=10 + 4, internal=6 + 0,
                                           rounding=11 + 1, free=24)
    assert kv.breakdown().external == 36
    kv.check_invariants()
    (oa, na), (ob, nb) = kv.span("a"), kv.span("b")
    assert (na, nb) == (32, 8) and (oa + na <= ob or ob + nb <= oa)
    with pytest.raises(ValueError):
        kv.grow("a", 16)  # past its final length: the lengths were wrong
    with pytest.raises(ValueError):
        kv.grow("a", 4)  # shrinking
    with pytest.raises(ValueError):
        kv.allocate("a", [1], 1)  # already holds a run
    assert kv.peek_prefix_len([1, 2, 3]) == 0
    kv.cache_blocks("a", [1, 2])  # a no-op
    kv.free("a")
    kv.free("b")
    with pytest.raises(KeyError):
        kv.free("a")
    assert kv.allocate("c", list(range(40)), 64) == (0, 40)
    kv.check_invariants()


def test_contiguous_cache_refuses_impossible_requests() -> None:
    kv = ContiguousKVCache(64, "max", 128, {"big": (10, 10)})
    with pytest.raises(ValueError):
        kv.allocate("big", [1] * 10, 10)  # 128 reserved > 64 slots
    with pytest.raises(ValueError):
        ContiguousKVCache(64, "lifo", 64, {})
