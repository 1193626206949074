"""experiments/triton_sm90.py's host-side half: the Triton IR of a lowered Pallas kernel, as text,
with its launch parameters (the sm_90 compile itself needs the optional `triton` package)."""

import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

from pallas_kernels import flash_attention  # noqa: E402
from pallas_kernels.platform import lower_for_cuda  # noqa: E402
from triton_sm90 import blocks_per_sm, triton_calls  # noqa: E402


def test_triton_ir_of_a_lowered_kernel():
    q, k = jnp.zeros((1, 256, 8, 64), jnp.bfloat16), jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    [call] = triton_calls(lower_for_cuda(flash_attention, q, k, k))
    assert call["name"] == "flash_attention"
    assert (call["num_warps"], call["num_stages"]) == (4, 3)  # _config's d64 choice, the default stages
    assert call["grid"] == (2, 8, 1)  # 256 / 128 query tiles, 8 heads, batch 1
    assert "tt.func public @flash_attention" in call["ttir"] and "tt.dot" in call["ttir"]


def test_blocks_per_sm():
    assert blocks_per_sm(128, 4, 0) == 4  # 128 x 32 x 4 registers a block: 65536 / 16384
    assert blocks_per_sm(255, 4, 0) == 2  # rounded up to 256 a thread
    assert blocks_per_sm(32, 4, 100 * 1024) == 2  # shared memory bounds it
    assert blocks_per_sm(16, 1, 0) == 32
