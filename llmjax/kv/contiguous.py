"""Contiguous KV allocators: the Orca baselines of the PagedAttention paper (Kwon et al., SOSP 2023, §6.1).

Each request reserves one contiguous run of token slots when it is admitted and keeps it until it
finishes. How much it reserves is the policy:

- ``max``:    ``max_model_len`` slots ("Orca (Max)");
- ``pow2``:   the prompt plus the output length rounded up to a power of two, at most 2x the output
              (the paper: "if the true output length is 25, it reserves 32 positions"; "Orca (Pow2)");
- ``oracle``: exactly prompt + output ("Orca (Oracle)").

The run comes from a binary buddy allocator over the slot space, as the paper assumes, so external
fragmentation is real: a request waits while the free slots, though many, hold no aligned
power-of-two block big enough for it. Output lengths come from the caller (the simulator draws
them); `pow2` and `oracle` need them to size a reservation, and every policy needs them to tell
reservation (slots the request will still fill) from internal fragmentation (slots it never fills).

`ContiguousKVCache` duck-types the part of `KVCacheManager` the scheduler calls, with no prefix
caching: `peek_prefix_len` is 0 and `cache_blocks` a no-op. A reservation never has to grow, so the
scheduler never preempts a request that holds one.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("max", "pow2", "oracle")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def reservation(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Slots a request of `prompt_len` + `output_len` tokens reserves under `policy`."""
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(prompt_len + next_pow2(output_len), max_model_len)
    if policy == "oracle":
        return prompt_len + output_len
    raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")


@dataclass(frozen=True, slots=True)
class SlotBreakdown:
    """Where a KV pool's token slots are at one moment; the five counts sum to `total`.

    - token_states: slots holding a computed token's KV;
    - reservation:  held by a request for tokens it will still produce;
    - internal:     held by a request's own reservation but never to be filled (past its final
                    length; for a paged pool, the empty tail of each request's last block);
    - rounding:     handed out by the allocator beyond the reservation asked for (buddy blocks are
                    powers of two);
    - free:         held by no request (for a paged pool, cached blocks nobody holds count here).

    "External fragmentation and others" in the paper's Figure 2 is `rounding + free`.
    """

    total: int
    token_states: int
    reservation: int
    internal: int
    rounding: int
    free: int

    def __post_init__(self) -> None:
        parts = (self.token_states, self.reservation, self.internal, self.rounding, self.free)
        if min(parts) < 0 or sum(parts) != self.total:
            raise ValueError(f"slot breakdown {parts} does not partition {self.total} slots")

    @property
    def external(self) -> int:
        return self.rounding + self.free


class BuddyAllocator:
    """Binary buddy allocator over the slots [0, size).

    The space starts as its maximal aligned power-of-two blocks (one per set bit of `size`, largest
    first). `allocate(n)` hands out a block of 2^ceil(log2 n) slots, split from the smallest free
    block large enough (lowest address among equals); `free` merges a block with its buddy while
    the buddy is free at the same order. So a request fits iff some aligned power-of-two range of
    its size is entirely free inside one of the starting blocks. Offsets identify allocations.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a buddy allocator needs at least one slot, got size={size}")
        self.size = size
        self._free: list[set[int]] = [set() for _ in range(size.bit_length())]  # order -> offsets
        self._allocated: dict[int, int] = {}  # offset -> order
        self.num_free = size
        offset = 0
        for order in reversed(range(size.bit_length())):
            if size >> order & 1:
                self._free[order].add(offset)
                offset += 1 << order

    @staticmethod
    def order_for(n: int) -> int:
        """The order of the block serving n slots: 2^order >= n."""
        return (n - 1).bit_length()

    def allocate(self, n: int) -> int | None:
        """Offset of a fresh block of next_pow2(n) slots, or None when no free block is large enough."""
        if n < 1:
            raise ValueError(f"cannot allocate {n} slots")
        want = self.order_for(n)
        order = next((o for o in range(want, len(self._free)) if self._free[o]), None)
        if order is None:
            return None
        offset = min(self._free[order])
        self._free[order].remove(offset)
        while order > want:
            order -= 1
            self._free[order].add(offset + (1 << order))
        self._allocated[offset] = want
        self.num_free -= 1 << want
        return offset

    def free(self, offset: int) -> None:
        """Return the block at `offset`; KeyError when no block starts there."""
        order = self._allocated.pop(offset)
        self.num_free += 1 << order
        while order < len(self._free) - 1 and (buddy := offset ^ (1 << order)) in self._free[order]:
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    def block_size(self, offset: int) -> int:
        return 1 << self._allocated[offset]

    @property
    def largest_request(self) -> int:
        """The most slots one allocation can ever get: the largest starting block (a request is
        rounded up to a power of two, which must fit inside one of them)."""
        return 1 << (self.size.bit_length() - 1)

    def largest_free(self) -> int:
        """Slots in the largest free block: the biggest request that would fit now (0 when full)."""
        return max((1 << o for o, offsets in enumerate(self._free) if offsets), default=0)

    def check_invariants(self) -> None:
        """Raise AssertionError unless free and allocated blocks are aligned, tile [0, size) without
        overlap, no free block has its buddy free at the same order, and `num_free` is right."""
        blocks = [(off, o, True) for o, offsets in enumerate(self._free) for off in offsets]
        blocks += [(off, o, False) for off, o in self._allocated.items()]
        end = 0
        for off, order, _ in sorted(blocks):
            assert off % (1 << order) == 0, f"block at {off} of order {order} is misaligned"
            assert off == end, f"gap or overlap at slot {end} (next block starts at {off})"
            end = off + (1 << order)
        assert end == self.size, f"blocks cover [0, {end}), not [0, {self.size})"
        for order, offsets in enumerate(self._free):
            for off in offsets:
                assert off ^ (1 << order) not in offsets, f"free buddies at {off} of order {order} were not merged"
        assert self.num_free == sum(len(s) << o for o, s in enumerate(self._free)), "free counter drifted"


@dataclass(slots=True)
class _Span:
    offset: int
    reserved: int  # slots the policy asked for; the buddy block may be larger
    num_tokens: int  # slots holding (or about to hold) token states
    # prompt + output: the tokens the request will ever have. The last output token's KV is never
    # written (the request ends when it is sampled), so one slot of it stays "reservation" to the
    # end: the oracle reserves for every token, as the paper's does (about 0.1 point of the pool)
    final_len: int


class ContiguousKVCache:
    """Per-request contiguous reservations from a `BuddyAllocator`; see the module docstring.

    `lengths[req_id] = (prompt_len, output_len)`: the oracle's knowledge of every request it will
    see. Like `KVCacheManager`, a call that raises or returns None leaves the state unchanged.
    """

    def __init__(self, num_slots: int, policy: str, max_model_len: int,
                 lengths: Mapping[Hashable, tuple[int, int]]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
        self.policy = policy
        self.max_model_len = max_model_len
        self.lengths = lengths
        self.buddy = BuddyAllocator(num_slots)
        self._spans: dict[Hashable, _Span] = {}

    @property
    def num_slots(self) -> int:
        return self.buddy.size

    def allocate(self, req_id: Hashable, token_ids: Sequence[int], max_new_tokens: int,
                 namespace: Hashable = None, count_query: bool = True,
                 match_prefix: bool = True) -> tuple[int, int] | None:
        """Reserve the request's whole run; returns (0, min(max_new_tokens, len(token_ids))) or None
        when no buddy block is large enough now. `count_query` and `match_prefix` are the
        scheduler's interface; with no prefix cache nothing is counted and nothing ever matches.
        ValueError: a known request, no tokens, max_new_tokens < 1, a reservation larger than
        max_model_len or than the pool's largest block (`BuddyAllocator.largest_request`: it could
        never be placed), or token_ids longer than the request's final length."""
        if req_id in self._spans:
            raise ValueError(f"request {req_id!r} already holds a reservation")
        if not token_ids or max_new_tokens < 1:
            raise ValueError(f"need token_ids and max_new_tokens >= 1, got {len(token_ids)} tokens, {max_new_tokens}")
        prompt_len, output_len = self.lengths[req_id]
        final_len = prompt_len + output_len
        reserved = reservation(self.policy, prompt_len, output_len, self.max_model_len)
        if not len(token_ids) <= final_len <= reserved <= min(self.max_model_len, self.buddy.largest_request):
            raise ValueError(f"request {req_id!r}: {len(token_ids)} tokens now, {final_len} in all, {reserved} "
                             f"reserved; max_model_len {self.max_model_len}, {self.num_slots} slots, of which "
                             f"{self.buddy.largest_request} the largest block")
        offset = self.buddy.allocate(reserved)
        if offset is None:
            return None
        num_new = min(max_new_tokens, len(token_ids))
        self._spans[req_id] = _Span(offset, reserved, num_new, final_len)
        return 0, num_new

    def grow(self, req_id: Hashable, num_tokens: int) -> bool:
        """Fill `num_tokens` slots of the reservation; always True. ValueError when that shrinks the
        request or overruns its final length (the lengths it was given were wrong)."""
        span = self._span(req_id)
        if not span.num_tokens <= num_tokens <= span.final_len:
            raise ValueError(f"request {req_id!r}: cannot go from {span.num_tokens} to {num_tokens} tokens "
                             f"(final length {span.final_len})")
        span.num_tokens = num_tokens
        return True

    def grow_each(self, req_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> bool:
        """`grow` for each request, every one checked before any changes; always True."""
        spans = [self._span(r) for r in req_ids]
        for span, req_id, n in zip(spans, req_ids, num_tokens):
            if not span.num_tokens <= n <= span.final_len:
                self.grow(req_id, n)  # raises
        for span, n in zip(spans, num_tokens):
            span.num_tokens = n
        return True

    def free(self, req_id: Hashable, token_ids: Sequence[int] | None = None) -> None:
        """Release the request's run (finish, abort or preemption). KeyError for an unknown request."""
        self.buddy.free(self._span(req_id).offset)
        del self._spans[req_id]

    def cache_blocks(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        """No prefix caching: nothing to do (KeyError for an unknown request, as the paged manager)."""
        self._span(req_id)

    def peek_prefix_len(self, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        return 0

    def has_request(self, req_id: Hashable) -> bool:
        return req_id in self._spans

    def span(self, req_id: Hashable) -> tuple[int, int]:
        """(first slot, slots handed out): the request's run, the contiguous block table."""
        offset = self._span(req_id).offset
        return offset, self.buddy.block_size(offset)

    def breakdown(self) -> SlotBreakdown:
        spans = self._spans.values()
        tokens = sum(s.num_tokens for s in spans)
        final = sum(s.final_len for s in spans)
        reserved = sum(s.reserved for s in spans)
        handed_out = self.num_slots - self.buddy.num_free
        return SlotBreakdown(self.num_slots, tokens, final - tokens, reserved - final, handed_out - reserved,
                             self.buddy.num_free)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the buddy allocator is consistent, its allocations are exactly
        the requests' runs, and each run holds its request's tokens within its reservation."""
        self.buddy.check_invariants()
        assert sorted(s.offset for s in self._spans.values()) == sorted(self.buddy._allocated), (
            "buddy allocations and request runs disagree")
        for req_id, s in self._spans.items():
            assert s.num_tokens <= s.final_len <= s.reserved <= self.buddy.block_size(s.offset), (
                f"{req_id!r}: {s.num_tokens} tokens, final {s.final_len}, reserved {s.reserved}, "
                f"block {self.buddy.block_size(s.offset)}")

    def _span(self, req_id: Hashable) -> _Span:
        try:
            return self._spans[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r} (never allocated, or already freed)") from None
