"""The scheduler: which requests run each step and how many tokens each computes.

Plain Python, no JAX. Policies (`EngineConfig.scheduling_policy`):

- continuous (vLLM v1 style): each step, running requests first, then waiting ones, under one
  token budget (`max_num_batched_tokens`) and at most `max_num_seqs` requests. With chunked
  prefill a prompt longer than the remaining budget is split, so prefill chunks and decodes
  share a step; running decodes are scheduled before any new chunk, so a chunk never starves them.
- static: a batch of `batch_size` requests forms when that many have arrived (or the input is
  closed) and runs until its longest member finishes; then the next batch forms.
- dynamic: static, but a batch also leaves after `max_delay` seconds even when not full.

When the KV pool runs out, the most recently admitted running request is preempted (recompute):
its blocks are freed (full pages go to the prefix cache) and it returns to the front of the
waiting queue with its output so far. No request is admitted in a step that preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from llmjax.config import EngineConfig
from llmjax.kv.manager import KVCacheManager
from llmjax.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before this step

    @property
    def samples(self) -> bool:
        """Whether this step completes the request's known tokens, so its sampled token is kept."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's work: decodes (one new token each) first, then prefill chunks."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and the running list; asks `kv` for blocks.

    Not thread-safe: one engine loop calls `add`, `abort`, `schedule` and `finish`.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.batch: set[str] = set()  # static/dynamic: ids of the current batch's members
        self.input_closed = False  # static/dynamic: no more arrivals, so a partial batch may start
        self.num_preemptions = 0

    # --- queue changes -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a finished or aborted request and release its blocks (full pages are cached)."""
        request.status = status
        request.finish_time = self.clock()
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.batch.discard(request.request_id)
        if self.kv.has_request(request.request_id):
            self.kv.free(request.request_id, request.all_token_ids[: request.num_computed_tokens])

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._form_batch()
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            n = min(request.num_tokens_to_compute, budget)
            if not self._grow_or_preempt(request, n, out):
                continue
            out.scheduled.append(ScheduledRequest(request, n, request.num_computed_tokens))
            budget -= n
        if not out.preempted:
            self._admit(out, budget)
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        out.scheduled = decodes + prefills
        out.num_decodes = len(decodes)
        return out

    def _grow_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Give `request` room for `n` more tokens, preempting the newest requests as needed."""
        while not self.kv.grow(request.request_id, request.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id, request.all_token_ids[: request.num_computed_tokens])
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        out.scheduled = [s for s in out.scheduled if s.request is not request]

    def preempt_all(self) -> None:
        """Send every running request back to the waiting queue to be recomputed, caching none of its
        blocks (after the runner lost the cache contents)."""
        for request in reversed(self.running):
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(request)
        self.running.clear()

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        if self.config.queue_order == "lpm" and self.config.enable_prefix_caching and len(self.waiting) > 1:
            match = {r.request_id: self.kv.peek_prefix_len(r.all_token_ids, r.namespace) for r in self.waiting}
            self.waiting = deque(sorted(self.waiting, key=lambda r: -match[r.request_id]))
        batched = self.config.scheduling_policy != "continuous"
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if batched and request.request_id not in self.batch:
                skipped.append(request)
                continue
            if not self.config.enable_chunked_prefill and \
                    budget < request.num_tokens - self.kv.peek_prefix_len(request.all_token_ids, request.namespace):
                self.waiting.appendleft(request)  # the whole prompt must fit one step
                break
            # A request re-admitted after preemption finds its own blocks cached: not a prefix hit.
            result = self.kv.allocate(request.request_id, request.all_token_ids, budget, request.namespace,
                                      count_query=request.num_preemptions == 0)
            if result is None:
                self.waiting.appendleft(request)
                break
            num_cached, n = result
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = self.clock()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n, num_cached))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _form_batch(self) -> None:
        """static/dynamic: when the current batch is done, take the next one from the queue."""
        policy = self.config.scheduling_policy
        if policy == "continuous" or self.batch or not self.waiting:
            return
        size = self.config.batch_size
        full = len(self.waiting) >= size
        timed_out = policy == "dynamic" and self.clock() - self.waiting[0].arrival_time >= self.config.max_delay
        if full or timed_out or self.input_closed:
            self.batch = {r.request_id for r in list(self.waiting)[:size]}

    def after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of the scheduled requests; cache the full pages of finished prefill chunks."""
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens = s.start + s.num_new_tokens
            if self.config.enable_prefix_caching and s.num_new_tokens > 1:
                self.kv.cache_blocks(request.request_id, request.all_token_ids[: request.num_computed_tokens])
