"""Tensor parallelism over a `jax.sharding.Mesh`, partitioned by XLA's SPMD partitioner; multi-host init.

One mesh axis, `"tp"`, of `tensor_parallel_size` devices. The weights are laid out Megatron-style
(the table is in docs/parallelism.md): Q/K/V, gate/up and MLA's `q_proj`/`q_b_proj`/`kv_b_proj` are
split by output column (whole heads per device), `o_proj`/`down_proj` by input row (XLA adds one
all-reduce after each), the embedding and the LM head by vocabulary; norms and MLA's latent
projections are replicated. The GQA KV cache is split by KV head, the MLA latent cache replicated.
Attention runs per device under `shard_map` (`sharded_attention`): each device attends with its own
query heads over its own KV heads, so the Pallas kernels work unchanged.

When `tensor_parallel_size` exceeds `num_kv_heads` (and is a multiple of it), each KV head is
replicated `tp // num_kv_heads` times before sharding, as vLLM does (`replicate_kv_heads`).

Multi-host: `initialize_distributed` calls `jax.distributed.initialize`; the mesh then spans every
process's devices and every process runs the same engine steps on the same requests (JAX's
multi-controller SPMD model).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmjax.attention.backend import AttentionBackend, PrefillAttention
from llmjax.config import ConfigError, EngineConfig, ModelConfig
from llmjax.models.loader import LoadedModel, abstract_model
from llmjax.models.transformer import init_cache

TP = "tp"

# modules whose kernel (and bias) are split by output column, and whose kernel is split by input row
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def initialize_distributed(config: EngineConfig) -> None:
    """Join a multi-host run when `config.coordinator_address` is set (no-op otherwise, or when done).

    Must run before anything touches a JAX device. On CPU, JAX's default cross-process
    collectives (gloo) are used.
    """
    if config.coordinator_address is None or jax.distributed.is_initialized():
        return
    try:
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
    except (ValueError, RuntimeError) as exc:  # num_processes or process_id neither given nor found in the
        # environment; a process that ran JAX computations before
        raise ConfigError(f"joining the multi-host run at {config.coordinator_address} failed: {exc} (give "
                          "num_processes and process_id where the environment does not say them)") from None


def validate(cfg: ModelConfig, tp: int) -> None:
    """Raise `ConfigError` unless every dimension split across `tp` devices divides by `tp`
    (GQA: `num_kv_heads` divides by `tp`, or `tp` by `num_kv_heads` and the KV heads are replicated)."""
    sizes = {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(f"tensor_parallel_size {tp} must divide {name} ({size})")
    hkv = cfg.num_kv_heads
    if cfg.attention == "gqa" and hkv % tp and tp % hkv:
        raise ConfigError(
            f"tensor_parallel_size {tp} must divide num_kv_heads ({hkv}) or be a multiple of it "
            "(then each KV head is replicated)"
        )


def replicate_kv_heads(model: LoadedModel, tp: int) -> LoadedModel:
    """For a GQA model with fewer KV heads than `tp`: repeat each KV head's K/V projection columns
    `tp // num_kv_heads` times, so there are `tp` KV heads (query head h still reads original KV head
    h // (num_heads // num_kv_heads)). Returns `model` itself when no replication is needed."""
    cfg = model.config
    if cfg.attention != "gqa" or cfg.num_kv_heads >= tp:
        return model
    new_cfg = cfg.replace(num_kv_heads=tp)
    dtype = jax.tree.leaves(model.params)[0].dtype
    graphdef, state = abstract_model(new_cfg, dtype)
    pure = nnx.to_pure_dict(model.params)
    attn = pure["layers"]["self_attn"]
    for name in ("k_proj", "v_proj"):
        for leaf, w in attn[name].items():  # kernel [L, D, Hkv*d], bias [L, Hkv*d]
            heads = w.reshape(*w.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
            attn[name][leaf] = heads.repeat(tp // cfg.num_kv_heads, axis=-2).reshape(*w.shape[:-1], -1)
    nnx.replace_by_pure_dict(state, pure)
    return dataclasses.replace(model, config=new_cfg, graphdef=graphdef, params=state)


def prepare_model(model: LoadedModel, tp: int) -> LoadedModel:
    """Validate `model` for `tp`-way tensor parallelism and replicate KV heads if needed."""
    if tp == 1:
        return model
    validate(model.config, tp)
    return replicate_kv_heads(model, tp)


def kv_bytes_per_token_per_device(cfg: ModelConfig, dtype_bytes: int, tp: int) -> int:
    """KV cache bytes one token costs on each device: the GQA cache is split by KV head, MLA's is replicated."""
    total = cfg.kv_bytes_per_token(dtype_bytes)
    return total if cfg.attention == "mla" else total // tp


def make_mesh(tp: int) -> Mesh:
    """A one-axis ("tp") mesh over the first `tp` devices (of all processes). `ConfigError` if too few,
    or if a multi-host mesh would leave some process's devices out."""
    devices = jax.devices()
    if len(devices) < tp:
        hint = ""
        if devices[0].platform == "cpu":
            hint = " (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting)"
        raise ConfigError(f"tensor_parallel_size {tp} needs {tp} devices, JAX sees {len(devices)}{hint}")
    if jax.process_count() > 1 and tp != len(devices):
        raise ConfigError(
            f"with {jax.process_count()} processes tensor_parallel_size must equal the global device count "
            f"({len(devices)}), got {tp}"
        )
    return Mesh(np.asarray(devices[:tp]), (TP,))


def param_spec(path: tuple[str, ...], ndim: int) -> P:
    """The PartitionSpec of the parameter at `path` (e.g. ("layers", "mlp", "up_proj", "kernel"))."""
    *modules, leaf = path
    module = modules[-1]
    if module == "embed_tokens":
        return P(TP, None)  # [V, D]
    if module == "lm_head":
        return P(None, TP)  # [D, V]
    if module in COLUMN_PARALLEL and leaf in ("kernel", "bias"):
        return P(*[None] * (ndim - 1), TP)
    if module in ROW_PARALLEL and leaf == "kernel":
        return P(*[None] * (ndim - 2), TP, None)
    return P()


@dataclass(frozen=True)
class Layout:
    """Where each array of one model lives on `mesh`.

    `params`: a pytree of `NamedSharding` structured like the parameter state; `cache`: one per cache
    array; `replicated`: step inputs, sampling inputs and outputs.
    """

    mesh: Mesh
    params: Any
    cache: tuple[NamedSharding, ...]
    replicated: NamedSharding

    @classmethod
    def create(cls, model: LoadedModel, mesh: Mesh) -> Layout:
        def sharding(path, x):
            names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
            return NamedSharding(mesh, param_spec(names, x.ndim))

        params = jax.tree_util.tree_map_with_path(sharding, model.params)
        if model.config.attention == "mla":
            cache = (NamedSharding(mesh, P()),)
        else:
            cache = (NamedSharding(mesh, P(None, None, None, TP, None)),) * 2
        return cls(mesh, params, cache, NamedSharding(mesh, P()))

    def place_params(self, params):
        """The parameters, moved onto the mesh with their shardings."""
        return jax.device_put(params, self.params)

    def init_cache(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype):
        """A zeroed KV cache created directly in its sharded layout (no device holds it whole)."""
        return jax.jit(lambda: init_cache(cfg, num_blocks, block_size, dtype), out_shardings=self.cache)()

    def jit_shardings(self) -> dict[str, Any]:
        """`in_shardings`/`out_shardings` for the step `(params, cache, step, sampling) -> (sampled, cache)`.
        The cache's output sharding equals its input sharding, so donation reuses its buffers."""
        return dict(in_shardings=(self.params, self.cache, self.replicated, self.replicated),
                    out_shardings=(self.replicated, self.cache))


def sharded_attention(backend: AttentionBackend, mesh: Mesh) -> AttentionBackend:
    """`backend` run per device under `shard_map`: query heads split, GQA KV heads split (in the
    cache and, for a fresh prefill's attention, the new tokens' K and V), the MLA latent cache and
    the batch metadata replicated. Needs no collective."""
    heads, kv, rep = P(None, TP, None), P(None, None, None, TP, None), P()

    def per_device(fn, specs):
        def call(*args, sm_scale, decode_only=False):
            local = functools.partial(fn, sm_scale=sm_scale, decode_only=decode_only)
            in_specs = specs + (rep,) * (len(args) - len(specs))  # layer index and batch metadata
            return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(*args)

        return call

    def per_device_prefill(prefill: PrefillAttention) -> PrefillAttention:
        def attend(q, k, v, plan, *, sm_scale):  # q [T, H, D], k and v [T, Hkv, D]: heads split alike
            local = functools.partial(prefill.attend, sm_scale=sm_scale)
            return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, rep), out_specs=heads,
                                 check_vma=False)(q, k, v, plan)

        return PrefillAttention(prefill.plan, attend)

    return dataclasses.replace(
        backend,
        ragged_paged_attention=per_device(backend.ragged_paged_attention, (heads, kv, kv)),
        mla_ragged_paged_attention=per_device(backend.mla_ragged_paged_attention, (heads, heads, rep)),
        plan=None,  # the kernels' plans are per-device shapes: not passed through shard_map
        prefill=backend.prefill and per_device_prefill(backend.prefill),
    )
