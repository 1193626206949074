"""The engine with the Pallas kernels in interpret mode gives the same greedy tokens as the XLA path."""

import numpy as np
import pytest

from llmjax.sampling_params import SamplingParams
from tests.engine_helpers import run_to_completion, tiny_engine

RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(3, 250, size=n).tolist() for n in (5, 19, 20)]  # step 2 mixes decodes and a chunk
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-mla"])
def test_pallas_interpret_matches_xla(preset):
    engines = {
        backend: tiny_engine(preset, attention_backend=backend, block_size=16, max_num_batched_tokens=32)
        for backend in ("xla", "pallas-interpret")
    }
    outputs = {backend: run_to_completion(e, PROMPTS, PARAMS) for backend, e in engines.items()}
    for ours, ref in zip(outputs["pallas-interpret"], outputs["xla"]):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids


def test_fresh_prefill_steps_run_through_the_flash_kernel():
    """The first step (three prompts from position 0) is a fresh prefill. With the flash path's
    attention replaced by zeros the tokens change, so that step runs it; with the real kernel they
    equal the XLA path's, so it is right there and the steps that are not fresh (a chunk
    continuation, decodes: flash would miss their cached context) do not take it."""
    import dataclasses

    import jax.numpy as jnp

    from llmjax.attention.backend import PrefillAttention

    def engine(zero_prefill: bool):
        e = tiny_engine("tiny-gqa", attention_backend="pallas-interpret", block_size=16, max_num_batched_tokens=32)
        if zero_prefill:
            runner, real = e.runner, e.runner.backend
            zeros = PrefillAttention(real.prefill.plan, lambda q, k, v, plan, *, sm_scale: jnp.zeros_like(q))
            backend = dataclasses.replace(real, name="pallas-interpret, prefill zeroed", prefill=zeros)
            runner._step_fn, runner._traces = runner.step_function(backend)
        return e

    xla = run_to_completion(tiny_engine("tiny-gqa", block_size=16, max_num_batched_tokens=32), PROMPTS, PARAMS)
    real = run_to_completion(engine(False), PROMPTS, PARAMS)
    zeroed = run_to_completion(engine(True), PROMPTS, PARAMS)
    tokens = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert tokens(real) == tokens(xla)
    assert tokens(zeroed) != tokens(xla)
