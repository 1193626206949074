"""Asynchronous scheduling (step N+1 dispatched before step N's tokens reach the host) gives exactly
the synchronous outputs: on the engine test configurations, under preemption, with seeded sampling
and logits processing, n > 1, stop strings and stop ids (a request that stops in step N has its
step N+1 token dropped) and logprobs; aborts and failures while a step is in flight leak nothing."""

import numpy as np
import pytest

from llmjax.sampling_params import MAX_LOGPROBS, SamplingParams
from tests.engine_helpers import GREEDY, dense_greedy, drain, engine_bytes_per_token, run_to_completion, tiny_engine
from tests.test_engine import CONFIGS, PROMPTS
from tests.test_engine_faults import fail_once

PREEMPTING = {"preemption": None}  # kv budget filled in per preset: 24 usable blocks of 8 tokens
# one config of each way the schedule changes (test_engine.py runs every config synchronously): whole
# prompts, chunks, one row, static and dynamic batches, queue order, preemption
CASES = [("tiny-gqa", c) for c in ("continuous", "no-chunked-prefill", "chunk-16", "max-seqs-1", "static", "dynamic",
                                   "lpm", "preemption")] + \
        [("tiny-mla", c) for c in ("continuous", "chunk-16", "preemption")]


def overrides(preset: str, config: str) -> dict:
    if config == "preemption":
        return dict(kv_cache_memory_bytes=25 * 8 * engine_bytes_per_token(preset))
    return CONFIGS[config]


def summary(outputs):
    """Every field of every sample; logprobs to 4 decimals (steps batched differently may round differently)."""
    def rounded(logprobs):
        return None if logprobs is None else [{t: (round(v.logprob, 4), v.decoded_token) for t, v in e.items()}
                                              for e in logprobs]
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, rounded(c.logprobs)) for c in o.outputs]
            for o in outputs]


@pytest.mark.parametrize("preset, config", CASES)
def test_greedy_outputs_equal_synchronous_ones(preset, config):
    sync = run_to_completion(tiny_engine(preset, **overrides(preset, config)), PROMPTS)
    engine = tiny_engine(preset, async_scheduling=True, **overrides(preset, config))
    overlapped = run_to_completion(engine, PROMPTS)
    assert summary(overlapped) == summary(sync)
    assert engine.kv.usage().used == 0
    if config == "preemption":
        assert engine.scheduler.num_preemptions > 0


def mixed_params(stop_text: str, stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=6, n=3, max_tokens=9, ignore_eos=True, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={7: 5.0}),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=2),
        SamplingParams(temperature=0.7, seed=8, max_tokens=6, min_tokens=6),
    ]


@pytest.mark.parametrize("config", ["continuous", "chunk-16", "preemption"])
def test_sampling_stops_and_samples_equal_synchronous_ones(config):
    probe = run_to_completion(tiny_engine(), [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=30,
                                                                          ignore_eos=True))[0].outputs[0]
    params = mixed_params(probe.text[10:12], probe.token_ids[4])
    results = []
    for async_scheduling in (False, True):
        engine = tiny_engine(async_scheduling=async_scheduling, **overrides("tiny-gqa", config))
        ids = [engine.add_request(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]
        results.append(summary(drain(engine, ids)))
        assert engine.kv.usage().used == 0
    assert results[1] == results[0]
    stopped = results[0][2][0]
    assert stopped[2] == "stop" and stopped[3] == params[2].stop[0]  # a request that stopped mid-flight


def test_abort_while_a_step_is_in_flight_frees_everything():
    engine = tiny_engine(async_scheduling=True)
    expected = [dense_greedy(engine, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
        engine.check_kv_invariants()
    for rid in ids:
        engine.abort(rid)
    engine.check_kv_invariants()
    assert engine.kv.usage().used == 0 and not engine.has_unfinished_requests()
    assert engine.step() == []  # the step still in flight belongs to aborted requests only
    assert [o.outputs[0].token_ids for o in run_to_completion(engine, PROMPTS)] == expected


@pytest.mark.parametrize("where", ["dispatch", "fetch"])
def test_a_step_that_fails_while_another_is_in_flight_fails_only_its_requests(where, monkeypatch):
    engine = tiny_engine(async_scheduling=True)
    expected = [dense_greedy(engine, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    engine.step()
    engine.step()  # one step in flight, one completed
    fail_once(monkeypatch, engine.runner, where)
    failed = [o for o in engine.step() if o.error]
    assert failed and all("injected failure" in o.error for o in failed)
    outputs = drain(engine, [i for i in ids if i not in {o.request_id for o in failed}])
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    engine.check_kv_invariants()
    assert engine.kv.usage().used == 0
    assert [o.outputs[0].token_ids for o in run_to_completion(engine, PROMPTS)] == expected


def test_a_dispatch_failure_after_a_stop_keeps_the_stop(monkeypatch):
    """Step N samples a request's stop id; step N+1, dispatched with it before N's tokens are known,
    fails: the request ends with its stop (as synchronously), not with N+1's error."""
    import dataclasses

    engine = tiny_engine(async_scheduling=True)
    prompt = PROMPTS[0]
    tokens = dense_greedy(engine, prompt, GREEDY.max_tokens)[0]
    stop = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    n = tokens.index(stop) + 1
    engine.add_request(prompt, dataclasses.replace(GREEDY, stop_token_ids=(stop,)), "x")
    real, calls = engine.runner.dispatch, []

    def dispatch(out, previous):  # step n + 1, the one after the stop's, fails
        calls.append(1)
        if len(calls) == n + 1:
            raise RuntimeError("injected failure")
        return real(out, previous)

    monkeypatch.setattr(engine.runner, "dispatch", dispatch)
    [output] = drain(engine, ["x"])
    assert (output.error, output.outputs[0].finish_reason) == (None, "stop")
    assert output.outputs[0].token_ids == tokens[:n]
    engine.check_kv_invariants()
    assert engine.kv.usage().used == 0


class CountedReads:
    """A step's device output whose reads to the host are counted (`reads`: the shape of each)."""

    def __init__(self, array, reads: list):
        self.array, self.reads = array, reads

    def _read(self):
        self.reads.append(tuple(self.array.shape))
        return np.asarray(self.array)

    def __array__(self, dtype=None, copy=None):
        return self._read() if dtype is None else self._read().astype(dtype)

    def tolist(self):
        return self._read().tolist()

    def __getitem__(self, index):
        return self._read()[index]

    def __iter__(self):
        return iter(self._read())

    def __getattr__(self, name):  # shape, dtype, block_until_ready, ...
        return getattr(self.array, name)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_transfer_per_step_brings_tokens_and_logprobs(monkeypatch, async_scheduling):
    """Every device output of every step is counted when read on the host: exactly one read per
    dispatched step (`engine.num_steps`), of the packed results (tokens, their logprobs, the top ids
    and their logprobs together), never of the tokens kept on the device for the next step; and the
    logprobs it brought are those of greedy tokens."""
    engine = tiny_engine(async_scheduling=async_scheduling)
    runner = engine.runner
    reads, fetches = [], []
    run, fetch = runner.run, runner.fetch

    def counted_run(inputs, decode_only, prev_tokens=None, prompt_targets=None):
        if isinstance(prev_tokens, CountedReads):
            prev_tokens = prev_tokens.array  # the next step reads them on the device
        tokens, packed, prompt = run(inputs, decode_only, prev_tokens, prompt_targets)
        assert prompt is None  # no request asks for prompt logprobs
        return CountedReads(tokens, reads), CountedReads(packed, reads), prompt

    def counted_fetch(inflight):
        fetches.append(inflight.num_requests)
        return fetch(inflight)

    monkeypatch.setattr(runner, "run", counted_run)
    monkeypatch.setattr(runner, "fetch", counted_fetch)
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    ids = [engine.add_request(PROMPTS[0], params[0]), engine.add_request(PROMPTS[5], params[1])]
    out = drain(engine, ids)[0]
    assert engine.num_steps > 6  # prefill chunks, then decodes
    assert len(fetches) == len(reads) == engine.num_steps, (engine.num_steps, fetches, reads)
    # the packed [S, 3 + 2 * MAX_LOGPROBS] results (top logprobs along), never the [S] tokens
    assert all(len(shape) == 2 and shape[1] == 3 + 2 * MAX_LOGPROBS for shape in reads), reads
    lps = out.outputs[0].logprobs
    assert len(lps) == 4 and all(len(entry) == 3 for entry in lps)
    for token, entry in zip(out.outputs[0].token_ids, lps):
        assert max(e.logprob for e in entry.values()) == pytest.approx(entry[token].logprob)  # greedy: the top
        assert entry[token].rank == 1 and all(np.isfinite(e.logprob) and e.logprob <= 0 for e in entry.values())
