"""Sampling against its definition: support and frequencies of top-k / top-p / min-p on a tiny vocabulary,
seeds, greedy rows, and validation of SamplingParams."""

import jax
import numpy as np
import pytest

from llmjax.sampler import SamplingInput, sample
from llmjax.sampling_params import SamplingParams, SamplingParamsError

PROBS = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
N = 6000


def draw(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3):
    logits = np.tile(np.log(PROBS).astype(np.float32), (N, 1))
    s = SamplingInput(
        temperature=np.full(N, temperature, np.float32), top_k=np.full(N, top_k, np.int32),
        top_p=np.full(N, top_p, np.float32), min_p=np.full(N, min_p, np.float32),
        seeds=np.full(N, seed, np.uint32), output_index=np.arange(N, dtype=np.int32),
    )
    tokens, logprobs, _, _ = jax.jit(sample)(logits, s)
    return np.asarray(tokens), np.asarray(logprobs)


def expected_distribution(keep: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    p = np.where(keep, PROBS ** (1 / temperature), 0)
    return p / p.sum()


def assert_frequencies(tokens: np.ndarray, expected: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=len(PROBS))
    assert np.all(counts[expected == 0] == 0), f"tokens outside the support: {counts}"
    sigma = np.sqrt(N * expected * (1 - expected))
    assert np.all(np.abs(counts - N * expected) <= 5 * sigma + 1), f"{counts} vs {N * expected}"


@pytest.mark.parametrize(
    "kwargs, keep",
    [
        (dict(), [1, 1, 1, 1, 1, 1]),
        (dict(top_k=2), [1, 1, 0, 0, 0, 0]),
        (dict(top_k=-1), [1, 1, 1, 1, 1, 1]),
        (dict(top_p=0.7), [1, 1, 1, 0, 0, 0]),  # 0.40 + 0.25 < 0.7, so the third token is still needed
        (dict(top_p=0.65), [1, 1, 0, 0, 0, 0]),  # mass before the third token is 0.65: not < 0.65
        (dict(min_p=0.3), [1, 1, 1, 0, 0, 0]),  # keep p >= 0.3 * 0.40 = 0.12
        (dict(top_k=3, top_p=0.5), [1, 1, 0, 0, 0, 0]),
    ],
)
def test_filters_respect_their_support(kwargs, keep):
    tokens, _ = draw(**kwargs)
    assert_frequencies(tokens, expected_distribution(np.array(keep, bool)))


def test_temperature_sharpens():
    tokens, _ = draw(temperature=0.5)
    assert_frequencies(tokens, expected_distribution(np.ones(6, bool), temperature=0.5))


def test_greedy_and_logprobs():
    tokens, logprobs = draw(temperature=0.0)
    assert np.all(tokens == 0)
    np.testing.assert_allclose(logprobs, np.log(PROBS[0]), rtol=1e-5)


def test_same_seed_same_draws_other_seed_differs():
    a, _ = draw(seed=11)
    b, _ = draw(seed=11)
    c, _ = draw(seed=12)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=99), "logprobs"), (dict(n=2), "n"), (dict(stop=[""]), "stop"), (dict(seed=-1), "seed"),
    ],
)
def test_invalid_values_name_their_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ("END",)
