"""Pick the attention implementation: "xla" | "cpu" | "pallas" | "pallas-interpret".

The model calls `backend.ragged_paged_attention(...)` and
`backend.mla_ragged_paged_attention(...)` with the signatures of `llmjax.attention.xla`
(from inside `lax.scan` over layers, inside `jax.jit`); `sm_scale` must be a Python float.

On CPU the default is "cpu" (every row through the native kernel, `llmjax.attention.cpu`)
when `native.available()` (a C++ compiler built it), else "xla". Elsewhere the default is
"xla", a GPU included, until `experiments/gpu_check.py` has passed on a GPU with the running
JAX version: the Pallas kernels are tested in interpret mode and lowered for CUDA on CPU, but
Triton's native compilation, its numerics and its speed are only known once that script has
run. Its passing JAX versions go in `PALLAS_VERIFIED_JAX`; on those, a GPU defaults to
"pallas". Asking for "pallas" by name always works on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax

from llmjax.config import ConfigError

BACKENDS = ("xla", "cpu", "pallas", "pallas-interpret")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
PALLAS_VERIFIED_JAX: tuple[str, ...] = ()  # JAX versions on which gpu_check.py passed on a GPU


@dataclass(frozen=True)
class PrefillAttention:
    """Attention for a fresh prefill step (every request starts at position 0, so its context is
    its own new tokens) on the new tokens' K/V, not the paged cache; GQA models only.
    `plan(step)`: per-step metadata, once outside the layer scan; `attend(q [T, H, D], k, v
    [T, Hkv, D], plan, *, sm_scale) -> [T, H, D]`, every row written."""

    plan: Callable[..., Any]
    attend: Callable[..., jax.Array]


@dataclass(frozen=True)
class AttentionBackend:
    """`plan(step, model_config, decode_only)`, when set, computes per-step metadata once,
    outside the layer scan; the model passes it to every layer's call as `plan=`.
    `reads_storage`: the functions take the cache arrays in their storage dtype (uint16 bits
    of a bfloat16 cache on CPU, see `cache_dtype`), as the pure-JAX and native paths do; False:
    as values (bfloat16), as the Pallas kernels need. The two differ only on CPU.
    `prefill`, when set, takes the steps that turn out fresh prefills at run time (the model
    chooses with `lax.cond`); the others go to `ragged_paged_attention`. `check_model`, when set:
    see `check`."""

    name: str
    ragged_paged_attention: Callable[..., jax.Array]
    mla_ragged_paged_attention: Callable[..., jax.Array]
    plan: Callable[..., Any] | None = None
    reads_storage: bool = True
    prefill: PrefillAttention | None = None
    check_model: Callable[[Any, int, Any], None] | None = None

    def check(self, model_config, block_size: int, kv_dtype) -> None:
        """Raise `ConfigError` when this backend cannot run a model of `model_config`'s shapes over
        KV blocks of `block_size` tokens holding `kv_dtype` values (the engine calls it when it is
        built, not at its first step)."""
        if self.check_model is not None:
            self.check_model(model_config, block_size, kv_dtype)


def _check_native(model_config, block_size: int, kv_dtype) -> None:
    """The "cpu" backend when named: every layer's attention in the native kernel, or refused (its
    fallback to xla is for the default choice only: a backend asked for is never swapped)."""
    from llmjax.attention.cache_dtype import storage_dtype
    from llmjax.attention.cpu import native_supported

    if model_config.attention == "mla":
        raise ConfigError("attention backend 'cpu': the native kernel has no MLA path; use 'xla' (or leave "
                          "--attention-backend unset: its default runs MLA on xla)")
    if not native_supported(model_config.head_dim, storage_dtype(kv_dtype, "cpu")):
        raise ConfigError(f"attention backend 'cpu': the native kernel needs a head dim that is a multiple of 32 "
                          f"and a float32 or bfloat16 KV cache, not head dim {model_config.head_dim} and "
                          f"{jax.numpy.dtype(kv_dtype).name}; use 'xla'")


def _check_pallas_shapes(model_config, block_size: int, kv_dtype) -> None:
    """The Pallas kernels tile KV blocks and head dimensions in powers of two of at least 16 (any
    KV cache dtype)."""
    from pallas_kernels.paged_attention import check_pow2

    if model_config.attention == "mla":
        dims = {"kv_lora_rank": model_config.kv_lora_rank, "qk_rope_head_dim": model_config.qk_rope_head_dim}
    else:
        dims = {"head_dim": model_config.head_dim}
    for what, n in {**dims, "block_size": block_size}.items():
        try:
            check_pow2(what, n)
        except ValueError as exc:
            remedy = "use another --block-size or " if what == "block_size" else "the model cannot run there: use "
            raise ConfigError(f"the Pallas attention backends: {exc}; {remedy}--attention-backend xla") from None


def _pallas_plan(step, model_config, decode_only: bool):
    """The Pallas kernels' tile metadata for one step (see their `plan_step`)."""
    from pallas_kernels.mla_attention import plan_step as mla_plan_step
    from pallas_kernels.ragged_paged_attention import plan_step as gqa_plan_step

    num_tokens = step.token_ids.shape[0]
    if model_config.attention == "mla":
        return mla_plan_step(step.query_start_loc, step.seq_lens, num_tokens,
                             model_config.num_heads, decode_only=decode_only)
    return gqa_plan_step(step.query_start_loc, step.seq_lens, num_tokens, model_config.num_heads,
                         model_config.num_kv_heads, decode_only=decode_only)


def default_backend_name(platform: str | None = None, jax_version: str | None = None) -> str:
    """"cpu" on CPU when the native kernel is available; "pallas" on a GPU whose JAX version
    is in PALLAS_VERIFIED_JAX; "xla" otherwise. Builds the native kernel on first use on CPU."""
    platform = platform or jax.default_backend()
    jax_version = jax_version or jax.__version__
    if platform == "cpu":
        from llmjax.attention import native
        return "cpu" if native.available() else "xla"
    verified = jax_version in PALLAS_VERIFIED_JAX
    return "pallas" if platform in _GPU_PLATFORMS and verified else "xla"


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """The backend called `name` (None: the platform's default). Raises `ConfigError` (a
    ValueError) for an unknown name, for "cpu" off the CPU platform or without its native kernel
    (the logged warning says why), or for "pallas" without a GPU (use "pallas-interpret" there).
    "cpu" runs MLA, and attention the native kernel cannot run, on xla when it is the default; when
    named, its `check` refuses such a model."""
    named = name is not None
    name = name or default_backend_name()
    if name == "xla":
        from llmjax.attention import xla
        return AttentionBackend(name, xla.ragged_paged_attention, xla.mla_ragged_paged_attention)
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "cpu":
        from llmjax.attention import cpu, native, xla
        if jax.default_backend() != "cpu":
            raise ConfigError(f"attention backend 'cpu' needs the CPU platform (platform is "
                             f"{jax.default_backend()!r})")
        if not native.available():
            raise ConfigError("attention backend 'cpu': the native kernel is unavailable "
                             "(see the logged warning); use 'xla'")
        return AttentionBackend(name, cpu.ragged_paged_attention, xla.mla_ragged_paged_attention,
                                check_model=_check_native if named else None)
    if name == "pallas" and jax.default_backend() not in _GPU_PLATFORMS:
        raise ConfigError(f"attention backend 'pallas' needs a GPU (platform is "
                         f"{jax.default_backend()!r}); use 'pallas-interpret' or 'xla'")
    import pallas_kernels
    interpret = name == "pallas-interpret"

    def flash_plan(step):
        return pallas_kernels.prefill_segment_starts(step.query_start_loc, step.token_ids.shape[0])

    def flash(q, k, v, segment_starts, *, sm_scale):
        return pallas_kernels.flash_prefill(q, k, v, segment_starts, sm_scale=sm_scale, interpret=interpret)

    return AttentionBackend(
        name,
        functools.partial(pallas_kernels.ragged_paged_attention, interpret=interpret),
        functools.partial(pallas_kernels.mla_ragged_paged_attention, interpret=interpret),
        plan=_pallas_plan, reads_storage=False, prefill=PrefillAttention(flash_plan, flash),
        check_model=_check_pallas_shapes)
