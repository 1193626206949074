"""The synthesised length distributions (`llmjax.workloads`) and the traces built on them."""

from __future__ import annotations

import numpy as np
import pytest

from llmjax.workloads import ALPACA, SHAREGPT, lognormal_lengths
from paper_repro.traces import length_trace


@pytest.mark.parametrize("dist", [SHAREGPT, ALPACA])
def test_lengths_have_the_published_mean_within_their_caps(dist):
    rng = np.random.default_rng(0)
    caps = rng.integers(200, 2000, 5000)
    lengths = lognormal_lengths(rng, 5000, dist.mean_output, dist.sigma_output, caps)
    assert lengths.min() >= 1 and (lengths <= caps).all()
    assert abs(lengths.mean() - dist.mean_output) < 0.5  # to within the integer rounding
    assert np.std(np.log(lengths)) > 0.5  # spread, not one value


def test_a_mean_out_of_the_caps_reach_gives_the_caps_and_no_length_and_a_zero_cap_are_refused():
    rng = np.random.default_rng(0)
    assert (lognormal_lengths(rng, 5, 1000, 1.0, 100) == 100).all()
    assert (lognormal_lengths(rng, 5, 0.5, 1.0, 100) == 1).all()
    assert lognormal_lengths(rng, 0, 10, 1.0, 100).shape == (0,)
    with pytest.raises(ValueError, match="at least 1"):
        lognormal_lengths(rng, 3, 10, 1.0, np.array([5, 0, 5]))


def test_a_trace_whose_prompts_may_fill_the_context_still_leaves_one_output_token():
    trace = length_trace(SHAREGPT, 2000, 1.0, seed=0, vocab=1000, max_model_len=256, max_prompt_len=256)
    assert min(r.output_len for r in trace) >= 1
    assert max(len(r.prompt) + r.output_len for r in trace) <= 256
