"""A fixed pool of KV cache blocks: reference counts, a free list and an eviction queue.

Every usable block (ids 1 .. num_blocks-1; block 0 is the null block, never handed out)
is in exactly one of three states:

- free:      ref count 0, holds no cached tokens; kept on a LIFO free list.
- evictable: ref count 0, holds a cached page (it belongs to a radix-tree node); kept in
             eviction order, least recently used first. The radix cache evicts from the head.
- in use:    ref count >= 1, i.e. held by that many request block tables. It may also be cached.

Ref counts count block tables only: the radix tree holds no reference of its own (a cached
block nobody holds is evictable, not free). Every operation is O(1) per block and validates
its whole input before changing anything, so a failed call leaves the pool unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

NULL_BLOCK = 0

Page = tuple[int, ...]


class BlockPool:
    """Owns block states, ref counts and the token content recorded for cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs the null block and at least one usable block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        # content[b]: the page of token ids a cached block holds, None when not cached.
        self._content: list[Page | None] = [None] * num_blocks
        # Popped from the end: low block ids are handed out first.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._num_in_use = 0
        self._num_cached = 0
        self._extra_refs = 0  # sum over blocks of max(ref - 1, 0): table entries beyond the first

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks with no references and no cached content."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with no references (reclaimable by eviction)."""
        return len(self._evictable)

    @property
    def num_in_use(self) -> int:
        """Blocks held by at least one block table."""
        return self._num_in_use

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached page, in use or evictable."""
        return self._num_cached

    @property
    def num_extra_refs(self) -> int:
        """Table entries beyond the first per block: how many slots sharing saves, in blocks."""
        return self._extra_refs

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def content(self, block: int) -> Page | None:
        """The page of token ids a cached block holds; None when the block is not cached."""
        return self._content[block]

    def is_cached(self, block: int) -> bool:
        return self._content[block] is not None

    def eviction_order(self) -> list[int]:
        """Evictable blocks, the next to evict first (a copy, for inspection and tests)."""
        return list(self._evictable)

    def allocate(self, n: int) -> list[int]:
        """Hand out n free (uncached) blocks with ref count 1. Never evicts: the caller evicts first.

        Raises ValueError when fewer than n blocks are free.
        """
        if n < 0 or n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: {len(self._free)} free")
        if n == 0:
            return []
        blocks = self._free[-n:]
        del self._free[-n:]
        blocks.reverse()
        for b in blocks:
            self._ref[b] = 1
        self._num_in_use += n
        return blocks

    def incref(self, blocks: Sequence[int]) -> None:
        """Add one reference to each block (a block table starts holding it).

        Each block must be in use or evictable (an evictable block leaves the eviction queue).
        Raises ValueError for a free block, the null block, an unknown id or a block listed twice.
        """
        self.check_distinct(blocks)
        for b in blocks:
            if self._ref[b] == 0 and b not in self._evictable:
                raise ValueError(f"block {b} is neither in use nor cached: it cannot be shared")
        for b in blocks:
            if self._ref[b] == 0:
                del self._evictable[b]
                self._num_in_use += 1
            else:
                self._extra_refs += 1
            self._ref[b] += 1

    def decref(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block, in the given order.

        A block reaching ref count 0 becomes evictable (appended to the eviction queue, so pass a
        sequence tail first: its last block is evicted first) when cached, free otherwise.
        Raises ValueError (double free) when a block has no reference, is listed twice or is not a usable id.
        """
        self.check_distinct(blocks)
        for b in blocks:
            if self._ref[b] <= 0:
                raise ValueError(f"double free: block {b} has ref count 0")
        for b in blocks:
            ref = self._ref[b] - 1
            self._ref[b] = ref
            if ref > 0:
                self._extra_refs -= 1
                continue
            self._num_in_use -= 1
            if self._content[b] is None:
                self._free.append(b)
            else:
                self._evictable[b] = None

    def mark_cached(self, block: int, page: Page) -> None:
        """Record that an in-use block now holds `page` as a radix-tree node's content."""
        if self._ref[block] <= 0 or self._content[block] is not None:
            raise ValueError(f"block {block} must be in use and not yet cached to be cached")
        self._content[block] = page
        self._num_cached += 1

    def evict_lru(self) -> int:
        """Evict the head of the eviction queue: it forgets its content and becomes free.

        Returns the block id so the radix cache can detach it. Raises ValueError when nothing is evictable.
        """
        if not self._evictable:
            raise ValueError("no evictable block")
        b, _ = self._evictable.popitem(last=False)
        self._content[b] = None
        self._num_cached -= 1
        self._free.append(b)
        return b

    def check_invariants(self) -> None:
        """Raise AssertionError when the block states disagree with each other."""
        n = self.num_blocks
        assert self._ref[NULL_BLOCK] == 0 and self._content[NULL_BLOCK] is None, "null block was handed out"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert NULL_BLOCK not in free and NULL_BLOCK not in self._evictable, "null block is free or evictable"
        assert not free & self._evictable.keys(), "a block is both free and evictable"
        in_use = [b for b in range(1, n) if self._ref[b] > 0]
        assert len(free) + len(self._evictable) + len(in_use) == n - 1, (
            f"free {len(free)} + evictable {len(self._evictable)} + in_use {len(in_use)} != {n - 1}"
        )
        assert self._num_in_use == len(in_use), f"in-use counter {self._num_in_use} != {len(in_use)}"
        for b in free:
            assert self._ref[b] == 0 and self._content[b] is None, f"free block {b} is referenced or cached"
        for b in self._evictable:
            assert self._ref[b] == 0 and self._content[b] is not None, f"evictable block {b} is referenced or uncached"
        assert all(r >= 0 for r in self._ref), "negative ref count"
        assert self._num_cached == sum(c is not None for c in self._content), "cached counter drifted"
        assert self._extra_refs == sum(max(r - 1, 0) for r in self._ref), "extra-ref counter drifted"

    def check_distinct(self, blocks: Iterable[int]) -> None:
        """ValueError unless `blocks` are distinct ids of real blocks (not the null block)."""
        seen: set[int] = set()
        for b in blocks:
            if b in seen or not NULL_BLOCK < b < self.num_blocks:
                raise ValueError(f"block {b} is out of range, the null block, or listed twice")
            seen.add(b)
