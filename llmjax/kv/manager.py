"""KVCacheManager: per-request block tables over a `BlockPool` and an optional `RadixCache`.

A request's KV for token i lives in block `block_table[i // block_size]` at offset
`i % block_size`. Contract with the scheduler:

- `allocate` admits a request (prefix match, then fresh blocks); `grow` extends it as chunked
  prefill and decode add tokens; `free` ends it (finish, abort or preemption).
- A request holds one reference to each block of its table. With prefix caching on, the first
  `cached_pages` blocks of its table are tree blocks and it holds a lock on that tree path
  (so they cannot be evicted). They are full pages, shared read-only: the engine never writes a
  block before the request's first uncached token, and that token starts a fresh block.
- Every method validates its input before it changes anything: a call that raises, or that
  returns None / False for lack of room, leaves the manager unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from llmjax.kv.block_pool import BlockPool
from llmjax.kv.radix_cache import Node, PrefixCacheStats, PrefixMatch, RadixCache

_NO_MATCH = PrefixMatch((), 0, None, 0)


@dataclass(frozen=True, slots=True)
class KVUsage:
    """Block counts over the usable blocks (the null block excluded)."""

    num_blocks: int  # usable blocks
    used: int  # held by at least one request
    cached: int  # cached and held by none: evictable
    free: int  # neither held nor cached
    usage: float  # used / num_blocks


@dataclass(eq=False, slots=True)
class _Seq:
    block_table: list[int]
    num_tokens: int  # stale while the request is in a `_Group` with `stale` set
    capacity: int  # len(block_table) * block_size: the tokens its table holds room for
    node: Node | None  # deepest node of the locked tree path; None when nothing is locked
    cached_pages: int  # blocks of the locked path = the first blocks of block_table
    namespace: Hashable


@dataclass(eq=False, slots=True)
class _Group:
    """The requests of `grow_each`'s last call, given as a tuple. A steady decode batch grows the
    same requests every step: given the same `ids` tuple again, with no other method called since
    that changes a request, `grow_each` works on these arrays and leaves the `_Seq`s' `num_tokens`
    stale (`stale`) until a method reads them (`KVCacheManager._sync_group`)."""

    ids: tuple
    seqs: list[_Seq]
    num_tokens: np.ndarray  # [n] int64: each request's tokens (the truth while `stale`)
    capacity: np.ndarray  # [n] int64: each request's `_Seq.capacity`
    stale: bool = False


class KVCacheManager:
    """Block tables for running requests; see the module docstring for the contract."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.prefix_cache = RadixCache(self.block_pool, block_size) if enable_prefix_caching else None
        self._seqs: dict[Hashable, _Seq] = {}
        self._num_seq_tokens = 0  # sum of num_tokens over requests
        self._group: _Group | None = None  # see `_Group`

    def num_blocks_for(self, num_tokens: int) -> int:
        """ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def peek_prefix_len(self, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Tokens `allocate` would find cached now (0 with prefix caching off). No side effects, no stats."""
        return self.prefix_cache.match(token_ids, namespace).num_tokens if self.prefix_cache else 0

    def allocate(
        self, req_id: Hashable, token_ids: Sequence[int], max_new_tokens: int, namespace: Hashable = None,
        count_query: bool = True, match_prefix: bool = True,
    ) -> tuple[int, int] | None:
        """Admit a request that holds no blocks.

        Matches the cached prefix of `token_ids` (prefix caching on; at most len - 1 tokens, page
        aligned), locks it, and allocates fresh blocks so the request holds
        num_cached + num_new tokens, num_new = min(max_new_tokens, len(token_ids) - num_cached),
        evicting unlocked cached blocks as needed. Returns (num_cached, num_new), or None when
        the pool cannot hold that now (nothing changed, no stats counted). On success the query
        and its hit tokens are counted in `stats()` unless `count_query` is False (the
        scheduler's re-admission of a preempted request). `match_prefix` False: no cached prefix is
        used (a request that must compute its whole prompt; its pages are still cached later).
        `namespace` (a tenant; the engine passes a str or None): requests share cached pages only
        within one, namespaces being told apart as dict keys are (so 1 and True would be one).
        ValueError for a known req_id, empty token_ids, max_new_tokens < 1, or a request needing
        more blocks than the pool has in all.
        """
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} already holds blocks")
        self._sync_group(forget=True)
        if not token_ids or max_new_tokens < 1:
            raise ValueError(f"need token_ids and max_new_tokens >= 1, got {len(token_ids)} tokens, {max_new_tokens}")
        cache, pool = self.prefix_cache, self.block_pool
        match = cache.match(token_ids, namespace) if cache and match_prefix else _NO_MATCH
        num_cached = match.num_tokens
        num_new = min(max_new_tokens, len(token_ids) - num_cached)
        num_tokens = num_cached + num_new
        self._check_fits(len(token_ids))  # its whole prompt, not only this chunk
        need = self.num_blocks_for(num_tokens) - len(match.blocks)
        revived = sum(pool.ref_count(b) == 0 for b in match.blocks)  # evictable now, in use after
        if need > pool.num_free + pool.num_evictable - revived:
            return None
        node = cache.path_node(match) if cache else None
        if node is not None:
            cache.lock(node)
        pool.incref(match.blocks)
        table = [*match.blocks, *self._take(need)]
        self._seqs[req_id] = _Seq(table, num_tokens, len(table) * self.block_size, node, len(match.blocks), namespace)
        self._num_seq_tokens += num_tokens
        if cache and count_query:
            cache.record_query(len(token_ids), num_cached)
        return num_cached, num_new

    def grow(self, req_id: Hashable, num_tokens: int) -> bool:
        """Make the request hold `num_tokens` tokens in total; a block is added only when a block
        boundary is crossed. False (nothing changed) when there is no room even after eviction.
        KeyError for an unknown request; ValueError when num_tokens is below what it holds or
        needs more blocks than the pool has in all."""
        self._sync_group(forget=True)
        seq = self._seqs.get(req_id) or self._seq(req_id)  # the latter raises the KeyError
        held = seq.num_tokens
        if held <= num_tokens <= seq.capacity:  # within its last block
            seq.num_tokens = num_tokens
            self._num_seq_tokens += num_tokens - held
            return True
        return self.grow_each([req_id], [num_tokens])

    def grow_each(self, req_ids: Sequence[Hashable], num_tokens: Sequence[int] | np.ndarray) -> bool:
        """`grow` request `req_ids[i]` to `num_tokens[i]` tokens for every i, all or nothing: False
        (nothing changed) when the pool cannot hold the blocks they need together. New blocks are
        taken in the order of `req_ids`, as that many `grow` calls would. Errors as `grow`, checked
        before anything changes. Called again with the same tuple `req_ids`, and nothing else
        called in between, it works on arrays (see `_Group`): no per-request work unless a request
        crosses into a new block."""
        group = self._group
        if group is not None and req_ids is group.ids:
            grown = self._grow_group(group, np.array(num_tokens, np.int64))  # a copy: the group keeps it
            if grown is not None:
                return grown
        self._sync_group(forget=True)
        seqs = self._seqs
        try:
            held = [seqs[req_id] for req_id in req_ids]  # their `_Seq`s
        except KeyError as err:
            self._seq(err.args[0])  # raises the KeyError with its message
        num_tokens = np.asarray(num_tokens, np.int64).tolist()
        if len(num_tokens) != len(held) or len(set(map(id, held))) != len(held):
            raise ValueError(f"grow_each needs one token count per request and distinct requests, got "
                             f"{len(held)} requests ({len(set(map(id, held)))} distinct), {len(num_tokens)} counts")
        # the requests that cross into a new block (or ask for fewer tokens than they hold: an error)
        short = [(seq, n) for seq, n in zip(held, num_tokens) if not seq.num_tokens <= n <= seq.capacity]
        for seq, n in short:
            if n < seq.num_tokens:
                req_id = next(r for r, s in zip(req_ids, held) if s is seq)
                raise ValueError(f"request {req_id!r} holds {seq.num_tokens} tokens; cannot shrink to {n}")
            self._check_fits(n)
        if not self._extend([seq for seq, _ in short], [n for _, n in short]):
            return False
        before = sum([seq.num_tokens for seq in held])
        for seq, n in zip(held, num_tokens):
            seq.num_tokens = n
        self._num_seq_tokens += sum(num_tokens) - before
        if isinstance(req_ids, tuple):
            self._group = _Group(req_ids, held, np.array(num_tokens, np.int64),
                                 np.array([seq.capacity for seq in held], np.int64))
        return True

    def _grow_group(self, group: _Group, wanted: np.ndarray) -> bool | None:
        """`grow_each` on the group's arrays; None (nothing changed) when a request would shrink or
        not fit the pool at all, or the counts are not one per request, which the general path reports."""
        if wanted.shape != group.num_tokens.shape or (wanted < group.num_tokens).any():
            return None
        crossing = np.flatnonzero(wanted > group.capacity).tolist()
        if crossing:
            if self.num_blocks_for(int(wanted[crossing].max())) > self.block_pool.num_usable:
                return None
            if not self._extend([group.seqs[i] for i in crossing], wanted[crossing].tolist()):
                return False
            for i in crossing:
                group.capacity[i] = group.seqs[i].capacity
        self._num_seq_tokens += int(wanted.sum() - group.num_tokens.sum())
        group.num_tokens, group.stale = wanted, True
        return True

    def _extend(self, seqs: list[_Seq], num_tokens: list[int]) -> bool:
        """Give each of `seqs` the blocks for `num_tokens[i]` tokens, in order, all or nothing."""
        need = sum(self.num_blocks_for(n) - len(seq.block_table) for seq, n in zip(seqs, num_tokens))
        if need > self.block_pool.num_free + self.block_pool.num_evictable:
            return False
        for seq, n in zip(seqs, num_tokens):
            seq.block_table += self._take(self.num_blocks_for(n) - len(seq.block_table))
            seq.capacity = len(seq.block_table) * self.block_size
        return True

    def _sync_group(self, forget: bool) -> None:
        """Write the group's token counts back to its `_Seq`s; `forget` it too before a request's
        tokens or blocks change or a request comes or goes. Every method that reads a request's
        `num_tokens` or changes a request calls it first (`grow_each`'s fast path aside)."""
        group = self._group
        if group is None:
            return
        if group.stale:
            for seq, n in zip(group.seqs, group.num_tokens.tolist()):
                seq.num_tokens = n
            group.stale = False
        if forget:
            self._group = None

    def cache_blocks(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        """Insert the full pages of `token_ids` (the request's tokens whose KV is computed, a
        prefix of its sequence) into the tree and lock the longer path. Where another request
        already cached a page, the request's table switches to that canonical block, and only
        then is its own duplicate released. A no-op with prefix caching off, or when token_ids add
        no page to the cached ones (they are then not compared with them: `free` calls it for every
        finished request). KeyError for an unknown request; ValueError when token_ids is longer
        than the tokens it holds or, adding a page, disagrees with the content of its cached blocks."""
        self._sync_group(forget=False)  # the tokens and capacities stay; block ids may be swapped
        seq = self._seq(req_id)
        if len(token_ids) > seq.num_tokens:
            raise ValueError(f"request {req_id!r} holds {seq.num_tokens} tokens, not {len(token_ids)}")
        cache = self.prefix_cache
        num_pages = len(token_ids) // self.block_size
        if cache is None or num_pages <= seq.cached_pages:  # no new page: nothing to insert (or compare)
            return
        node, canonical = cache.insert(token_ids, seq.block_table, seq.namespace)
        assert node is not None
        table = seq.block_table
        swaps = [i for i, b in enumerate(canonical) if b != table[i]]
        duplicates = [table[i] for i in swaps]
        self.block_pool.incref([canonical[i] for i in swaps])
        for i in swaps:
            table[i] = canonical[i]
        self.block_pool.decref(duplicates)
        cache.lock(node)
        if seq.node is not None:
            cache.unlock(seq.node)
        seq.node, seq.cached_pages = node, num_pages

    def free(self, req_id: Hashable, token_ids: Sequence[int] | None = None) -> None:
        """Release a finished, aborted or preempted request. With `token_ids` (the tokens whose
        KV is computed) their full pages are cached first, as by `cache_blocks`. Its cached blocks
        become evictable tail first. KeyError for an unknown (or already freed) request; ValueError
        for bad token_ids, as in `cache_blocks` (then the request is not freed)."""
        self._sync_group(forget=True)
        seq = self._seq(req_id)
        if token_ids is not None:
            self.cache_blocks(req_id, token_ids)
        del self._seqs[req_id]
        if seq.node is not None:
            self.prefix_cache.unlock(seq.node)
        self.block_pool.decref(seq.block_table[::-1])
        self._num_seq_tokens -= seq.num_tokens

    def block_table(self, req_id: Hashable) -> list[int]:
        """The request's blocks, a live read-only view: do not mutate it. It grows with `grow`,
        and `cache_blocks` may swap entries for canonical blocks holding the same tokens."""
        return self._seq(req_id).block_table

    def num_tokens(self, req_id: Hashable) -> int:
        """The tokens the request holds slots for (what it was last allocated or grown to)."""
        self._sync_group(forget=False)
        return self._seq(req_id).num_tokens

    def has_request(self, req_id: Hashable) -> bool:
        return req_id in self._seqs

    def usage(self) -> KVUsage:
        pool = self.block_pool
        return KVUsage(pool.num_usable, pool.num_in_use, pool.num_evictable, pool.num_free, pool.num_in_use / pool.num_usable)

    def slot_usage(self) -> tuple[int, int]:
        """(slots holding token states, allocated but empty slots) over blocks held by requests.

        Shared blocks count once; they are full. The empty slots are the tails of the requests'
        last blocks. Cached blocks no request holds are not counted (see `usage().cached`)."""
        filled = self._num_seq_tokens - self.block_pool.num_extra_refs * self.block_size
        return filled, self.block_pool.num_in_use * self.block_size - filled

    def stats(self) -> PrefixCacheStats:
        """Prefix-cache statistics since construction; all zero with prefix caching off."""
        return self.prefix_cache.stats() if self.prefix_cache else PrefixCacheStats(0, 0, 0, 0, 0)

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block no request holds. True when the cache is now empty; False when
        running requests still lock cached paths (those stay). Statistics are kept."""
        return self.prefix_cache.reset() if self.prefix_cache else True

    def check_invariants(self) -> None:
        """Raise AssertionError unless: free + evictable + in use == num_blocks - 1; each block's ref
        count equals the number of block tables holding it (the tree holds no references); no
        block is both free and mapped; each table covers its tokens exactly, holds no block twice
        and starts with its locked tree path, in its own namespace's tree, its other blocks its own
        (uncached, held by no other table); each cached node's blocks hold exactly its tokens."""
        self._sync_group(forget=False)
        pool = self.block_pool
        pool.check_invariants()
        holders = Counter(b for seq in self._seqs.values() for b in seq.block_table)
        for b in range(self.num_blocks):
            assert pool.ref_count(b) == holders[b], f"block {b}: ref count {pool.ref_count(b)}, {holders[b]} tables hold it"
        for req_id, seq in self._seqs.items():
            assert len(seq.block_table) == self.num_blocks_for(seq.num_tokens), f"{req_id!r}: table does not fit its tokens"
            assert len(set(seq.block_table)) == len(seq.block_table), f"{req_id!r}: a block twice in its table"
            own = seq.block_table[seq.cached_pages:]  # past its locked path: its own, shared with no one
            assert all(pool.ref_count(b) == 1 and not pool.is_cached(b) for b in own), (
                f"{req_id!r}: a block past its cached pages is shared or cached")
            assert seq.capacity == len(seq.block_table) * self.block_size, f"{req_id!r}: capacity drifted"
            if self.prefix_cache:
                path = self.prefix_cache.path_blocks(seq.node)
                assert path == seq.block_table[: seq.cached_pages] and len(path) == seq.cached_pages, (
                    f"{req_id!r}: locked tree path is not the head of its block table"
                )
                assert seq.node is None or seq.node.namespace == seq.namespace, (
                    f"{req_id!r} of namespace {seq.namespace!r} holds a path of {seq.node.namespace!r}"
                )
        assert self._num_seq_tokens == sum(s.num_tokens for s in self._seqs.values()), "token counter drifted"
        if self._group is not None:
            group = self._group
            assert all(self._seqs.get(r) is seq for r, seq in zip(group.ids, group.seqs)), "grow_each's group names a request it no longer holds"
            assert group.num_tokens.tolist() == [seq.num_tokens for seq in group.seqs], "group's tokens drifted"
            assert group.capacity.tolist() == [seq.capacity for seq in group.seqs], "group's capacities drifted"
        if self.prefix_cache:
            self.prefix_cache.check_invariants()

    def _seq(self, req_id: Hashable) -> _Seq:
        try:
            return self._seqs[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r} (never allocated, or already freed)") from None

    def _check_fits(self, num_tokens: int) -> None:
        if self.num_blocks_for(num_tokens) > self.block_pool.num_usable:
            raise ValueError(
                f"{num_tokens} tokens need {self.num_blocks_for(num_tokens)} blocks; the pool has "
                f"{self.block_pool.num_usable} usable blocks of {self.block_size} tokens"
            )

    def _take(self, n: int) -> list[int]:
        """n fresh blocks, evicting unlocked cached blocks first when too few are free."""
        if self.prefix_cache and self.block_pool.num_free < n:
            self.prefix_cache.evict(n - self.block_pool.num_free)
        return self.block_pool.allocate(n)
