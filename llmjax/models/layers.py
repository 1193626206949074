"""Building blocks of the decoder: RMSNorm, rotary embeddings, the SwiGLU MLP, linear layers.

All layers work on any leading shape (`[..., features]`): the dense forward feeds `[B, T, d]`,
the paged forward feeds the flat `[T, d]` of a mixed batch.

Precision: parameters are stored in the model dtype (float32, or bfloat16 for the mixed-precision
path); every linear layer casts its input to the parameter dtype and accumulates in float32
(`preferred_element_type`), so activations (the residual stream, norms, RoPE, softmax) stay float32
whatever the parameter dtype. A bfloat16 model on a CPU with AMX or AVX512-BF16 holds its linear
kernels packed for `llmjax.ops.packed_matmul` (same products and float32 accumulation; see `Linear`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llmjax.config import HIDDEN_ACTS, ModelConfig, yarn_mscale
from llmjax.ops.packed_matmul import PACKED_NDIM, packed_matmul


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerKernel:
    """One layer's packed kernel inside the layer scan: the whole stack `[L, ...]` of packed
    kernels (bfloat16 values or their uint16 bits) and the layer index (int32 scalar).
    `packed_matmul` reads the layer's weight in place; slicing the stack would copy every layer's
    weights on every step."""

    stack: jax.Array
    layer: jax.Array


class Linear(nnx.Linear):
    """`nnx.Linear` whose kernel may instead be packed (a bfloat16
    `[ceil(out/32), ceil(in/32), 2, 16, 32]` array from `llmjax.ops.packed_matmul.pack_weight`, or
    a `LayerKernel` in the layer scan; `llmjax.models.transformer.pack_linear_weights` packs
    them at load time), multiplied by `packed_matmul`. Either way the input is cast to the
    parameter dtype and the product accumulates in, and returns, float32 (plus the bias)."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value()
        if isinstance(kernel, LayerKernel):
            y = packed_matmul(inputs, kernel.stack, self.out_features, layer=kernel.layer)
        elif kernel.ndim == PACKED_NDIM:
            y = packed_matmul(inputs, kernel, self.out_features)
        else:
            return super().__call__(inputs)
        return y if self.bias is None else y + self.bias[...]


def linear(in_features: int, out_features: int, *, bias: bool, dtype, rngs: nnx.Rngs) -> Linear:
    """A linear layer with kernel `[in, out]` (HF stores `[out, in]`; the loader transposes).

    Inputs are cast to `dtype` (the parameter dtype); the product accumulates in, and returns,
    float32."""
    return Linear(
        in_features, out_features, use_bias=bias, dtype=dtype, param_dtype=dtype,
        preferred_element_type=jnp.float32, kernel_init=nnx.initializers.normal(0.02), rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in float32; the result has the wider of x's and weight's dtypes
    (float32 activations stay float32 with bfloat16 weights)."""

    def __init__(self, features: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((features,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)  # float32 x: promoted to float32


# HF's activations by name (transformers' ACT2FN): GELU exact, or its tanh approximation
ACTIVATIONS = {"silu": jax.nn.silu, "gelu": functools.partial(jax.nn.gelu, approximate=False),
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
               "gelu_new": functools.partial(jax.nn.gelu, approximate=True), "relu": jax.nn.relu}
assert tuple(ACTIVATIONS) == HIDDEN_ACTS  # the names ModelConfig accepts


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), `act` one of `ACTIVATIONS` (SiLU: SwiGLU); biases with `bias`."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, act: str = "silu", bias: bool = False):
        self.gate_proj = linear(hidden, intermediate, bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = linear(hidden, intermediate, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(intermediate, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[rope_dim // 2]` and the cos/sin scale, for the rope types HF configs use.

    default: theta^(-2i/d); linear: divided by `factor`; freq_factors: frequency i divided by
    `factors[i]` (llama.cpp's rope_freqs); llama3: low frequencies divided by `factor`
    with a smooth band between `low_freq_factor` and `high_freq_factor`; yarn: interpolation blended
    with extrapolation over the correction range given by `beta_fast`/`beta_slow`, and cos/sin scaled
    by the attention factor.
    """
    dim = cfg.rope_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    params = cfg.rope_params
    kind = params.get("rope_type", "default")
    scale = 1.0
    if kind == "linear":
        inv_freq = inv_freq / params["factor"]
    elif kind == "freq_factors":
        inv_freq = inv_freq / np.asarray(params["factors"], np.float64)
    elif kind == "llama3":
        factor, old_len = params["factor"], params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif kind == "yarn":
        old_len = params["original_max_position_embeddings"]
        factor = params["factor"]
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        scale = params.get("attention_factor") or (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
            else yarn_mscale(factor)
        )
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(scale)


class RotaryEmbedding:
    """Applies RoPE to `[..., heads, rope_dim]` given positions `[...]`.

    `interleave=False` rotates pairs (i, i + d/2) (HF's rotate_half); `interleave=True` rotates
    adjacent pairs (2i, 2i+1) and returns them de-interleaved (evens' results, then odds'), as HF's
    DeepSeek code does. Either way q·k depends only on the position difference.
    """

    def __init__(self, cfg: ModelConfig, interleave: bool = False):
        inv_freq, self.scale = rope_frequencies(cfg)
        self.inv_freq = inv_freq
        self.interleave = interleave

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq)
        cos = (jnp.cos(freqs) * self.scale)[..., None, :]
        sin = (jnp.sin(freqs) * self.scale)[..., None, :]
        xf = x.astype(jnp.float32)
        if self.interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x.dtype)
