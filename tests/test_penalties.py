"""Logits processing end to end on a tiny random model: greedy outputs with penalties, logit bias
and min_tokens equal a dense no-cache decode that applies the NumPy reference of each formula to
the model's own logits; extreme but valid values run; values the model cannot take are refused."""

from dataclasses import replace

import numpy as np
import pytest

from llmjax.engine import RequestError
from llmjax.sampling_params import SamplingParams
from tests.engine_helpers import REF_LEN, _dense_logits_fn, assert_greedy_matches, drain, run_to_completion, tiny_engine
from tests.test_sampling import reference_processing

RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(3, 250, size=n).tolist() for n in (6, 19, 30)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def reference_greedy(engine, prompt, params: SamplingParams, eos=(2,)):
    """Dense greedy decode with the reference processing applied at every step; stops like the engine."""
    fn = _dense_logits_fn(engine.runner.graphdef)
    output, all_logits = [], []
    masked = list(params.stop_token_ids) + list(eos)  # until min_tokens: EOS even with ignore_eos
    stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos))
    for _ in range(params.max_tokens):
        tokens = prompt + output
        padded = np.zeros(REF_LEN, np.int32)
        padded[: len(tokens)] = tokens
        raw = np.asarray(fn(engine.runner.params, padded))[len(tokens) - 1]
        logits = reference_processing(raw, prompt, output, params.logit_bias or {}, masked,
                                      len(output) < params.min_tokens, params.presence_penalty,
                                      params.frequency_penalty, params.repetition_penalty)
        all_logits.append(logits)
        output.append(int(logits.argmax()))
        if len(output) >= params.min_tokens and output[-1] in stops:
            break
    return output, all_logits


def tokens_of(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(presence_penalty=2.0), dict(frequency_penalty=1.5), dict(repetition_penalty=1.9),
    dict(repetition_penalty=0.3, presence_penalty=-1.0), dict(frequency_penalty=-2.0, logit_bias={40: 4.0}),
])
def test_penalties_change_greedy_outputs_as_the_formula_predicts(engine, kwargs):
    params = greedy(**kwargs)
    plain = tokens_of(run_to_completion(engine, PROMPTS, greedy()))
    outputs = tokens_of(run_to_completion(engine, PROMPTS, params))
    changed = 0
    for prompt, out, base in zip(PROMPTS, outputs, plain):
        expected, logits = reference_greedy(engine, prompt, params)
        assert_greedy_matches(out, expected, logits)
        changed += out != base
    assert changed > 0  # the parameter had an effect on these prompts
    assert engine.kv.usage().used == 0


def test_logit_bias_forbids_and_forces_tokens(engine):
    plain = tokens_of(run_to_completion(engine, PROMPTS, greedy()))
    banned = {t: -100.0 for out in plain for t in out}
    outputs = tokens_of(run_to_completion(engine, PROMPTS, greedy(logit_bias=banned)))
    assert all(t not in banned for out in outputs for t in out)
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={77: 100})
    outputs = tokens_of(run_to_completion(engine, PROMPTS, sampled))
    assert all(out == [77] * MAX_TOKENS for out in outputs)


def test_min_tokens_masks_stop_ids_until_reached(engine):
    [plain] = tokens_of(run_to_completion(engine, PROMPTS[:1], greedy()))
    stop = plain[0]
    params = greedy(min_tokens=4, stop_token_ids=[stop])
    [out] = tokens_of(run_to_completion(engine, PROMPTS[:1], params))
    expected, logits = reference_greedy(engine, PROMPTS[0], params)
    assert stop not in out[:4]
    assert_greedy_matches(out, expected, logits)
    eos_params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5, logit_bias={2: 100})  # EOS favoured
    [[out]] = [r.outputs for r in run_to_completion(engine, PROMPTS[:1], eos_params)]
    assert len(out.token_ids) == 6 and 2 not in out.token_ids[:5] and out.token_ids[5] == 2
    assert out.finish_reason == "stop"
    # with ignore_eos, EOS still cannot be sampled before min_tokens (vLLM masks the model's EOS
    # whatever ignore_eos says); afterwards it is sampled and ends nothing
    ignoring = replace(eos_params, ignore_eos=True)
    [[out]] = [r.outputs for r in run_to_completion(engine, PROMPTS[:1], ignoring)]
    assert 2 not in out.token_ids[:5] and out.token_ids[5:] == [2, 2, 2] and out.finish_reason == "length"


def test_seeded_penalised_sampling_ignores_its_batch(engine):
    params = SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=MAX_TOKENS, ignore_eos=True,
                            presence_penalty=1.0, top_k=engine.model_config.vocab_size)
    [alone] = run_to_completion(engine, PROMPTS[:1], params)
    others = SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=0.5)
    ids = [engine.add_request(PROMPTS[1], others), engine.add_request(PROMPTS[0], params),
           engine.add_request(PROMPTS[2], greedy())]
    assert tokens_of(drain(engine, ids))[1] == tokens_of([alone])[0]
    assert engine.kv.usage().used == 0


def test_a_top_k_above_the_vocabulary_filters_nothing(engine):
    """As vLLM clamps it to the vocabulary: the same seeded draws as top-k off."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    drawn = [tokens_of(run_to_completion(engine, PROMPTS[:1], replace(params, top_k=k)))
             for k in (0, vocab + 1, 2**31 - 1)]
    assert drawn[1] == drawn[0] and drawn[2] == drawn[0]


def test_values_beyond_the_model_are_refused(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(RequestError) as err:
        engine.add_request(PROMPTS[0], SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias"
    assert not engine.has_unfinished_requests()
