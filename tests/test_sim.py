"""The simulated runner: every request finishes with its drawn length, KV invariants hold after every step."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from llmjax.config import ConfigError, EngineConfig
from llmjax.kv import KVCacheManager
from llmjax.kv.contiguous import ContiguousKVCache
from llmjax.request import Request
from llmjax.sampling_params import SamplingParams
from llmjax.scheduler import SchedulerOutput
from llmjax.sim import DUMMY_TOKEN, CostModel, Simulator, TraceRequest
from paper_repro.traces import Chats, chat_trace

UNIT = CostModel("unit", overhead_s=1.0, weight_bytes=0.0, flops_per_token=0.0, kv_bytes_per_token=0,
                 bandwidth=1.0, flops=1.0)
CONFIG = EngineConfig(max_num_batched_tokens=32, max_num_seqs=6, block_size=4, max_model_len=64,
                      enable_prefix_caching=False)


def random_trace(seed: int, n: int = 40, rate: float = 0.5) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    trace, t = [], 0.0
    for i in range(n):
        t += float(rng.exponential(1 / rate))
        p = int(rng.integers(1, 40))
        trace.append(TraceRequest(f"r{i}", t, rng.integers(1, 100, p).tolist(), int(rng.integers(1, 64 - p + 1))))
    return trace


def run_checked(config: EngineConfig, kv, trace: list[TraceRequest]):
    steps = []

    def check(sim: Simulator, out: SchedulerOutput, dt: float) -> None:
        sim.kv.check_invariants()
        assert dt > 0 and not out.empty
        steps.append(out)

    result = Simulator(config, kv, UNIT, [check]).run(trace)
    return result, steps


def assert_all_finished(result, trace: list[TraceRequest]) -> None:
    drawn = {t.request_id: t for t in trace}
    assert result.unfinished == 0 and len(result.finished) == len(trace)
    for r in result.finished:
        t = drawn[r.request_id]
        assert r.output_token_ids == [DUMMY_TOKEN] * t.output_len
        assert r.prompt_token_ids == list(t.prompt)
        if t.after is None:  # else it arrived a think time after the request it follows finished
            assert r.arrival_time == t.arrival
        assert r.arrival_time < r.first_token_time <= r.finish_time <= result.duration
        assert r.token_times == sorted(r.token_times)


POLICIES = {"continuous": {}, "static": dict(batch_size=4), "dynamic": dict(batch_size=4, max_delay=2.0)}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_paged_pool_under_pressure_finishes_everything(policy: str) -> None:
    trace = random_trace(seed=1)
    config = CONFIG.replace(scheduling_policy=policy, **POLICIES[policy])
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=False)  # 92 slots: preemption
    result, steps = run_checked(config, kv, trace)
    assert_all_finished(result, trace)
    assert result.num_steps == len(steps) and result.throughput > 0
    if policy == "continuous":
        assert result.num_preemptions > 0  # the pool is small enough to force some
    assert kv.usage().used == 0


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_contiguous_pools_finish_everything_without_preemption(policy: str) -> None:
    trace = random_trace(seed=2)
    lengths = {t.request_id: (len(t.prompt), t.output_len) for t in trace}
    kv = ContiguousKVCache(200, policy, CONFIG.max_model_len, lengths)
    result, _ = run_checked(CONFIG, kv, trace)
    assert_all_finished(result, trace)
    assert result.num_preemptions == 0
    assert kv.breakdown().free == 200


def test_chat_history_hits_the_prefix_cache() -> None:
    rng = np.random.default_rng(0)
    chats = Chats.draw(rng, 100, conversations=6, turns=3, system_len=8, user_len=5)
    trace = chat_trace(chats, np.full((6, 3), 6), rate=0.2, think_time=200.0, seed=0)
    config = CONFIG.replace(enable_prefix_caching=True, max_model_len=128)
    kv = KVCacheManager(num_blocks=200, block_size=4)
    result, _ = run_checked(config, kv, trace)
    assert_all_finished(result, trace)
    hits = {r.request_id: r.num_cached_tokens for r in result.finished}
    for c in range(6):
        # turn 2 extends turn 1's prompt and its 6 dummy reply tokens, all computed (the last sampled one is
        # not): everything but the last page-unaligned tail and the new user message hits
        turn1 = len(trace[3 * c].prompt) + 6 - 1
        assert hits[f"chat-{c}-1"] == turn1 // 4 * 4
    assert kv.stats().hit_rate > 0.4
    # each later turn arrived after the turn it follows had finished (its reply existed)
    finish = {r.request_id: r.finish_time for r in result.finished}
    arrival = {r.request_id: r.arrival_time for r in result.finished}
    for c in range(6):
        for k in (1, 2):
            assert arrival[f"chat-{c}-{k}"] >= finish[f"chat-{c}-{k - 1}"]


def test_a_request_that_follows_another_arrives_a_think_time_after_its_finish() -> None:
    trace = [TraceRequest("a", 1.0, [1, 2, 3], 4), TraceRequest("b", 5.0, [1, 2, 3, 0, 0, 0, 0, 7], 2, after="a"),
             TraceRequest("c", 0.5, [9, 9], 3)]
    kv = KVCacheManager(num_blocks=40, block_size=4)
    result, _ = run_checked(CONFIG.replace(enable_prefix_caching=True), kv, trace)
    assert_all_finished(result, trace)
    done = {r.request_id: r for r in result.finished}
    assert done["b"].arrival_time == pytest.approx(done["a"].finish_time + 5.0)
    assert done["b"].num_cached_tokens == 4  # a's prompt and reply were cached when b arrived: one whole page
    stopped = Simulator(CONFIG, KVCacheManager(num_blocks=40, block_size=4), UNIT).run(trace, until=2.0)
    assert stopped.unfinished == 3 - len(stopped.finished) and "b" not in {r.request_id for r in stopped.finished}
    with pytest.raises(ValueError, match="no other request of the trace"):
        Simulator(CONFIG, KVCacheManager(num_blocks=40, block_size=4), UNIT).run([replace(trace[1], after="zzz")])


def test_a_static_batch_that_a_follower_waits_for_starts_and_async_scheduling_is_refused() -> None:
    # "b" arrives only after "a" finishes: the batch of 2 cannot fill before "a" runs
    trace = [TraceRequest("a", 0.0, list(range(10, 20)), 4),
             TraceRequest("b", 1.0, list(range(10, 20)) + [0] * 4 + [5, 6], 4, after="a")]
    config = CONFIG.replace(scheduling_policy="static", batch_size=2)
    result, _ = run_checked(config, KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=False), trace)
    assert_all_finished(result, trace)
    with pytest.raises(ConfigError, match="synchronous scheduling only"):
        Simulator(CONFIG.replace(async_scheduling=True), KVCacheManager(num_blocks=40, block_size=4), UNIT)


def test_step_time_is_the_roofline_sum() -> None:
    cost = CostModel("toy", overhead_s=0.5, weight_bytes=10.0, flops_per_token=2.0, kv_bytes_per_token=3,
                     bandwidth=2.0, flops=1.0)
    req = Request("x", [1] * 10, SamplingParams(), seed=0)
    out = SchedulerOutput([req, req], num_new_tokens=np.array([1, 4]), num_computed=np.array([9, 0]), num_decodes=1,
                          num_tokens=5)
    # 5 new tokens: compute (5 * 2 / 1 = 10 s) outweighs the weight read (10 / 2 = 5 s);
    # attention reads 10 + 4 context tokens of 3 bytes at 2 bytes/s
    assert cost.step_time(out) == pytest.approx(0.5 + 10.0 + 14 * 3 / 2)


def test_run_until_stops_early_and_rejects_oversized_requests() -> None:
    trace = random_trace(seed=3)
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=False)
    result = Simulator(CONFIG, kv, UNIT).run(trace, until=20.0)
    assert result.unfinished > 0 and 20.0 <= result.duration < 22.0
    with pytest.raises(ValueError):
        Simulator(CONFIG, kv, UNIT).run([TraceRequest("long", 0.0, [1] * 60, 10)])
    # an idle clock stops at `until`, not at the next arrival past it
    gap = [TraceRequest("a", 0.0, [1, 2, 3], 2), TraceRequest("b", 100.0, [4, 5, 6], 2)]
    result = Simulator(CONFIG, KVCacheManager(num_blocks=24, block_size=4), UNIT).run(gap, until=10.0)
    assert result.duration == 10.0 and len(result.finished) == 1
    # refused before anything runs: a repeated id, and a request the pool can never hold (6 usable blocks)
    small = KVCacheManager(num_blocks=7, block_size=4)
    with pytest.raises(ValueError, match="given twice"):
        Simulator(CONFIG, small, UNIT).run([gap[0], replace(gap[1], request_id="a")])
    with pytest.raises(ValueError, match="more than the KV pool's 6 blocks"):
        Simulator(CONFIG, small, UNIT).run([TraceRequest("big", 0.0, [1] * 20, 6)])  # 25 tokens' KV
    # 24 tokens' KV (the last of 25 is never fed back) fill the 6 blocks exactly: served, as the engine serves it
    exact = Simulator(CONFIG, small, UNIT).run([TraceRequest("exact", 0.0, [1] * 20, 5)])
    assert [(r.request_id, len(r.output_token_ids)) for r in exact.finished] == [("exact", 5)]


@pytest.mark.parametrize("trace,message", [
    ([TraceRequest("a", 0.0, [1] * 5, 0)], "an output of at least one token"),
    ([TraceRequest("a", 0.0, [], 3)], "a request needs a prompt"),
    ([TraceRequest("a", float("nan"), [1] * 5, 3)], "arrival time must be a finite number"),
    ([TraceRequest("a", float("inf"), [1] * 5, 3)], "arrival time must be a finite number"),
    ([TraceRequest("a", 0.0, [1] * 5, 3), TraceRequest("b", 0.0, [1] * 5, 3, after="c"),
      TraceRequest("c", 0.0, [1] * 5, 3, after="d"), TraceRequest("d", 0.0, [1] * 5, 3, after="b")],
     "in a cycle: b -> c -> d -> b"),
])
def test_a_trace_no_run_could_serve_is_refused_before_anything_runs(trace, message) -> None:
    kv = KVCacheManager(num_blocks=24, block_size=4)
    with pytest.raises(ValueError, match=re.escape(message)):
        Simulator(CONFIG, kv, UNIT).run(trace)
    kv.check_invariants()
    assert kv.block_pool.num_free == kv.block_pool.num_usable  # nothing was allocated


@pytest.mark.parametrize("arrival", [0.25, 0.5, 0.7])
def test_a_dynamic_batch_leaves_at_its_deadline_whatever_the_rounding(arrival: float) -> None:
    """The clock set to oldest + max_delay is the deadline: now - oldest may round below max_delay."""
    config = CONFIG.replace(scheduling_policy="dynamic", batch_size=3, max_delay=0.1)
    trace = [TraceRequest("a", arrival, [1, 2, 3], 2), TraceRequest("b", 5.0, [4, 5, 6], 2)]
    result, _ = run_checked(config, KVCacheManager(num_blocks=24, block_size=4), trace)
    first = next(r for r in result.finished if r.request_id == "a")
    assert first.scheduled_time == arrival + 0.1


def test_sharing_counts_shared_prompt_blocks_once_and_copies_on_write():
    import numpy as np

    from paper_repro import sharing

    # prompt of 2 full blocks, two samples of one token: 2 shared + 1 new block each, against 2 x 3 unshared
    assert sharing.parallel_sampling(32, [1, 1]) == (4, 6)
    # a partial prompt block (20 tokens): the first beam to write copies it, the second writes in place
    assert sharing.beam_search(20, 1, 2, np.random.default_rng(0)) == (3, 4)
    # no sharing possible with one sequence: the two counts agree
    shared, unshared = sharing.parallel_sampling(7, [40])
    assert shared == unshared == sum(-(-(7 + t) // 16) for t in range(1, 41))


def test_observers_see_the_kv_state_a_step_computed_over():
    """An observer samples a step before its update: a request that the step finishes still holds its
    blocks (all its prompt and output slots), and its clock is the step's end."""
    trace = [TraceRequest("a", 0.0, list(range(1, 10)), 1), TraceRequest("b", 0.0, list(range(20, 26)), 3)]
    seen = []

    def observe(sim: Simulator, out: SchedulerOutput, dt: float) -> None:
        seen.append((sim.now, {r.request_id: sim.kv.has_request(r.request_id) for r in out.requests},
                     sim.kv.block_pool.num_free))

    kv = KVCacheManager(32, CONFIG.block_size, enable_prefix_caching=False)
    result = Simulator(CONFIG, kv, UNIT, [observe]).run(trace)
    assert [now for now, _, _ in seen] == [1.0, 2.0, 3.0]  # unit cost: each step ends one second later
    assert all(all(held.values()) for _, held, _ in seen)  # "a" in step 1 and "b" in step 3 finish there
    # step 1 holds a's 9 prompt slots (3 blocks of 4) and b's 6 (2 blocks); nothing freed yet
    assert seen[0][2] == kv.block_pool.num_usable - 5
    assert result.unfinished == 0
