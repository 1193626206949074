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
