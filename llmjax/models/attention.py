"""Attention layers (GQA family and MLA) and the two ways they attend: dense or over the paged cache.

A layer computes its projections and RoPE, then hands q/k/v to an *attention context*:

- `DenseContext`: whole sequences `[B, T, ...]`, causal, no cache (reference tests, training).
- `PagedContext`: the flat tokens of a mixed batch `[T, ...]` (a `StepInput`); it writes the new
  K/V (or MLA latent) into the paged cache and calls the selected attention backend.

So one layer implementation serves both callers. Contexts are functional: they take the cache
pytree and return it updated (the cache is a `lax.scan` carry, updated in place under donation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from llmjax.attention.cache_dtype import to_storage, to_values, value_dtype
from llmjax.config import ModelConfig
from llmjax.models.layers import RMSNorm, RotaryEmbedding, linear
from llmjax.step_input import StepInput

Cache = Any  # (k_cache, v_cache) for the GQA family, (latent_cache,) for MLA, () when dense


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """Causal attention over whole sequences, GQA without repeating K/V.

    q: [B, T, H, Dq]; k: [B, T, Hkv, Dq]; v: [B, T, Hkv, Dv] -> [B, T, H, Dv]. Softmax in float32.
    """
    b, t, h, dq = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, dq)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


class AttentionContext(Protocol):
    absorb_mla: bool

    def gqa(self, q, k, v, layer, cache: Cache, scale: float) -> tuple[jax.Array, Cache]: ...

    def mla(self, q_latent, q_rope, latent, k_rope, layer, cache: Cache, scale: float) -> tuple[jax.Array, Cache]: ...


@dataclass(frozen=True)
class DenseContext:
    """Dense causal attention over `[B, T]` sequences. `absorb_mla` picks MLA's absorbed path."""

    absorb_mla: bool = False

    def gqa(self, q, k, v, layer, cache, scale):
        return dense_attention(q, k, v, scale), cache

    def mla(self, q_latent, q_rope, latent, k_rope, layer, cache, scale):
        q = jnp.concatenate([q_latent, q_rope], axis=-1)
        k = jnp.concatenate([latent, k_rope], axis=-1)[..., None, :]
        return dense_attention(q, k, latent[..., None, :], scale), cache


@dataclass(frozen=True)
class PagedContext:
    """Attention of a mixed batch over the paged KV cache (the engine's path; MLA always absorbed).

    `backend` provides `ragged_paged_attention` and `mla_ragged_paged_attention`
    (see `llmjax.attention.backend`); `decode_only` is static (every request has one token);
    `plan`: the backend's per-step metadata (`backend.plan`), passed to every layer's call.
    `prefill`: (whether the step is a fresh prefill, `backend.prefill.plan(step)`) when the
    backend has a fresh-prefill path; the GQA layers then pick it or the ragged one at run time.
    """

    step: StepInput
    backend: Any
    block_size: int
    decode_only: bool = False
    absorb_mla: bool = True
    plan: Any = None
    prefill: tuple[jax.Array, Any] | None = None

    def _write(self, cache_array: jax.Array, layer, values: jax.Array) -> jax.Array:
        blocks = self.step.slot_mapping // self.block_size
        offsets = self.step.slot_mapping % self.block_size
        return cache_array.at[layer, blocks, offsets].set(to_storage(values, cache_array.dtype))

    def _read_view(self, cache_array: jax.Array) -> jax.Array:
        """The cache as the backend reads it: in its storage dtype when `backend.reads_storage`
        (uint16 bits of a bfloat16 cache on CPU); else as values (bfloat16 for the Pallas kernels:
        a copy, only in CPU interpret mode)."""
        return cache_array if self.backend.reads_storage else to_values(cache_array)

    def _plan(self) -> dict:
        return {} if self.plan is None else {"plan": self.plan}

    def _metadata(self):
        s = self.step
        return (s.query_start_loc, s.seq_lens, s.block_tables, s.num_decodes)

    def gqa(self, q, k, v, layer, cache, scale):
        k_cache, v_cache = cache
        k_cache = self._write(k_cache, layer, k)
        v_cache = self._write(v_cache, layer, v)
        dtype = value_dtype(k_cache.dtype)  # q (and a fresh prefill's k, v) as the kernels expect

        def ragged():
            return self.backend.ragged_paged_attention(
                q.astype(dtype), self._read_view(k_cache), self._read_view(v_cache), layer,
                *self._metadata(), sm_scale=scale, decode_only=self.decode_only, **self._plan(),
            )

        if self.prefill is None:
            out = ragged()
        else:
            fresh, prefill_plan = self.prefill
            attend = self.backend.prefill.attend
            out = jax.lax.cond(fresh, lambda: attend(q.astype(dtype), k.astype(dtype), v.astype(dtype), prefill_plan,
                                                     sm_scale=scale), ragged)
        return out.astype(q.dtype), (k_cache, v_cache)

    def mla(self, q_latent, q_rope, latent, k_rope, layer, cache, scale):
        (latent_cache,) = cache
        latent_cache = self._write(latent_cache, layer, jnp.concatenate([latent, k_rope], axis=-1))
        dtype = value_dtype(latent_cache.dtype)
        out = self.backend.mla_ragged_paged_attention(
            q_latent.astype(dtype), q_rope.astype(dtype), self._read_view(latent_cache), layer, *self._metadata(),
            sm_scale=scale, decode_only=self.decode_only, **self._plan(),
        )
        return out.astype(q_latent.dtype), (latent_cache,)


class GQAAttention(nnx.Module):
    """Multi-head attention with `num_kv_heads` K/V heads: MHA, GQA or MQA."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        h, hkv, d, bias = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj = linear(cfg.hidden_size, h * d, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(cfg.hidden_size, hkv * d, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = linear(cfg.hidden_size, hkv * d, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = linear(h * d, cfg.hidden_size, bias=cfg.attention_out_bias, dtype=dtype, rngs=rngs)
        self.rope = RotaryEmbedding(cfg)
        self.shape = (h, hkv, d)
        self.scale = cfg.softmax_scale()

    def __call__(self, x, positions, ctx: AttentionContext, layer, cache):
        h, hkv, d = self.shape
        lead = x.shape[:-1]
        q = self.rope(self.q_proj(x).reshape(*lead, h, d), positions)
        k = self.rope(self.k_proj(x).reshape(*lead, hkv, d), positions)
        v = self.v_proj(x).reshape(*lead, hkv, d)
        out, cache = ctx.gqa(q, k, v, layer, cache, self.scale)
        return self.o_proj(out.reshape(*lead, h * d)), cache


class MLAAttention(nnx.Module):
    """DeepSeek-V2/V3 multi-head latent attention.

    K/V are compressed into a latent `c` of `kv_lora_rank` dims plus one RoPE key of
    `qk_rope_head_dim` dims shared by all heads; that is all the cache holds.
    Naive path: expand per-head `k_nope` and `v` from `c` with `kv_b_proj`.
    Absorbed path: fold W_UK into the query (`q_latent = q_nope · W_UK`), attend over `c`
    directly, then apply W_UV to the attended latent. The two are algebraically equal.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        h, r = cfg.num_heads, cfg.kv_lora_rank
        self.dims = (h, r, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = linear(cfg.hidden_size, h * qk, bias=False, dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, h * qk, bias=False, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = linear(cfg.hidden_size, r + cfg.qk_rope_head_dim, bias=bias, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(r, 1e-6, dtype)
        self.kv_b_proj = linear(r, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, dtype=dtype, rngs=rngs)
        self.o_proj = linear(h * cfg.v_head_dim, cfg.hidden_size, bias=bias, dtype=dtype, rngs=rngs)
        self.q_lora = cfg.q_lora_rank is not None
        self.rope = RotaryEmbedding(cfg, interleave=cfg.rope_interleave)
        self.scale = cfg.softmax_scale()

    def _up_projections(self) -> tuple[jax.Array, jax.Array]:
        """W_UK [R, H, nope] and W_UV [R, H, v] from kv_b_proj's kernel [R, H*(nope+v)]."""
        h, r, nope, _, dv = self.dims
        w = self.kv_b_proj.kernel[...].reshape(r, h, nope + dv)
        return w[..., :nope], w[..., nope:]

    def __call__(self, x, positions, ctx: AttentionContext, layer, cache):
        h, r, nope, rope_dim, dv = self.dims
        lead = x.shape[:-1]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.reshape(*lead, h, nope + rope_dim)
        q_nope, q_rope = q[..., :nope], self.rope(q[..., nope:], positions)
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., :r])
        k_rope = self.rope(kv[..., None, r:], positions)[..., 0, :]
        w_uk, w_uv = self._up_projections()
        if ctx.absorb_mla:
            q_latent = _matmul("...hn,rhn->...hr", q_nope, w_uk)
            out_latent, cache = ctx.mla(q_latent, q_rope, latent, k_rope, layer, cache, self.scale)
            out = _matmul("...hr,rhv->...hv", out_latent, w_uv)
        else:
            k_nope = _matmul("...r,rhn->...hn", latent, w_uk)
            v = _matmul("...r,rhv->...hv", latent, w_uv)
            k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[..., None, :], (*lead, h, rope_dim))], axis=-1)
            out, cache = ctx.gqa(jnp.concatenate([q_nope, q_rope], axis=-1), k, v, layer, cache, self.scale)
        return self.o_proj(out.reshape(*lead, h * dv)), cache


def _matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum of activations and a weight in the weight's dtype, accumulated in float32 (as `linear`)."""
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)
