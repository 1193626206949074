"""Scheduler policies on the real KV manager, with a fake model (every step emits token 7)."""

import itertools

import numpy as np
import pytest

from llmjax.config import EngineConfig
from llmjax.kv.manager import KVCacheManager
from llmjax.request import Request, RequestStatus
from llmjax.sampling_params import SamplingParams
from llmjax.scheduler import Scheduler

_ids = itertools.count()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(prompt_len: int, max_tokens: int = 4, arrival: float = 0.0, first_token: int | None = None) -> Request:
    """A request whose prompt is a distinct run of ids (no accidental prefix sharing) unless `first_token` is given."""
    i = next(_ids)
    start = 1000 * (i + 1) if first_token is None else first_token
    params = SamplingParams(max_tokens=max_tokens)
    return Request(f"r{i}", list(range(start, start + prompt_len)), params, seed=0, arrival_time=arrival)


def scheduler(num_blocks=64, clock=None, build_step_inputs=False, eos_token_ids=frozenset(), **cfg) -> Scheduler:
    config = EngineConfig(**{"block_size": 4, "max_model_len": 256, "max_num_batched_tokens": 16,
                             "max_num_seqs": 8, **cfg})
    return Scheduler(config, KVCacheManager(num_blocks, 4, config.enable_prefix_caching), clock or FakeClock(),
                     eos_token_ids, build_step_inputs)


def run_step(s: Scheduler):
    """schedule, then the scheduler's update with token 7 for every request (finish at max_tokens)."""
    out = s.schedule()
    s.update_from_output(out, np.full(len(out.requests), 7))
    s.kv.check_invariants()
    return out


def pairs(out):
    return list(zip(out.requests, out.num_new_tokens.tolist()))


def test_budget_chunks_long_prompts_and_decodes_go_first():
    s = scheduler()
    a, b = make(6), make(40)
    s.add(a)
    s.add(b)
    first = run_step(s)
    assert pairs(first) == [(a, 6), (b, 10)]
    second = run_step(s)
    assert second.num_decodes == 1 and second.requests[0] is a
    assert pairs(second) == [(a, 1), (b, 15)]
    assert all(o.num_tokens <= 16 for o in (first, second))


def test_a_chunk_never_starves_running_decodes():
    s = scheduler(max_num_batched_tokens=8)
    decoders = [make(2, max_tokens=50) for _ in range(3)]
    for r in decoders:
        s.add(r)
    run_step(s)
    s.add(make(100))
    for _ in range(10):
        out = run_step(s)
        assert set(out.requests[: out.num_decodes]) == set(decoders)


def test_max_num_seqs():
    s = scheduler(max_num_seqs=2)
    for _ in range(5):
        s.add(make(2))
    out = run_step(s)
    assert len(out.requests) == 2 and len(s.waiting) == 3


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    s = scheduler(enable_chunked_prefill=False, max_num_batched_tokens=256)
    s.add(make(200))
    s.add(make(100))
    out = run_step(s)
    assert out.num_new_tokens.tolist() == [200]  # 100 more would exceed 256


def test_static_batch_waits_until_full_then_runs_to_its_longest_member():
    s = scheduler(scheduling_policy="static", batch_size=2)
    short, long_ = make(3, max_tokens=2), make(3, max_tokens=6)
    s.add(short)
    assert run_step(s).empty  # one request: the batch is not full
    s.add(long_)
    late = make(3)
    s.add(late)
    steps = [run_step(s) for _ in range(6)]
    ran = [set(o.requests) for o in steps]
    assert all(late not in r for r in ran)  # nobody joins until the batch is done
    assert ran[2] == {long_}  # the short one left; its slot stays idle
    assert run_step(s).empty  # the batch is done; one waiting request is not a full batch
    s.input_closed = True  # ... unless no more requests will come
    assert late in set(run_step(s).requests)


def test_dynamic_batch_leaves_after_max_delay():
    clock = FakeClock()
    s = scheduler(clock=clock, scheduling_policy="dynamic", batch_size=4, max_delay=1.0)
    s.add(make(3, arrival=0.0))
    assert run_step(s).empty
    clock.now = 1.5
    assert len(run_step(s).requests) == 1


def test_dynamic_batch_deadline_is_the_oldest_requests_even_when_lpm_puts_another_first():
    clock = FakeClock()
    s = scheduler(clock=clock, scheduling_policy="dynamic", batch_size=4, max_delay=1.0, queue_order="lpm")
    s.add(make(12, max_tokens=1, first_token=3))
    clock.now = 1.0
    run_step(s)  # its 12 prompt tokens are cached: 3 pages
    old, sharing = make(12, arrival=10.0), make(12, arrival=10.9, first_token=3)
    s.add(old)
    s.add(sharing)
    clock.now = 10.95
    assert run_step(s).empty and s.waiting[0] is sharing  # lpm put the cached prefix first
    clock.now = 11.0  # the old request has waited max_delay
    assert set(run_step(s).requests) == {old, sharing}


def test_a_later_sample_joins_its_first_samples_batch():
    # batch_size counts sequences: a request with n = 2 counts 2, with its held-back sample
    s = scheduler(scheduling_policy="static", batch_size=3)
    params = SamplingParams(max_tokens=6, n=2)
    first = Request("a#0", list(range(100, 103)), params, seed=0, key="a#0")
    other, late = make(3, max_tokens=6), make(3)
    s.add(first)
    s.add(other)
    s.add(late)
    assert set(run_step(s).requests) == {first, other}
    # the engine queues samples past the first once the first has its prompt
    sibling = Request("a#1", list(range(100, 103)), params, seed=0, key="a#1", group=first.group)
    s.add(sibling)
    assert sibling in run_step(s).requests
    assert all(late not in run_step(s).requests for _ in range(5))


def test_preemption_evicts_the_newest_and_admits_nobody_that_step():
    # 6 usable blocks of 4 tokens; three requests of 8 prompt tokens take 2 blocks each
    s = scheduler(num_blocks=7, max_num_batched_tokens=64)
    reqs = [make(8, max_tokens=20) for _ in range(3)]
    for r in reqs:
        s.add(r)
    run_step(s)
    s.add(make(2))
    out = run_step(s)  # each needs a third block for its 9th token: the newest is preempted
    assert out.preempted == [reqs[2]]
    assert reqs[2].status is RequestStatus.WAITING and s.waiting[0] is reqs[2]
    assert set(out.requests) == set(reqs[:2])
    assert reqs[2].num_computed_tokens == 0 and reqs[2].output_token_ids == [7]


def test_lpm_orders_waiting_by_cached_prefix():
    s = scheduler(queue_order="lpm", max_num_seqs=1)
    first = make(12, max_tokens=1, first_token=3)
    s.add(first)
    run_step(s)
    other = make(12, max_tokens=1)
    sharing = make(12, max_tokens=1, first_token=3)
    s.add(other)
    s.add(sharing)
    out = run_step(s)
    assert out.requests[0] is sharing and out.num_computed[0] == 8


def test_no_max_tokens_runs_to_max_model_len():
    """`max_tokens` None is "up to max_model_len" for the scheduler too, not only once the engine has
    replaced it."""
    s = scheduler(max_model_len=32)
    request = Request("open", list(range(100, 108)), SamplingParams(max_tokens=None), seed=0)
    s.add(request)
    while s.has_unfinished():
        run_step(s)
    assert request.status is RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == 32 - 8


def test_lpm_breaks_ties_by_arrival_whatever_an_earlier_sort_left():
    """A later request with a cached prefix goes first; once those pages are evicted, equal matches
    go by arrival again, not by the order the earlier sort left."""
    s = scheduler(queue_order="lpm", max_num_seqs=1)
    first = make(12, max_tokens=1, first_token=3)
    s.add(first)
    run_step(s)  # its 2 full pages (8 tokens) stay cached
    hog = make(4, max_tokens=3)
    s.add(hog)
    run_step(s)  # hog holds the only seat
    earlier, later = make(12, max_tokens=1, arrival=1.0), make(12, max_tokens=1, arrival=2.0, first_token=3)
    s.add(earlier)
    s.add(later)
    run_step(s)
    assert list(s.waiting) == [later, earlier]  # the cached prefix first
    s.kv.reset_prefix_cache()
    while hog in s.running:
        run_step(s)
    out = run_step(s)
    assert out.requests == [earlier]


def test_a_step_scheduled_before_the_previous_ones_tokens_arrive():
    """Asynchronous scheduling: the second step is formed while the first one's tokens are on the device."""
    s = scheduler(build_step_inputs=True, eos_token_ids=frozenset({9}))
    a, b, last = make(5, max_tokens=10), make(6, max_tokens=10), make(3, max_tokens=1)
    for r in (a, b, last):
        s.add(r)
    first = s.schedule()  # three prefills that each sample
    assert first.samples.all() and [r.num_pending for r in (a, b, last)] == [1, 1, 1]
    second = s.schedule()  # a and b decode their pending tokens; `last` reaches max_tokens with it
    assert second.requests == [a, b] and second.token_source.tolist() == [0, 1]
    assert second.output_index.tolist() == [1, 1]
    s.update_from_output(first, np.array([9, 7, 7]))  # a samples EOS: finished, its blocks freed
    assert a.status is RequestStatus.FINISHED_STOPPED and last.status is RequestStatus.FINISHED_LENGTH
    indices, appended = s.update_from_output(second, np.array([7, 7]))
    assert list(indices) == [1] and appended == [b]  # a's token dropped
    assert b.output_token_ids == [7, 7] and b.num_pending == 0 and a.output_token_ids == [9]
    s.kv.check_invariants()


def _drive(fast_path: bool, async_steps: bool, seed: int, num_blocks: int, burst: bool,
           monkeypatch) -> tuple[list, list, int, int]:
    """A random workload (shared prefixes, EOS and stop ids, max_tokens, aborts; a pool small
    enough to preempt, or not; arrivals spread out, or all at once into room for every request)
    through a scheduler that builds step inputs; each sampled token is a function of its request
    and position, so two runs see the same tokens. Returns every step's arrays, every request's
    final state, how many steps took the steady-decode path, and how many of those dropped
    requests that had left."""
    fast_steps, with_leavers = [0], [0]
    general = Scheduler._schedule_decodes

    def counted(self):
        left = bool(self._left)
        out = general(self) if fast_path else None
        fast_steps[0] += out is not None
        with_leavers[0] += out is not None and left
        return out

    monkeypatch.setattr(Scheduler, "_schedule_decodes", counted)
    rng = np.random.default_rng(seed)
    s = scheduler(num_blocks=num_blocks, build_step_inputs=True, eos_token_ids=frozenset({5}),
                  max_num_seqs=24 if burst else 4, max_num_batched_tokens=24, max_model_len=64)
    requests = []
    for i in range(24):
        prompt = ([3] * 8 if i % 3 == 0 else []) + list(range(100 + 20 * i, 100 + 20 * i + int(rng.integers(2, 12))))
        params = SamplingParams(max_tokens=int(rng.integers(2, 30)), ignore_eos=bool(i % 4 == 1),
                                stop_token_ids=[6] if i % 5 == 2 else [], min_tokens=2 if i % 7 == 3 else 0)
        requests.append(Request(f"q{i}", prompt, params, seed=0))
    arrivals = sorted(int(t) for t in rng.integers(0, 1 if burst else 40, len(requests)))
    steps, inflight, t = [], None, 0
    while t < 400 and (arrivals or s.has_unfinished() or inflight is not None):
        while arrivals and arrivals[0] <= t:
            arrivals.pop(0)
            s.add(requests[len(requests) - len(arrivals) - 1])
        if t % 17 == 5 and s.running:  # an abort
            s.finish(s.running[int(rng.integers(len(s.running)))], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        flat = 0
        for r, start, k in zip(out.requests, out.num_computed.tolist(), out.num_new_tokens.tolist()):
            for pos in range(start, start + k):  # each token from the host's copy, or on the device
                known = pos < r.num_tokens
                assert out.token_source[flat] == -1 if known else out.token_source[flat] >= 0
                assert not known or out.token_ids[flat] == r.token_at(pos)
                flat += 1
        if not out.empty:
            steps.append(([r.request_id for r in out.requests], out.num_new_tokens.tolist(),
                          out.num_computed.tolist(), out.rows.tolist(), out.samples.tolist(),
                          out.output_index.tolist(), out.token_ids.tolist(), out.token_source.tolist(),
                          out.block_tables.tolist(), out.bucket,
                          (out.headroom, out.has_stop_ids) if out.running_version >= 0 else None,
                          [r.request_id for r in out.preempted]))
        done, inflight = (inflight, out) if async_steps else (out, None)
        if done is not None and not done.empty:
            tokens = [5 if (int(r.request_id[1:]) + len(r.output_token_ids)) % 29 == 0 else
                      6 if (int(r.request_id[1:]) + len(r.output_token_ids)) % 23 == 0 else 40 + len(r.output_token_ids)
                      for r in done.requests]
            s.update_from_output(done, np.array(tokens))
            for r, token in zip(done.requests, tokens):  # the stop rules, checked independently
                out_ids, p = r.output_token_ids, r.sampling_params
                if r.status is RequestStatus.FINISHED_ABORTED or not out_ids or out_ids[-1] != token:
                    continue
                ends = len(out_ids) >= p.max_tokens or (len(out_ids) >= p.min_tokens and (
                    (token == 5 and not p.ignore_eos) or token in p.stop_token_ids))
                assert ends == r.status.finished, (r.request_id, out_ids, r.status)
        s.kv.check_invariants()
        t += 1
    final = [(r.request_id, r.status, r.output_token_ids, r.num_preemptions, r.stop_reason) for r in requests]
    return steps, final, fast_steps[0], with_leavers[0]


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_blocks, burst", [(16, False), (64, False), (200, True)])  # preempting or not; a burst
def test_steady_decode_path_builds_the_general_paths_steps(async_steps, seed, num_blocks, burst, monkeypatch):
    """`_schedule_decodes` (derived from the last step's arrays) against the general path alone, on
    the same workload: the same steps, arrays and outcomes, and the fast path taken often (in a
    burst, also right after requests left)."""
    steps, final, fast, with_leavers = _drive(True, async_steps, seed, num_blocks, burst, monkeypatch)
    ref_steps, ref_final, ref_fast, _ = _drive(False, async_steps, seed, num_blocks, burst, monkeypatch)
    assert ref_fast == 0 and fast >= (5 if num_blocks == 16 else len(steps) // (5 if burst else 3)), (fast, len(steps))
    assert with_leavers >= 3 or not burst, with_leavers
    assert steps == ref_steps
    assert final == ref_final
    statuses = {status for _, status, *_ in final}
    assert {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED} <= statuses
    assert any(pre for *_, pre in steps) == (num_blocks == 16)
