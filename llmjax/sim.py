"""A simulated runner: the REAL scheduler and KV bookkeeping, a cost model instead of the model.

`Simulator` replays a trace of `TraceRequest`s (arrival time, or a think time after the request it
follows; prompt token ids; the output length the request will produce) on a virtual clock. Each step mirrors `LLMEngine.step`: schedule, "execute"
(the clock advances by `CostModel.step_time`), then the scheduler's own `update_from_output` with one
dummy token (`DUMMY_TOKEN`) per request: a request finishes at its drawn output length, which is its
`max_tokens` (ignore_eos). No weights,
no device: a GPU-sized pool and thousands of requests run in seconds, so allocator and policy
effects can be measured at the scale of the papers.

The KV object may be a `KVCacheManager` or anything that duck-types the methods the scheduler
calls (`allocate`, `grow`, `grow_each`, `free`, `has_request`, `cache_blocks`, `peek_prefix_len`), such as
`llmjax.kv.contiguous.ContiguousKVCache`. Observers are called once per step with
`(simulator, scheduler_output, step_seconds)`, when the clock has reached the step's end but before the
scheduler's update: the KV state is the one the step computed over (the requests it finishes are not
freed yet), so an experiment can sample memory state over time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from tqdm import tqdm

from llmjax.config import ConfigError, EngineConfig
from llmjax.kv import KVCacheManager
from llmjax.request import Request
from llmjax.sampling_params import SamplingParams
from llmjax.scheduler import Scheduler, SchedulerOutput

DUMMY_TOKEN = 0  # every simulated output token; traces that replay history (multi-turn) append it too


@dataclass(frozen=True)
class CostModel:
    """Time of one step of one model on one GPU: a roofline with a fixed host overhead.

    step = overhead
         + max(weight_bytes / bandwidth, new_tokens * flops_per_token / flops)   # weights read once, or
                                                                                 # compute-bound prefill
         + kv_tokens_read * kv_bytes_per_token / bandwidth                      # attention reads each
                                                                                 # request's context once
    Decodes are memory bound (their matmuls hide under the weight read); a prefill chunk costs
    2 * params FLOPs per token once there are enough tokens to saturate the tensor cores.
    Prefill attention's quadratic FLOPs are left out (under 7% of a 13B model's per-token FLOPs at
    2048 tokens). `bandwidth` and `flops` are achieved rates, not peaks.
    """

    name: str
    overhead_s: float
    weight_bytes: float
    flops_per_token: float
    kv_bytes_per_token: int
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s

    def step_time(self, out: SchedulerOutput) -> float:
        kv_tokens = int((out.num_computed + out.num_new_tokens).sum()) if out.requests else 0
        linear = max(self.weight_bytes / self.bandwidth, out.num_tokens * self.flops_per_token / self.flops)
        return self.overhead_s + linear + kv_tokens * self.kv_bytes_per_token / self.bandwidth


# The PagedAttention paper's §6 setting. OPT-13B: 12.85e9 parameters in fp16 (the paper's Table 1:
# 26 GB), 40 layers of hidden size 5120, so K and V take 2 * 40 * 5120 * 2 B = 800 KiB per token.
# A100-40GB (SXM): 1555 GB/s HBM2 and 312 TFLOP/s dense fp16 on paper; we assume 80% of the bandwidth
# and 50% of the FLOPs are reached. A decode step then reads the weights in 21 ms and the whole 12 GiB
# KV pool in 10 ms. The overhead (10 ms) stands for a 2023 Python serving loop's host work per step:
# scheduling, input preparation, sampling, kernel launches; with it a full decode batch of ~30
# requests takes ~40 ms per token, in line with the paper's Figure 13 (30.42 requests in a batch at
# 2 requests/s means ~15 s per 338-token request).
A100_40GB_OPT_13B = CostModel(
    name="A100-40GB + OPT-13B (fp16)",
    overhead_s=10e-3,
    weight_bytes=2 * 12.85e9,
    flops_per_token=2 * 12.85e9,
    kv_bytes_per_token=2 * 40 * 5120 * 2,
    bandwidth=0.8 * 1555e9,
    flops=0.5 * 312e12,
)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives, its prompt, and how many tokens it will produce.

    `after`: the id of a request of the same trace whose output this one's prompt holds (a chat's
    next turn); it then arrives `arrival` seconds (the user's think time) after that one finishes,
    not at a fixed time, so no prompt is sent before the reply it contains exists."""

    request_id: str
    arrival: float
    prompt: Sequence[int]
    output_len: int
    namespace: Hashable | None = None
    after: str | None = None


@dataclass(frozen=True)
class SimResult:
    """The finished requests (in finishing order) and the run's totals, in virtual seconds."""

    finished: list[Request]
    unfinished: int  # requests still waiting or running when the run stopped
    duration: float
    num_steps: int
    num_preemptions: int

    @property
    def throughput(self) -> float:
        """Finished requests per virtual second."""
        return len(self.finished) / self.duration if self.duration else 0.0

    @property
    def mean_ttft(self) -> float:
        return _mean(r.first_token_time - r.arrival_time for r in self.finished)

    @property
    def mean_normalized_latency(self) -> float:
        """The PagedAttention paper's metric: end-to-end latency over output length, per request, averaged."""
        return _mean((r.finish_time - r.arrival_time) / len(r.output_token_ids) for r in self.finished)


Observer = Callable[["Simulator", SchedulerOutput, float], None]



def _check_no_cycle(trace: Sequence[TraceRequest]) -> None:
    """ValueError if some requests of `trace` wait for each other in a cycle (`after`): none of them
    could ever arrive. Each `after` names another request of the trace (checked before)."""
    after = {t.request_id: t.after for t in trace}
    done: set[str] = set()  # requests whose chain of predecessors ends
    for start in after:
        path: list[str] = []
        on_path: set[str] = set()
        node = start
        while node is not None and node not in done:
            if node in on_path:
                raise ValueError(f"requests wait for each other in a cycle: {' -> '.join(path[path.index(node):])} "
                                 f"-> {node}")
            path.append(node)
            on_path.add(node)
            node = after[node]
        done.update(path)


class Simulator:
    """Replays a trace through a real `Scheduler` over `kv`; see the module docstring.

    One simulator serves one `run`. `now` is the virtual clock; the scheduler reads it. It applies
    each step before scheduling the next, so `config.async_scheduling` is refused (ConfigError).
    """

    def __init__(self, config: EngineConfig, kv, cost: CostModel, observers: Iterable[Observer] = ()):
        if config.async_scheduling:
            raise ConfigError("the simulator applies each step before it schedules the next: "
                              "it models synchronous scheduling only (async_scheduling=False)")
        config.check_prompts_fit_a_step()  # a default max_model_len is used as it is
        self.config = config
        self.kv = kv
        self.cost = cost
        self.observers = list(observers)
        self.now = 0.0
        self.scheduler = Scheduler(config, kv, clock=lambda: self.now)

    def run(self, trace: Sequence[TraceRequest], until: float | None = None, progress: str | None = None) -> SimResult:
        """Serve `trace` until every request finishes (or the clock passes `until`).

        ValueError, before anything runs, for a request id given twice, an empty prompt, an output
        length below 1, an arrival time that is not a finite number, a request longer than
        `max_model_len` or than a paged KV pool can ever hold (another KV cache refuses its own when
        it is first scheduled), or requests that wait for each other in a cycle (`after`);
        RuntimeError when nothing can be scheduled and nothing will arrive.
        With `until`, the clock stops there (a step under way at `until` still ends).
        """
        ids = {t.request_id for t in trace}
        if len(ids) != len(trace):
            raise ValueError(f"{len(trace) - len(ids)} request ids of the trace are given twice")
        pool_blocks = self.kv.block_pool.num_usable if isinstance(self.kv, KVCacheManager) else None
        for t in trace:
            if not t.prompt or t.output_len < 1:
                raise ValueError(f"{t.request_id}: a request needs a prompt and an output of at least one token, "
                                 f"got {len(t.prompt)} + {t.output_len} tokens")
            if not np.isfinite(t.arrival):
                raise ValueError(f"{t.request_id}: its arrival time must be a finite number, got {t.arrival}")
            if len(t.prompt) + t.output_len > self.config.max_model_len:
                raise ValueError(f"{t.request_id}: {len(t.prompt)} + {t.output_len} tokens do not fit "
                                 f"max_model_len {self.config.max_model_len}")
            # the last output token is sampled and never fed back: it needs no KV (as the engine counts)
            if pool_blocks is not None and self.kv.num_blocks_for(len(t.prompt) + t.output_len - 1) > pool_blocks:
                raise ValueError(f"{t.request_id}: {len(t.prompt)} + {t.output_len} tokens need the KV of "
                                 f"{len(t.prompt) + t.output_len - 1}, more than the KV pool's {pool_blocks} blocks")
            if t.after is not None and (t.after not in ids or t.after == t.request_id):
                raise ValueError(f"{t.request_id} waits for {t.after!r}, which is no other request of the trace")
        waiting_for: dict[str, list[TraceRequest]] = {}  # predecessor id -> requests that follow its finish
        for t in trace:
            if t.after is not None:
                waiting_for.setdefault(t.after, []).append(t)
        _check_no_cycle(trace)
        pending = [(t.arrival, i, t) for i, t in enumerate(trace) if t.after is None]  # a heap by arrival
        heapq.heapify(pending)
        order = itertools.count(len(trace))
        finished: list[Request] = []
        sched, steps = self.scheduler, 0
        bar = tqdm(total=len(trace), desc=progress, unit="req", disable=progress is None, leave=False)
        while pending or sched.has_unfinished():
            if until is not None and self.now >= until:
                break
            while pending and pending[0][0] <= self.now:
                sched.add(_request(heapq.heappop(pending)[2]))
            # closed once nothing can arrive before a step runs: followers wait for a finish
            sched.input_closed = not pending and (not waiting_for or not sched.running)
            out = sched.schedule()
            if out.empty:
                if not out.preempted:  # else the state changed: schedule again at the same time
                    self.now = self._next_event(pending) if until is None else min(self._next_event(pending), until)
                continue
            dt = self.cost.step_time(out)
            self.now += dt
            for observe in self.observers:
                observe(self, out, dt)
            done = finish_step(sched, out)
            finished.extend(done)
            for r in done:  # the requests that waited for these arrive a think time later
                for t in waiting_for.pop(r.request_id, ()):
                    heapq.heappush(pending, (self.now + t.arrival, next(order),
                                             replace(t, arrival=self.now + t.arrival, after=None)))
            bar.update(len(done))
            steps += 1
        bar.close()
        unfinished = (len(pending) + sum(map(len, waiting_for.values())) + len(sched.waiting)
                      + len(sched.running))
        return SimResult(finished, unfinished, self.now, steps, sched.num_preemptions)

    def _next_event(self, pending: list[tuple[float, int, TraceRequest]]) -> float:
        """The clock time at which an idle scheduler may have work: the next arrival (`pending` is a
        heap of (arrival, order, request)), or a dynamic batch's deadline."""
        times = [pending[0][0]] if pending else []
        waiting = self.scheduler.waiting
        if self.config.scheduling_policy == "dynamic" and waiting:
            times.append(self.scheduler.oldest_arrival() + self.config.max_delay)
        times = [t for t in times if t > self.now]
        if not times:
            raise RuntimeError(f"stuck at t={self.now:.3f}: {len(waiting)} requests wait, none can be scheduled "
                               "and no arrival is due (a request larger than the KV pool?)")
        return min(times)


def finish_step(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    """The scheduler's update of a simulated step: every sampled token is `DUMMY_TOKEN`, stamped with
    the clock (`Request.token_times`, `first_token_time`). Returns the requests the step finished
    (each at its `max_tokens`, the trace's output length)."""
    _, appended = sched.update_from_output(out, np.full(len(out.requests), DUMMY_TOKEN, np.int32))
    now = sched.clock()
    for r in appended:
        r.token_times.append(now)
        if r.first_token_time is None:
            r.first_token_time = now
    return [r for r in appended if r.status.finished]


def _request(t: TraceRequest) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=t.output_len, ignore_eos=True)
    return Request(t.request_id, list(t.prompt), params, seed=0, namespace=t.namespace, arrival_time=t.arrival)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
