"""Fault injection: a failure while preparing one request, inside one step, or while appending one
request's token fails only the requests concerned; afterwards the engine serves the next request
correctly, the KV invariants hold and no block leaks."""

import dataclasses

import jax
import numpy as np
import pytest

from llmjax.engine import RequestError
from llmjax.request import MAX_NAMESPACE_CHARS
from llmjax.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_helpers import GREEDY, dense_greedy, drain, run_to_completion, tiny_engine

RNG = np.random.default_rng(99)
PROMPTS = [RNG.integers(3, 250, size=n).tolist() for n in (9, 21, 14)]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def expected(engine):
    return [dense_greedy(engine, p, GREEDY.max_tokens)[0] for p in PROMPTS]


def assert_healthy(engine, expected):
    """Idle, invariants hold, nothing leaked, and a new batch is served exactly."""
    assert not engine.has_unfinished_requests() and not engine._parents
    engine.check_kv_invariants()
    assert engine.kv.usage().used == 0
    assert [o.outputs[0].token_ids for o in run_to_completion(engine, PROMPTS)] == expected
    assert engine.kv.usage().used == 0


def fail_once(monkeypatch, obj, name, error=RuntimeError("injected failure"), before=None):
    """Make `obj.name` raise once (after running `before`, if given), then behave normally."""
    original = getattr(obj, name)
    calls = []

    def flaky(*args, **kwargs):
        if not calls:
            calls.append(1)
            if before is not None:
                before()
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return calls


def test_a_runner_that_raises_once_fails_only_that_step(engine, expected, monkeypatch):
    first = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()  # the first request is running (prefilled)
    second = engine.add_request(PROMPTS[1], GREEDY)
    calls = fail_once(monkeypatch, engine.runner, "dispatch")
    failed = engine.step()  # one step with both: both fail
    assert calls and {o.request_id for o in failed} == {first, second}
    for out in failed:
        assert out.finished and "injected failure" in out.error
        assert all(c.finish_reason == "error" for c in out.outputs)
    assert_healthy(engine, expected)



def test_an_interrupted_dispatch_caches_none_of_the_kv_it_did_not_write(engine, expected, monkeypatch):
    """Ctrl-C while a step is dispatched (a KeyboardInterrupt, no Exception) reaches the caller, and
    once its requests are aborted (as `LLM.generate` does) none of the KV that step was to write is
    in the prefix cache: the same prompts later hit nothing and give the reference's tokens."""
    prompts = [np.random.default_rng(7).integers(3, 250, size=n).tolist() for n in (17, 24)]  # not cached yet
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    fail_once(monkeypatch, engine.runner, "dispatch", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    for request_id in ids:
        engine.abort(request_id)
    outputs = run_to_completion(engine, prompts)
    assert [o.num_cached_tokens for o in outputs] == [0, 0]
    assert [o.outputs[0].token_ids for o in outputs] == [dense_greedy(engine, p, GREEDY.max_tokens)[0]
                                                         for p in prompts]
    assert_healthy(engine, expected)

def test_a_step_that_loses_the_cache_fails_its_requests_and_drops_the_prefix_cache(engine, expected, monkeypatch):
    """The device call fails after its donated cache is gone: the step's requests fail, the cache is
    rebuilt and the prefix cache (whose blocks' contents were lost) is dropped, so later requests
    that share those prompts are computed again, correctly."""
    run_to_completion(engine, PROMPTS)
    assert engine.kv.usage().cached > 0
    victim = engine.add_request(PROMPTS[0], GREEDY)

    def lose_cache():
        jax.tree.map(lambda x: x.delete(), engine.runner.cache)

    fail_once(monkeypatch, engine.runner, "dispatch", before=lose_cache)
    [failed] = engine.step()
    assert failed.request_id == victim and failed.finished and "injected failure" in failed.error
    assert engine.kv.usage().cached == 0
    assert_healthy(engine, expected)


def test_a_tokenizer_that_raises_on_one_prompt_fails_that_request_alone(engine, expected, monkeypatch):
    good = engine.add_request(PROMPTS[0], GREEDY)
    original = engine.tokenizer.encode

    def encode(text, *args, **kwargs):
        if text == "poison":
            raise UnicodeError("cannot encode this prompt")
        return original(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    with pytest.raises(UnicodeError):
        engine.add_request("poison", GREEDY)
    [out] = drain(engine, [good])
    assert out.outputs[0].token_ids == expected[0]
    assert_healthy(engine, expected)


@pytest.mark.parametrize("output_kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
@pytest.mark.parametrize("failing_token", [1, 3, GREEDY.max_tokens])  # the last one also ends the request
def test_a_detokenizer_that_raises_on_one_token_fails_that_request_alone(engine, expected, monkeypatch, output_kind,
                                                                        failing_token):
    """Streamed: the text is made every step (the first token's by the general path, a later one's
    by the plain-stream path); FINAL_ONLY: once, when the request finishes."""
    params = dataclasses.replace(GREEDY, output_kind=output_kind)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    victim = engine._parents[ids[1]].texts[0].detokenizer
    original, calls = victim.add, []

    def add(token):
        calls.append(token)
        if len(calls) == failing_token:
            raise RuntimeError("injected failure")
        return original(token)

    monkeypatch.setattr(victim, "add", add)
    outputs = drain(engine, ids)
    assert outputs[1].error and outputs[1].outputs[0].finish_reason == "error"
    assert [outputs[i].outputs[0].token_ids for i in (0, 2)] == [expected[0], expected[2]]
    assert [outputs[i].outputs[0].text for i in (0, 2)] == [engine.tokenizer.decode(expected[i]) for i in (0, 2)]
    assert_healthy(engine, expected)


@pytest.mark.parametrize("params, param", [(dict(logit_bias={10**6: 1.0}), "logit_bias")])
def test_values_the_engine_cannot_serve_are_refused_before_queueing(engine, expected, params, param):
    with pytest.raises(RequestError) as err:
        engine.add_request(PROMPTS[0], SamplingParams(**params))
    assert err.value.param == param
    assert_healthy(engine, expected)


def test_extreme_sampling_values_are_served(engine, expected):
    extremes = [
        SamplingParams(seed=2**64 - 1, top_k=2**31 - 1, max_tokens=4),  # above the vocabulary: no filter
        SamplingParams(seed=-(2**63), temperature=1e-30, max_tokens=4),  # raised to 0.01
        SamplingParams(seed=1099511627776, temperature=1e6, top_p=1e-9, min_p=1.0, max_tokens=4),
        SamplingParams(temperature=2.0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-6,
                       logit_bias={3: -100, 4: 100}, min_tokens=4, max_tokens=4),
        SamplingParams(temperature=1e-3, repetition_penalty=3e38, top_k=1, max_tokens=4),
    ]
    outputs = run_to_completion(engine, [PROMPTS[0]] * len(extremes), extremes[0])  # one batch, then mixed
    ids = [engine.add_request(PROMPTS[i % 3], p) for i, p in enumerate(extremes)]
    outputs += drain(engine, ids)
    assert all(o.outputs[0].finish_reason == "length" and not o.error for o in outputs)
    assert_healthy(engine, expected)


def test_a_failed_step_fails_its_own_requests_not_a_later_one_with_the_same_id(expected, monkeypatch):
    """Asynchronous scheduling: request "x" stops (a stop token) while the next step, holding it, is
    in flight; a new request takes the id "x"; that step then fails. Only its own requests fail:
    the old "x" had finished, and the new one was never in it."""
    engine = tiny_engine(async_scheduling=True)
    stop = expected[0][1]
    assert stop != expected[0][0]
    engine.add_request(PROMPTS[0], dataclasses.replace(GREEDY, stop_token_ids=(stop,)), request_id="x")
    finished = []
    while not finished:
        finished = [o for o in engine.step() if o.finished]
    assert finished[0].outputs[0].finish_reason == "stop" and finished[0].outputs[0].token_ids[-1] == stop
    assert any(r.request_id == "x" for r in engine._inflight[0].requests)  # the old "x", in the step in flight
    engine.add_request(PROMPTS[1], GREEDY, request_id="x")
    fail_once(monkeypatch, engine.runner, "fetch")
    assert [o for o in engine.step() if o.error] == []
    [new] = drain(engine, ["x"])
    assert not new.error and new.outputs[0].token_ids == expected[1]
    assert_healthy(engine, expected)


@pytest.mark.parametrize("kwargs, param", [
    (dict(namespace=["a", "list"]), "cache_salt"),
    (dict(namespace=1), "cache_salt"),  # 1, 1.0 and True would share one tenant's cache
    (dict(namespace=""), "cache_salt"),  # as the server refuses an empty cache_salt
    (dict(namespace="t" * (MAX_NAMESPACE_CHARS + 1)), "cache_salt"),  # kept while its pages stay cached
    (dict(arrival_time="soon"), "arrival_time"),
    (dict(arrival_time=float("nan")), "arrival_time"), (dict(request_id=""), "request_id"),
    (dict(request_id=7), "request_id"),
])
def test_bad_request_fields_are_refused_before_queueing(engine, expected, kwargs, param):
    with pytest.raises(RequestError) as err:
        engine.add_request(PROMPTS[0], GREEDY, **kwargs)
    assert err.value.param == param
    assert_healthy(engine, expected)


def test_generated_request_ids_skip_ids_in_use(engine, expected):
    taken = engine.add_request(PROMPTS[0], GREEDY, request_id="req-0")
    generated = [engine.add_request(PROMPTS[i], GREEDY) for i in (1, 2)]
    assert len({taken, *generated}) == 3
    drain(engine, [taken, *generated])
    assert_healthy(engine, expected)


def test_numpy_numbers_in_sampling_params_are_served(engine, expected):
    """NumPy scalars pass as numbers and are served as Python's (a NumPy seed once overflowed in the
    sampler's row setup and failed the whole step)."""
    params = SamplingParams(seed=np.uint64(2**64 - 1), n=np.int64(2), temperature=np.float32(0.7),
                            max_tokens=np.int32(4), stop_token_ids=[np.int64(0)])
    plain = SamplingParams(seed=2**64 - 1, n=2, temperature=float(np.float32(0.7)), max_tokens=4, stop_token_ids=[0])
    [got] = run_to_completion(engine, [PROMPTS[0]], params)
    [want] = run_to_completion(engine, [PROMPTS[0]], plain)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs] and not got.error
    assert_healthy(engine, expected)


@pytest.mark.parametrize("ending", ["abort", "failed step"])
def test_a_parallel_request_ended_before_its_first_token_ends_every_sample(engine, expected, monkeypatch, ending):
    """With prefix caching, samples 1..n-1 of an `n` > 1 request wait (held, never queued) until
    sample 0 has its first token. Ending the request before that (an abort; a failed step) must end
    the held samples too, with nothing queued or leaked."""
    assert engine.config.enable_prefix_caching
    request_id = engine.add_request(PROMPTS[1], dataclasses.replace(GREEDY, n=3))
    assert len(engine._parents[request_id].held) == 2 and engine.num_waiting == 3  # held samples wait too
    if ending == "abort":
        [output] = [engine.abort(request_id)]
        reason = "abort"
    else:
        fail_once(monkeypatch, engine.runner, "dispatch")
        [output] = engine.step()
        reason = "error"
    assert output.finished and [c.index for c in output.outputs] == [0, 1, 2]
    assert all(c.finish_reason == reason and c.token_ids == [] for c in output.outputs)
    assert (output.error is not None) == (ending == "failed step")
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.num_waiting == 0
    assert_healthy(engine, expected)
