"""Random interleavings of allocate / grow / grow_each / cache_blocks / free / evict / match / reset against a naive model.

The model keeps each request's full token sequence and token count, which prefixes were ever
cached and which are locked by live requests. It also plays the engine: every time a request
gains slots it "writes" into a fake KV memory, at `block_table[i // bs] * bs + i % bs`, a value
determined by the prefix up to token i (as real KV is). After every step, each live request must
read back its own prefix at every position: a block shared wrongly, evicted while held, or
matched against other tokens shows up there. Every failed call must change nothing.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tests.test_kv_manager import snapshot

from llmjax.kv import KVCacheManager

BS = 2
NUM_BLOCKS = 16  # 15 usable blocks, 30 slots: allocation fails and eviction runs often
NAMESPACES = [None, None, "tenant"]
PREFIXES = [[], [0, 0, 1, 1], [0, 0, 2, 2, 1], [1, 2, 1]]  # shared system prompts
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=8)


class KVMachine(RuleBasedStateMachine):
    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BS, self.caching)
        self.seq: dict[int, list[int]] = {}  # live request -> its tokens (at least num_tokens of them)
        self.held: dict[int, int] = {}  # live request -> num_tokens
        self.locked: dict[int, int] = {}  # live request -> tokens of its prefix that must stay cached
        self.ns: dict[int, object] = {}
        self.finished: list[tuple[list[int], object]] = []
        self.ever_cached: set[tuple[object, tuple[int, ...]]] = set()
        self.kv: dict[int, tuple] = {}  # slot -> (namespace, prefix) whose KV it holds
        self.next_id = 0
        self.group: tuple = ()  # the tuple `grow_each` was last given
        self.expected_stats = [0, 0, 0, 0]  # queries, queried tokens, hits, hit tokens

    # --- model helpers -------------------------------------------------------------------------

    def bounds(self, prompt: list[int], ns: object) -> tuple[int, int]:
        """(lowest, highest) prefix match the model allows for `prompt`."""
        if not self.caching:
            return 0, 0
        cap = (len(prompt) - 1) // BS * BS
        high = max((k for k in range(0, cap + 1, BS) if (ns, tuple(prompt[:k])) in self.ever_cached), default=0)
        low = 0
        for r, n in self.locked.items():
            if self.ns[r] == ns:
                common = 0
                while common < min(n, cap) and self.seq[r][common] == prompt[common]:
                    common += 1
                low = max(low, common // BS * BS)
        return low, high

    def write(self, r: int, start: int, stop: int) -> None:
        table = self.m.block_table(r)
        for i in range(start, stop):
            self.kv[table[i // BS] * BS + i % BS] = (self.ns[r], tuple(self.seq[r][: i + 1]))

    def remember_cached(self, r: int, n: int) -> None:
        if self.caching:
            self.ever_cached.update((self.ns[r], tuple(self.seq[r][:k])) for k in range(BS, n // BS * BS + 1, BS))
            self.locked[r] = max(self.locked[r], n // BS * BS)

    def pick(self, i: int) -> int:
        return sorted(self.held)[i % len(self.held)]

    # --- rules ---------------------------------------------------------------------------------

    @rule(reuse=st.booleans(), source=st.integers(0, 99), extra=tokens, ns=st.sampled_from(NAMESPACES),
          budget=st.integers(0, 12))
    def allocate(self, reuse, source, extra, ns, budget):
        """A new request: a shared prefix or a finished sequence (a re-admission when in its
        namespace), then more tokens."""
        reuse = reuse and self.finished
        base = self.finished[source % len(self.finished)][0] if reuse else PREFIXES[source % len(PREFIXES)]
        prompt = (base + extra) or [0]
        low, high = self.bounds(prompt, ns)
        peek = self.m.peek_prefix_len(prompt, ns)
        assert low <= peek <= high and peek % BS == 0
        before = snapshot(self.m)
        r = self.next_id
        if budget == 0 or self.m.num_blocks_for(len(prompt)) > NUM_BLOCKS - 1:  # the whole prompt must fit
            with pytest.raises(ValueError):
                self.m.allocate(r, prompt, budget, ns)
            assert snapshot(self.m) == before
            return
        result = self.m.allocate(r, prompt, budget, ns)
        if result is None:
            assert snapshot(self.m) == before
            return
        self.next_id += 1
        cached, new = result
        assert cached == peek and new == min(budget, len(prompt) - cached)
        self.seq[r], self.held[r], self.locked[r], self.ns[r] = prompt, cached + new, cached, ns
        self.expected_stats = [a + b for a, b in zip(self.expected_stats, [1, len(prompt), cached > 0, cached])]
        self.write(r, cached, cached + new)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99), more=st.integers(0, 8), new_tokens=tokens)
    def grow(self, i, more, new_tokens):
        r = self.pick(i)
        total = self.held[r] + more
        before = snapshot(self.m)
        if self.m.num_blocks_for(total) > NUM_BLOCKS - 1:
            with pytest.raises(ValueError):
                self.m.grow(r, total)
        elif self.m.grow(r, total):
            self.seq[r] += (new_tokens + [1] * total)[: max(0, total - len(self.seq[r]))]
            self.write(r, self.held[r], total)
            self.held[r] = total
            return
        assert snapshot(self.m) == before

    @precondition(lambda self: self.held)
    @rule(more=st.lists(st.integers(0, 3), min_size=1, max_size=6), new_tokens=tokens)
    def grow_each(self, more, new_tokens):
        """Every live request at once, passed as the same tuple object while the live set is the
        same (as the scheduler's steady decode batch): `grow_each`'s fast path."""
        keys = tuple(sorted(self.held))
        if keys != self.group:
            self.group = keys
        keys = self.group
        totals = [self.held[r] + more[j % len(more)] for j, r in enumerate(keys)]
        before = snapshot(self.m)
        if any(self.m.num_blocks_for(n) > NUM_BLOCKS - 1 for n in totals):
            with pytest.raises(ValueError):
                self.m.grow_each(keys, np.array(totals))
        elif self.m.grow_each(keys, np.array(totals)):
            for r, total in zip(keys, totals):
                self.seq[r] += (new_tokens + [1] * total)[: max(0, total - len(self.seq[r]))]
                self.write(r, self.held[r], total)
                self.held[r] = total
            return
        assert snapshot(self.m) == before

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def cache_blocks(self, i):
        r = self.pick(i)
        self.m.cache_blocks(r, self.seq[r][: self.held[r]])
        self.remember_cached(r, self.held[r])

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99), with_tokens=st.booleans())
    def free(self, i, with_tokens):
        r = self.pick(i)
        computed = self.seq[r][: self.held[r]]
        self.m.free(r, computed if with_tokens else None)
        if with_tokens:
            self.remember_cached(r, len(computed))
        self.finished.append((computed, self.ns[r]))
        for d in (self.seq, self.held, self.locked, self.ns):
            del d[r]

    @rule(r=st.integers(-3, -1))
    def free_unknown(self, r):
        before = snapshot(self.m)
        with pytest.raises(KeyError):
            self.m.free(r)
        assert snapshot(self.m) == before

    @precondition(lambda self: self.caching)
    @rule(n=st.integers(0, 6))
    def evict(self, n):
        evictable = self.m.usage().cached
        assert self.m.prefix_cache.evict(n) == min(n, evictable)

    @rule(prompt=tokens.filter(bool), ns=st.sampled_from(NAMESPACES))
    def match(self, prompt, ns):
        before = snapshot(self.m)
        low, high = self.bounds(prompt, ns)
        assert low <= self.m.peek_prefix_len(prompt, ns) <= high
        assert snapshot(self.m) == before

    @rule()
    def reset(self):
        assert self.m.reset_prefix_cache() == (not any(self.locked.values()))
        assert self.m.usage().cached == 0

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self):
        m = self.m
        m.check_invariants()
        assert {r: m.num_tokens(r) for r in self.held} == self.held
        assert not any(m.has_request(r) for r in range(self.next_id) if r not in self.held)
        slots = set()
        for r, n in self.held.items():
            table = m.block_table(r)
            assert len(table) == m.num_blocks_for(n)
            for i in range(n):
                slot = table[i // BS] * BS + i % BS
                assert self.kv[slot] == (self.ns[r], tuple(self.seq[r][: i + 1])), f"request {r} lost token {i}"
                slots.add(slot)
        used = len({b for r in self.held for b in m.block_table(r)})
        assert m.usage().used == used
        assert m.slot_usage() == (len(slots), used * BS - len(slots))
        s = m.stats()
        if self.caching:
            assert [s.queries, s.queried_tokens, s.hits, s.hit_tokens] == self.expected_stats


class KVMachineNoCaching(KVMachine):
    caching = False


SETTINGS = settings(max_examples=250, stateful_step_count=50, deadline=None)
TestKVStateMachine = KVMachine.TestCase
TestKVStateMachine.settings = SETTINGS
TestKVStateMachineNoCaching = KVMachineNoCaching.TestCase
TestKVStateMachineNoCaching.settings = SETTINGS
