"""The decoder: embedding, a stack of layers run with `jax.lax.scan`, final norm, LM head.

Mixed precision: parameters in the model dtype (float32 or bfloat16), the residual stream and
logits in float32, every matmul accumulating in float32 (see `layers.py`).

Layer parameters are stacked along a leading `num_layers` axis (created with `nnx.vmap`), so
compile time does not grow with depth. `pack_linear_weights` packs a bfloat16 model's linear
kernels for `llmjax.ops.packed_matmul` at load time. Two entry points share every layer:

- `__call__(tokens [B, T])` -> logits `[B, T, V]`: dense causal forward (tests, training).
- `forward_paged(cache, step, backend)` -> (final hidden states `[T, D]`, cache): the engine's
  forward over a mixed batch and the paged KV cache; `logits(hidden)` is the LM head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llmjax.attention.cache_dtype import storage_dtype, to_storage, to_values
from llmjax.config import ModelConfig
from llmjax.models.attention import AttentionContext, Cache, DenseContext, GQAAttention, MLAAttention, PagedContext
from llmjax.models.layers import MLP, LayerKernel, Linear, RMSNorm, linear
from llmjax.ops.packed_matmul import PACKED_NDIM, pack_weight
from llmjax.step_input import StepInput


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        attention_cls = MLAAttention if cfg.attention == "mla" else GQAAttention
        self.self_attn = attention_cls(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, cfg.hidden_act, cfg.mlp_bias)

    def __call__(self, x, positions, ctx: AttentionContext, layer, cache):
        attn_out, cache = self.self_attn(self.input_layernorm(x), positions, ctx, layer, cache)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Transformer(nnx.Module):
    """A Llama-style (GQA family) or DeepSeek-style (MLA, dense MLP) decoder."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02), rngs=rngs,
        )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype, rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)

    def _run_layers(self, x, positions, ctx: AttentionContext, cache: Cache):
        graphdef, packed, state = nnx.split(self.layers, _is_packed_stack, ...)

        def body(carry, xs):
            h, c = carry
            layer_state, layer_idx = xs
            layer_state = jax.tree.map(to_values, layer_state)  # uint16-stored bfloat16: one layer's bitcast
            kernels = jax.tree.map(lambda stack: LayerKernel(stack, layer_idx), packed)  # read in place
            h, c = nnx.merge(graphdef, layer_state, kernels)(h, positions, ctx, layer_idx, c)
            return (h, c), None

        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (state, layer_ids))
        return self.norm(x), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head (tied to the embedding when the config says so); float32 logits."""
        if not hasattr(self, "lm_head"):  # tied; a tied model with packed kernels has a packed copy
            w = self.embed_tokens.embedding[...]
            return jnp.einsum("...d,vd->...v", hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)
        return self.lm_head(hidden)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings as the float32 residual stream (whatever the parameter dtype)."""
        return self.embed_tokens(tokens).astype(jnp.float32)

    def __call__(self, tokens: jax.Array, *, absorb_mla: bool = False) -> jax.Array:
        """Dense causal forward over `[B, T]` tokens at positions 0..T-1 -> logits `[B, T, V]`."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, _ = self._run_layers(self.embed(tokens), positions, DenseContext(absorb_mla), ())
        return self.logits(hidden)

    def forward_paged(self, cache: Cache, step: StepInput, backend, block_size: int, decode_only: bool = False):
        """One engine step: writes the new tokens' KV into `cache`, returns (the final normed hidden
        state of every new token `[T, D]`, cache). The caller applies `logits` to the rows it needs."""
        plan = backend.plan(step, self.config, decode_only) if getattr(backend, "plan", None) else None
        prefill = None
        if getattr(backend, "prefill", None) is not None and not decode_only and self.config.attention != "mla":
            qsl = step.query_start_loc
            fresh = jnp.all(step.seq_lens == qsl[1:] - qsl[:-1])  # every request's context is its new tokens
            prefill = (fresh, backend.prefill.plan(step))
        # plans: once per step, not per layer
        ctx = PagedContext(step, backend, block_size, decode_only, plan=plan, prefill=prefill)
        hidden, cache = self._run_layers(self.embed(step.token_ids), step.positions, ctx, cache)
        return hidden, cache


def init_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype) -> Cache:
    """Zeroed paged KV cache arrays holding `dtype` values (see docs/architecture.md for the layout;
    a bfloat16 cache on CPU is stored as uint16 bits, `llmjax.attention.cache_dtype`)."""
    dtype = storage_dtype(dtype)
    if cfg.attention == "mla":
        shape = (cfg.num_layers, num_blocks, block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return (jnp.zeros(shape, dtype),)
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def store_layer_weights(state, platform: str | None = None):
    """The parameter state with the stacked layer weights of a bfloat16 model stored as uint16 bits on
    CPU (`llmjax.attention.cache_dtype`): XLA:CPU otherwise widens every stacked bfloat16 weight to
    float32 as a whole before the layer scan, on every step, and runs the layers' matmuls in float32
    (measured: 2.3x slower than bfloat16 matmuls). The layer scan bitcasts each layer's slice back.
    Embedding, final norm and LM head run outside the scan and stay bfloat16."""

    def store(path, leaf):
        in_layers = any(getattr(k, "key", None) == "layers" for k in path)
        stored = storage_dtype(leaf.dtype, platform)
        if not in_layers or stored == leaf.dtype:
            return leaf
        if isinstance(leaf, np.ndarray):
            return leaf.view(stored)  # host memory, no copy
        return to_storage(leaf, stored)

    return jax.tree_util.tree_map_with_path(store, state)


def _is_packed_stack(path, variable) -> bool:
    """Whether a layer-stack variable is a stack of packed kernels (`pack_linear_weights`)."""
    return variable.get_value().ndim == PACKED_NDIM + 1


_READ_AS_MATRIX = ("kv_b_proj",)  # MLA's kernel that is read as a matrix, never called as a layer


def pack_linear_weights(graphdef: nnx.GraphDef, state) -> tuple[nnx.GraphDef, nnx.State]:
    """The bfloat16 model with every `Linear` kernel packed
    (`llmjax.ops.packed_matmul.pack_weight`), except MLA's `kv_b_proj`. The layers' stacked
    `[L, K, N]` kernels become `[L, ...]` stacks of packed ones, which the layer scan hands to
    the kernel whole with the layer index (`LayerKernel`: no per-layer copy). A tied model also
    gets an `lm_head` holding the packed transposed embedding (the embedding itself stays, for
    the lookup). Numpy parameters stay numpy. Call before `store_layer_weights` (the packed
    stacks are then held as uint16 bits too, which the kernel reads as they are); only where
    `packed_matmul.enabled(bfloat16)`."""
    model = nnx.merge(graphdef, state)
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Linear) and path[-1] not in _READ_AS_MATRIX:
            module.kernel = nnx.Param(pack_weight(module.kernel[...]))
    if not hasattr(model, "lm_head"):
        cfg = model.config
        head = nnx.eval_shape(lambda: linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                             dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        head.kernel = nnx.Param(pack_weight(np.asarray(model.embed_tokens.embedding[...]).T))
        model.lm_head = head
    return nnx.split(model)
