"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against the dense model's log-softmax at every
prompt position: chunked prefill, a prompt already in the prefix cache, preemption, asynchronous
scheduling, n > 1 and DELTA outputs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from tests.engine_helpers import (GREEDY, OutputAccumulator, SamplingParams, assert_greedy_matches,
                                  assert_logprob_ranks_and_texts, dense_greedy, dense_logits, drain,
                                  engine_bytes_per_token, tiny_engine)
from llmjax.sampling_params import RequestOutputKind, SamplingParamsError


def _prompts(engine, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, engine.model_config.vocab_size, n).tolist() for n in lengths]


def with_(params: SamplingParams, **changes) -> SamplingParams:
    return dataclasses.replace(params, **changes)


def assert_prompt_logprobs(engine, prompt: list[int], entries, k: int, atol: float = 2e-5) -> None:
    """`entries` are the dense model's: None first, then per token {id: Logprob} with the token's own
    first, the others its top k (ids may differ from the reference's only between near-equal values):
    every logprob is the reference's at its id, and the k largest are the reference's k largest;
    ranks and texts as `assert_logprob_ranks_and_texts`."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    ref = np.asarray(jax.nn.log_softmax(dense_logits(engine, prompt), axis=-1))
    for t in range(1, len(prompt)):
        entry, row = entries[t], ref[t - 1]
        ids = list(entry)
        assert ids[0] == prompt[t] and max(k, 1) <= len(ids) <= k + 1, (t, ids)
        np.testing.assert_allclose([entry[i].logprob for i in ids], row[ids], atol=atol)
        np.testing.assert_allclose(sorted((e.logprob for e in entry.values()), reverse=True)[:k],
                                   np.sort(row)[::-1][:k], atol=atol)
        assert_logprob_ranks_and_texts(engine, entry, row, k, atol)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_the_dense_model(async_scheduling):
    """Prompts of one token, within one chunk and over several chunks (budget 64), k = 0 and 5; the
    generated tokens are unchanged."""
    engine = tiny_engine(async_scheduling=async_scheduling)
    prompts = _prompts(engine, (1, 7, 64, 65, 110))
    ks = (5, 0, 5, 3, 5)
    ids = [engine.add_request(p, with_(GREEDY, prompt_logprobs=k)) for p, k in zip(prompts, ks)]
    for prompt, k, out in zip(prompts, ks, drain(engine, ids)):
        assert_prompt_logprobs(engine, prompt, out.prompt_logprobs, k)
        expected, logits = dense_greedy(engine, prompt, GREEDY.max_tokens)
        assert_greedy_matches(out.outputs[0].token_ids, expected, logits)
        assert out.outputs[0].logprobs is None


def test_a_cached_prompt_is_computed_again_for_its_logprobs():
    """A prompt whose pages are in the prefix cache gets no hit when it asks for prompt logprobs (the
    cache holds KV, not logits); the same prompt without them hits."""
    engine = tiny_engine()
    [prompt] = _prompts(engine, (40,))
    drain(engine, [engine.add_request(prompt, GREEDY)])
    queries = engine.kv.stats().queries
    [with_logprobs] = drain(engine, [engine.add_request(prompt, with_(GREEDY, prompt_logprobs=2))])
    assert with_logprobs.num_cached_tokens == 0
    assert_prompt_logprobs(engine, prompt, with_logprobs.prompt_logprobs, 2)
    assert engine.kv.stats().queries == queries  # not counted as a cache query
    [without] = drain(engine, [engine.add_request(prompt, GREEDY)])
    assert without.num_cached_tokens > 0 and without.prompt_logprobs is None


def test_preempted_requests_keep_one_entry_per_prompt_token():
    """A pool that forces preemptions (recompute): each prompt token still has exactly one entry, the
    dense model's."""
    engine = tiny_engine(kv_cache_memory_bytes=14 * 8 * engine_bytes_per_token("tiny-gqa"), max_num_seqs=4)
    prompts = _prompts(engine, (50, 45, 40, 30), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outs = drain(engine, [engine.add_request(p, params) for p in prompts])
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs(engine, prompt, out.prompt_logprobs, 1)


@pytest.mark.parametrize("n", [1, 3])
def test_delta_outputs_carry_prompt_logprobs_once(n):
    """Streaming: the prompt logprobs come once, with the request's first output; they are the same
    as in a FINAL_ONLY output (and with n > 1, once for the request, not per sample)."""
    engine = tiny_engine()
    [prompt] = _prompts(engine, (70,), seed=5)
    params = SamplingParams(n=n, temperature=0.8, seed=11, max_tokens=5, ignore_eos=True, prompt_logprobs=4)
    rid = engine.add_request(prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [d for d in engine.step() if d.request_id == rid]
    carrying = [i for i, d in enumerate(deltas) if d.prompt_logprobs is not None]
    assert carrying == [0]
    assert_prompt_logprobs(engine, prompt, deltas[0].prompt_logprobs, 4)
    whole = OutputAccumulator()
    for d in deltas:
        whole.add(d)
    [final] = drain(engine, [engine.add_request(prompt, with_(params, output_kind=RequestOutputKind.FINAL_ONLY))])
    assert final.prompt_logprobs == whole.outputs[rid].prompt_logprobs
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in whole.outputs[rid].outputs]


def test_an_aborted_request_returns_the_prompt_logprobs_it_has():
    engine = tiny_engine()
    [prompt] = _prompts(engine, (110,), seed=7)
    rid = engine.add_request(prompt, with_(GREEDY, prompt_logprobs=0))
    engine.step()  # one chunk of 64 tokens
    out = engine.abort(rid)
    assert out.finished and out.prompt_logprobs is not None and 1 < len(out.prompt_logprobs) < len(prompt)
    assert_prompt_logprobs(engine, prompt[: len(out.prompt_logprobs)], out.prompt_logprobs, 0)
    assert engine.kv.usage().used == 0


@pytest.mark.parametrize("value", [-1, 21, 1.5, "2", True])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(prompt_logprobs=value)
    assert err.value.param == "prompt_logprobs"
