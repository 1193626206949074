"""The scheduler: which requests run each step, how many tokens each computes, and what each step's
sampled tokens do to them. It owns every request's per-step state.

Plain Python and numpy, no JAX. Policies (`EngineConfig.scheduling_policy`):

- continuous (vLLM v1 style): each step, running requests first, then waiting ones, under one
  token budget (`max_num_batched_tokens`) and at most `max_num_seqs` requests. With chunked
  prefill a prompt longer than the remaining budget is split, so prefill chunks and decodes
  share a step; running decodes are scheduled before any new chunk, so a chunk never starves them.
- static: a batch of `batch_size` sequences forms when that many have arrived (or the input is
  closed) and runs until its longest member finishes; then the next batch forms. A request with
  n > 1 counts n sequences, and all its samples belong to its batch (the engine refuses n above
  `batch_size`); the batch takes whole requests in queue order. A server never closes its input, so it refuses
  this policy (a partial batch would wait forever): dynamic is static with a deadline.
- dynamic: static, but a batch also leaves once its oldest request has waited `max_delay` seconds.

When the KV pool runs out, the most recently admitted running request is preempted (recompute):
its blocks are freed (full pages go to the prefix cache) and it returns to the front of the
waiting queue with its output so far. No request is admitted in a step that preempted.

One step's life: `schedule()` advances each scheduled request's `num_computed_tokens` and
returns a `SchedulerOutput` (the runner's inputs as plain arrays); once the step's tokens are
sampled, `update_from_output(out, sampled)` appends them, checks EOS, stop ids, `max_tokens` and
`max_model_len`, and frees the requests that finished. The engine then handles text (stop
strings) and outputs.

Asynchronous scheduling: step N+1 may be scheduled before step N's tokens reach the host. A
request that samples in a step holds that token as `num_pending` until its update; the next step
feeds it from the device (`token_source`: its index in the previous step's sampled tokens). A
request that step N finishes (EOS, a stop) may already be in step N+1; its token from N+1 is
dropped. `max_tokens` and `max_model_len` are known in advance, so a request that reaches them
is not scheduled again. The device runs steps in order, so blocks freed while a later step is in
flight can be reused at once: that step's stale writes land before the next owner's.

Each running request holds a batch row in [0, max_num_seqs) from admission until it finishes or
is preempted: the runner keeps its sampling parameters and logits-processing table there.

Not thread-safe: one engine loop calls every method.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np

from llmjax.buckets import StepBuckets
from llmjax.config import EngineConfig
from llmjax.kv.manager import KVCacheManager
from llmjax.request import Request, RequestStatus
from llmjax.sampling_params import SamplingParams



def _empty() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclass(frozen=True)
class RowInit:
    """A request that took batch row `row` this step: what the runner keeps per row. The token
    lists are the request's own (read during `prepare`, never kept): its logits-processing table
    is filled from them."""

    row: int
    params: SamplingParams
    seed: int
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SchedulerOutput:
    """One step's work, decodes (one new token each) first, then prefill chunks.

    The runner reads only the arrays (`[n]` per scheduled request unless noted) and `new_rows`;
    `requests` is for the scheduler's update and for observers (experiments, the simulator).
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: np.ndarray = field(default_factory=_empty)  # tokens computed this step
    num_computed: np.ndarray = field(default_factory=_empty)  # tokens already in the cache: the new ones start at this position
    rows: np.ndarray = field(default_factory=_empty)  # batch rows
    samples: np.ndarray = field(default_factory=_empty)  # bool: the step ends at the request's last token, so its sampled token is kept
    output_index: np.ndarray = field(default_factory=_empty)  # tokens it sampled before this step (its PRNG stream index)
    max_output: np.ndarray = field(default_factory=_empty)  # output length at which it ends (max_tokens, max_model_len)
    stop_ids: np.ndarray = field(default_factory=_empty)  # bool: it has stop_token_ids
    token_ids: np.ndarray = field(default_factory=_empty)  # [num_tokens] the new tokens, flat; 0 where the token is still on the device
    token_source: np.ndarray = field(default_factory=_empty)  # [num_tokens] index in the previous step's sampled tokens, or -1
    # [num_tokens] the prompt token after each new token, whose logprob the step computes for a request
    # collecting prompt logprobs (-1 elsewhere); None when no request of the step collects them
    prompt_targets: np.ndarray | None = None
    block_tables: np.ndarray | None = None  # [n, B] padded with the null block (None in the simulator)
    bucket: tuple[int, int, int] = (0, 0, 0)  # (T, S, B), see `llmjax.buckets`
    num_decodes: int = 0
    num_tokens: int = 0
    new_rows: list[RowInit] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    running_version: int = -1  # a decode-only step where every request samples: the scheduler's running version then
    # such a step also carries, as scalars, what its update would otherwise test request by request:
    headroom: int = 0  # min over its requests of max_output - output_index - 1: tokens each may add after this one
    has_stop_ids: bool = True  # whether any of its requests has stop ids

    @property
    def empty(self) -> bool:
        return not self.requests

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.requests)


class Scheduler:
    """Owns the waiting queue, the running list and the batch rows; asks `kv` for blocks.

    Requests are known to `kv` by their `key` (unique in the process; ids given by callers may repeat).
    `eos_token_ids` end a request (unless `ignore_eos`). With `build_step_inputs` the outputs carry
    token ids and block tables for a runner; the simulator, which has no model, leaves it off (its
    `kv` may have no block tables at all).
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic,
                 eos_token_ids: frozenset[int] = frozenset(), build_step_inputs: bool = False):
        self.config = config
        self.kv = kv
        self.clock = clock
        self.eos_token_ids = eos_token_ids
        self.build_step_inputs = build_step_inputs
        self.buckets = StepBuckets(config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.batch: set[Hashable] = set()  # static/dynamic: the `group`s of the current batch's requests
        self.input_closed = False  # static/dynamic: no more arrivals, so a partial batch may start
        self.num_preemptions = 0
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        # per batch row, set when a request takes it: the stop bounds `update_from_output` checks vectorised
        self._max_output = np.zeros(config.max_num_seqs, np.int64)
        self._stop_ids = np.zeros(config.max_num_seqs, bool)
        self._eos = np.array(sorted(eos_token_ids), np.int64)
        self._running_version = 0  # bumped whenever a request joins or leaves `running`
        # (step, its requests' keys: a tuple, the same object while nobody leaves, so the KV manager's
        # `grow_each` reuses its lookup): see `_schedule_decodes`
        self._last_decodes: tuple[SchedulerOutput, tuple] | None = None
        self._left: list[int] = []  # indices in that step of the requests that left `running` since
        if build_step_inputs:  # per batch row: its block table, kept between steps, and its last token
            rows, max_blocks = config.max_num_seqs, self.buckets.max_blocks
            self._tables = np.zeros((rows, max_blocks), np.int32)  # padded with the null block
            self._table_len = np.zeros(rows, np.int32)  # blocks of the row's table written in `_tables`
            self._table_stale = np.zeros(rows, bool)  # entries may have changed (admission, cached pages)
            self._last_token = np.zeros(rows, np.int32)  # the row's last token known on the host

    # --- queue changes -------------------------------------------------------------------
    def add(self, request: Request, by_arrival: bool = False) -> None:
        """Queue `request` last, or with `by_arrival` before the first waiting request that arrived
        after it (a request's samples released after its first token keep its place in FCFS order).
        Under static/dynamic batching, a sample whose request is in the current batch joins it: see
        `_form_batch`."""
        if by_arrival:
            for i, other in enumerate(self.waiting):
                if other.arrival_time > request.arrival_time:
                    self.waiting.insert(i, request)
                    return
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a finished or aborted request and release its blocks (full pages are cached)."""
        request.status = status
        request.finish_time = self.clock()
        if request in self.running:
            self.running.remove(request)
            self._running_version += 1
            if self._last_decodes is not None:
                last, i = self._last_decodes[0], request.inflight_index
                if 0 <= i < len(last.requests) and last.requests[i] is request:
                    self._left.append(i)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_row(request)
        if self.kv.has_request(request.key):
            self.kv.free(request.key, request.token_slice(0, request.num_computed_tokens))

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = self._schedule_decodes()
        if out is not None:
            return out
        entries: list[tuple[Request, int]] = []  # (request, new tokens)
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._form_batch()
        running = RequestStatus.RUNNING
        grow = self.kv.grow
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this loop
            pending = request.num_pending
            if pending and self._done_when_pending_arrive(request):
                continue  # will finish with its pending token
            start = request.num_computed_tokens
            n = min(len(request.prompt_token_ids) + len(request.output_token_ids) + pending - start, budget)
            if n == 0 or not (grow(request.key, start + n) or self._grow_or_preempt(request, n, out, entries)):
                continue
            entries.append((request, n))
            budget -= n
        if not out.preempted:
            self._admit(out, entries, budget)
        self._fill(out, entries)
        return out

    def _schedule_decodes(self) -> SchedulerOutput | None:
        """The steady decode step, derived from the last step's arrays without a pass over the
        requests' state: the output `schedule`'s general path would build (the tests run both).

        Taken when the last step was decode-only and every request in it sampled, no request has
        joined `running` since and the ones that left it are dropped from its arrays (so every
        running request needs exactly one token again, in the same order; the token budget, at
        least `max_num_seqs`, covers them), nothing could be admitted, none reaches its length
        limit with its token still on the device, and the KV pool holds every block they need now
        (all or nothing, in the general path's order). Otherwise None, with nothing changed."""
        if self._last_decodes is None:
            return None
        last, keys = self._last_decodes
        requests, before = last.requests, None  # the index in `last` of each request that stays (None: all stay)
        if self._left:
            keep = np.ones(len(requests), bool)
            keep[self._left] = False
            before = np.flatnonzero(keep).astype(np.int32)
            requests, keys = [requests[i] for i in before.tolist()], tuple([keys[i] for i in before.tolist()])
        n, config = len(requests), self.config
        if n == 0 or n != len(self.running):
            return None
        if self.waiting and config.max_num_batched_tokens > n and n < config.max_num_seqs:
            return None  # a waiting request may be admitted
        pick = (lambda x: x) if before is None else (lambda x: x[before])  # noqa: E731
        output_index, max_output = pick(last.output_index) + 1, pick(last.max_output)
        headroom = last.headroom - 1 if before is None else int((max_output - output_index).min()) - 1
        if headroom < 0:  # one has sampled its last token: the general path skips it (done when that arrives)
            return None
        start = pick(last.num_computed) + 1
        if not self.kv.grow_each(keys, start + 1):
            return None  # the general path preempts
        # the last step's tokens are on the device (not applied yet) for all of them or for none: a
        # step's update applies every token at once, and a request that finished has left
        on_device = requests[0].num_pending > 0
        for request in requests:
            request.num_computed_tokens += 1
            request.num_pending += 1
        if before is not None:  # the others moved up; without departures each is already at its index
            for i, request in enumerate(requests):
                request.inflight_index = i
        stop_ids = pick(last.stop_ids)
        out = SchedulerOutput(requests, num_new_tokens=pick(last.num_new_tokens), num_computed=start,
                              rows=pick(last.rows), samples=pick(last.samples), output_index=output_index,
                              max_output=max_output, stop_ids=stop_ids, num_decodes=n, num_tokens=n, headroom=headroom,
                              has_stop_ids=last.has_stop_ids if before is None else bool(stop_ids.any()))
        out.bucket = self.buckets.shape(n, n, -(-(int(start.max()) + 1) // config.block_size))
        if self.build_step_inputs:  # as `_step_inputs` would: a token on the device is at its index in the last step
            if on_device:
                out.token_ids = np.zeros(n, np.int32)
                out.token_source = np.arange(n, dtype=np.int32) if before is None else before
            else:
                out.token_ids, out.token_source = self._last_token[out.rows], np.full(n, -1, np.int32)
            self._step_tables(out)
        out.running_version = self._running_version
        self._last_decodes, self._left = (out, keys), []
        return out

    def _done_when_pending_arrive(self, request: Request) -> bool:
        """Whether the tokens still on the device take the request to max_tokens or max_model_len."""
        n_out = len(request.output_token_ids) + request.num_pending
        max_tokens = request.sampling_params.max_tokens
        return (max_tokens is not None and n_out >= max_tokens) or \
            request.num_tokens + request.num_pending >= self.config.max_model_len

    def _grow_or_preempt(self, request: Request, n: int, out: SchedulerOutput, entries: list) -> bool:
        """Give `request` room for `n` more tokens, preempting the newest requests as needed."""
        while not self.kv.grow(request.key, request.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, out)
            entries[:] = [e for e in entries if e[0] is not victim]
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._running_version += 1
        self.kv.free(request.key, request.token_slice(0, request.num_computed_tokens))
        self._requeue(request)
        out.preempted.append(request)

    def preempt_all(self) -> None:
        """Send every running request back to the waiting queue to be recomputed, caching none of its
        blocks (after the runner lost the cache contents)."""
        for request in reversed(self.running):
            self.kv.free(request.key)
            self._requeue(request)
        self.running.clear()
        self._running_version += 1
        self._last_decodes = None

    def _requeue(self, request: Request) -> None:
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._release_row(request)
        self.waiting.appendleft(request)

    def _release_row(self, request: Request) -> None:
        if request.row >= 0:
            self._free_rows.append(request.row)
            request.row = -1

    def _admit(self, out: SchedulerOutput, entries: list, budget: int) -> None:
        if self.config.queue_order == "lpm" and self.config.enable_prefix_caching and len(self.waiting) > 1:
            match = {r.key: self.kv.peek_prefix_len(r.all_token_ids, r.namespace) for r in self.waiting}
            # ties by arrival, not by the order an earlier sort left (matches change as pages are evicted)
            self.waiting = deque(sorted(self.waiting, key=lambda r: (-match[r.key], r.arrival_time)))
        batched = self.config.scheduling_policy != "continuous"
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if (batched and request.group not in self.batch) or request.num_pending:
                skipped.append(request)  # not in the batch, or preempted with a token still on the device
                continue
            # one collecting prompt logprobs computes every prompt token: no prefix hit, no cache query
            use_cache = not request.collecting_prompt_logprobs
            if not self.config.enable_chunked_prefill and budget < request.num_tokens - (
                    self.kv.peek_prefix_len(request.all_token_ids, request.namespace) if use_cache else 0):
                self.waiting.appendleft(request)  # the whole prompt must fit one step
                break
            # A request re-admitted after preemption finds its own blocks cached: not a prefix hit.
            result = self.kv.allocate(request.key, request.all_token_ids, budget, request.namespace,
                                      count_query=request.num_preemptions == 0 and use_cache, match_prefix=use_cache)
            if result is None:
                self.waiting.appendleft(request)
                break
            num_cached, n = result
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:  # the prompt tokens the cache served (vLLM's: the first admission's)
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = self.clock()
            request.row = self._free_rows.pop()
            if self.build_step_inputs:
                self._table_stale[request.row] = True
                self._last_token[request.row] = request.token_at(request.num_tokens - 1)
            params = request.sampling_params
            max_tokens = params.max_tokens if params.max_tokens is not None else self.config.max_model_len
            self._max_output[request.row] = min(max_tokens, self.config.max_model_len - len(request.prompt_token_ids))
            self._stop_ids[request.row] = bool(params.stop_token_ids)
            out.new_rows.append(RowInit(request.row, params, request.seed, request.sample_index,
                                        request.prompt_token_ids, request.output_token_ids))
            self.running.append(request)
            self._running_version += 1
            entries.append((request, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _form_batch(self) -> None:
        """static/dynamic: when the current batch is done (none of its requests' samples is queued or
        running; samples the engine still holds back join it later, see `Request.group`), take the
        next one from the queue: whole requests in queue order, `batch_size` sequences at most."""
        policy = self.config.scheduling_policy
        if policy == "continuous" or not self.waiting:
            return
        batch = self.batch
        if batch and (any(r.group in batch for r in self.running) or any(r.group in batch for r in self.waiting)):
            return
        size = self.config.batch_size
        sequences: dict[Hashable, int] = {}  # queued requests in queue order: their samples
        for request in self.waiting:
            sequences.setdefault(request.group, request.sampling_params.n)
        full = sum(sequences.values()) >= size
        # the oldest request's wait: lpm may have put another first
        # (the deadline as the simulator's clock reaches it: now - oldest >= max_delay can round false there)
        timed_out = policy == "dynamic" and self.clock() >= self.oldest_arrival() + self.config.max_delay
        if full or timed_out or self.input_closed:
            taken, self.batch = 0, set()
            for group, n in sequences.items():
                if taken and taken + n > size:  # (the engine refuses n above batch_size)
                    break
                self.batch.add(group)
                taken += n

    def oldest_arrival(self) -> float:
        """The arrival time of the request that has waited longest (the queue is not empty)."""
        return min(r.arrival_time for r in self.waiting)

    def _fill(self, out: SchedulerOutput, entries: list[tuple[Request, int]]) -> None:
        """Order the step (decodes first), advance each request's progress, and write the arrays."""
        self._last_decodes = None
        decodes = [e for e in entries if e[1] == 1]
        if len(decodes) < len(entries):
            entries = decodes + [e for e in entries if e[1] > 1]
        n = len(entries)
        out.requests = [r for r, _ in entries]
        out.num_decodes = len(decodes)
        if not n:
            return
        # One flat pass over the requests (7 fields each), read before their progress advances.
        flat = []
        extend = flat.extend
        for r, k in entries:
            pending = r.num_pending
            n_out = len(r.output_token_ids) + pending
            extend((k, r.num_computed_tokens, len(r.prompt_token_ids) + n_out, n_out, r.row, pending,
                    r.inflight_index))
        state = np.fromiter(flat, np.int32, 7 * n).reshape(n, 7)
        new, start, length, n_out, rows = state[:, 0], state[:, 1], state[:, 2], state[:, 3], state[:, 4]
        out.num_new_tokens, out.num_computed, out.output_index, out.rows = new, start, n_out, rows
        out.samples = start + new == length
        out.max_output, out.stop_ids = self._max_output[rows], self._stop_ids[rows]
        out.num_tokens = int(new.sum())
        max_blocks = -(-int((start + new).max()) // self.config.block_size)
        out.bucket = self.buckets.shape(out.num_tokens, n, max_blocks)
        if self.build_step_inputs:
            self._step_inputs(out, state[:, 5] > 0, state[:, 6])
        for i, (request, k), samples in zip(range(n), entries, out.samples.tolist()):
            request.num_computed_tokens += k
            if samples:
                request.num_pending += 1
                request.inflight_index = i
        if out.decode_only and out.samples.all():
            out.running_version = self._running_version
            out.headroom = int((out.max_output - out.output_index).min()) - 1
            out.has_stop_ids = bool(out.stop_ids.any())
            self._last_decodes, self._left = (out, tuple([r.key for r in out.requests])), []

    def _step_inputs(self, out: SchedulerOutput, pending: np.ndarray, inflight_index: np.ndarray) -> None:
        """The new tokens and the block tables (`_step_tables`). A decode's token is its row's last
        token, or, still on the device (`pending`), its index in the previous step's output; a
        one-token step that is not at the end of the request (a prefill chunk cut to the last unit of
        budget) reads its token."""
        d, rows, start, requests = out.num_decodes, out.rows, out.num_computed, out.requests
        source = np.full(out.num_tokens, -1, np.int32)
        tokens = np.zeros(out.num_tokens, np.int32)
        tokens[:d] = np.where(pending[:d], 0, self._last_token[rows[:d]])
        source[:d] = np.where(pending[:d], inflight_index[:d], -1)
        for i in np.flatnonzero(~out.samples[:d]).tolist():
            tokens[i], source[i] = requests[i].token_at(int(start[i])), -1
        if d < len(requests):
            tokens[d:] = np.concatenate([r.token_slice(s, s + k) for r, s, k in
                                         zip(requests[d:], start[d:].tolist(), out.num_new_tokens[d:].tolist())])
        out.token_ids, out.token_source = tokens, source
        out.prompt_targets = self._prompt_targets(out, [*np.flatnonzero(~out.samples[:d]).tolist(),
                                                        *range(d, len(requests))])
        self._step_tables(out)

    @staticmethod
    def _prompt_targets(out: SchedulerOutput, chunks: list[int]) -> np.ndarray | None:
        """`out.prompt_targets` from the step's requests at indices `chunks` (those that compute prompt
        tokens: a decode that samples is past its prompt), before their progress advances."""
        targets = None
        for i in chunks:
            request = out.requests[i]
            if not request.collecting_prompt_logprobs:
                continue
            if targets is None:
                targets = np.full(out.num_tokens, -1, np.int32)
                offsets = np.cumsum(out.num_new_tokens) - out.num_new_tokens
            prompt, start = request.prompt_token_ids, int(out.num_computed[i])
            end = min(start + int(out.num_new_tokens[i]), len(prompt) - 1)  # the last prompt token predicts none
            if end > start:
                targets[offsets[i] : offsets[i] + end - start] = prompt[start + 1 : end + 1]
        return targets

    def _step_tables(self, out: SchedulerOutput) -> None:
        """The block tables, padded to the bucket's B. Rows whose table grew or changed are rewritten
        from the KV manager; the others are read as kept."""
        rows, requests = out.rows, out.requests
        num_blocks = -(-(out.num_computed + out.num_new_tokens) // self.config.block_size)
        tables, table_len, stale = self._tables, self._table_len, self._table_stale
        for i in np.flatnonzero((num_blocks != table_len[rows]) | stale[rows]).tolist():
            table, row = self.kv.block_table(requests[i].key), int(rows[i])
            written = int(table_len[row])
            if len(table) == written + 1 and not stale[row]:  # a decode crossed into a new block
                tables[row, written] = table[-1]
            else:
                tables[row, : len(table)] = table
                tables[row, len(table) :] = 0
            table_len[row], stale[row] = len(table), False
        out.block_tables = tables[rows, : out.bucket[2]]

    def update_from_output(self, out: SchedulerOutput, sampled: np.ndarray) -> tuple[Sequence[int], list[Request]]:
        """Apply a finished step: `sampled[i]` is the token of `out.requests[i]`.

        Appends each kept token and checks EOS and stop ids (after `min_tokens`),
        `max_tokens` and `max_model_len`, finishing those requests (blocks freed); caches the full
        pages of prefill chunks (so a request's other samples, released after its first token, find
        its prompt). A request that finished meanwhile (an earlier step's stop, an abort) gets
        nothing. Returns (their indices in the step, the requests that got a token, in step order)
        (`range(n)` when every one did; the pairs are never materialised, as a step's update is on
        the engine's critical path); the finished ones have a finished status.

        Decodes first, vectorised: only the requests whose token or length may end them (an EOS
        id, stop ids, the length limit: `out.max_output`) are checked one by one. Then the prefill
        chunks in step order, as the general case.
        """
        running, waiting = RequestStatus.RUNNING, RequestStatus.WAITING
        requests, d = out.requests, out.num_decodes
        tokens = sampled.tolist()
        if out.running_version == self._running_version:  # all decodes, all sampled, all still running
            for request, token in zip(requests, tokens):
                request.num_pending -= 1
                request.output_token_ids.append(token)
            indices: Sequence[int] = range(d)
            appended = list(requests)
        else:
            indices, appended = [], []
            for i in np.flatnonzero(out.samples[:d]).tolist():
                request = requests[i]
                status = request.status
                if status is not running and status is not waiting:
                    continue  # finished meanwhile
                request.num_pending -= 1
                request.output_token_ids.append(tokens[i])
                indices.append(i)
                appended.append(request)
        if appended:
            got = slice(0, d) if len(appended) == d else np.array(indices)
            got_tokens = sampled[got]
            if self.build_step_inputs:  # the rows of schedule time: still theirs, or (preempted since) still free
                self._last_token[out.rows[got]] = got_tokens
            # none reaching its length limit and none with stop ids (a steady step says so): only EOS ends one
            only_eos = isinstance(indices, range) and out.headroom > 0 and not out.has_stop_ids
            may_stop = None if only_eos else (out.output_index[got] + 1 >= out.max_output[got]) | out.stop_ids[got]
            for eos in self._eos:
                may_stop = got_tokens == eos if may_stop is None else may_stop | (got_tokens == eos)
            if may_stop is not None and may_stop.any():
                for j in np.flatnonzero(may_stop).tolist():
                    self._check_stops(appended[j], tokens[indices[j]])
        chunks = self.config.enable_prefix_caching
        if d < len(requests) and isinstance(indices, range):
            indices = list(indices)
        for i in range(d, len(requests)):
            request = requests[i]
            status = request.status
            if status is not running and status is not waiting:
                continue
            if chunks and status is running:
                self.kv.cache_blocks(request.key, request.token_slice(0, request.num_computed_tokens))
                if self.build_step_inputs:
                    self._table_stale[request.row] = True  # pages may now be another request's canonical blocks
            if not out.samples[i]:
                continue
            request.num_pending -= 1
            token = tokens[i]
            request.output_token_ids.append(token)
            if self.build_step_inputs and request.row >= 0:  # a preempted request has no row
                self._last_token[request.row] = token
            indices.append(i)
            appended.append(request)
            self._check_stops(request, token)
        return indices, appended

    def _check_stops(self, request: Request, token: int) -> None:
        """Finish `request` if its new `token` ends it: EOS or a stop id (both only after
        `min_tokens`), then `max_tokens` and `max_model_len`."""
        params = request.sampling_params
        n_out = len(request.output_token_ids)
        eos = self.eos_token_ids
        if n_out >= params.min_tokens and ((token in eos and not params.ignore_eos) or token in params.stop_token_ids):
            if token not in eos or params.ignore_eos:
                request.stop_reason = token
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        elif (params.max_tokens is not None and n_out >= params.max_tokens) or \
                n_out + len(request.prompt_token_ids) >= self.config.max_model_len:
            self.finish(request, RequestStatus.FINISHED_LENGTH)
