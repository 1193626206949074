"""Pick the attention implementation: "xla" | "pallas" | "pallas-interpret".

The model calls `backend.ragged_paged_attention(...)` and
`backend.mla_ragged_paged_attention(...)` with the signatures of `llmjax.attention.xla`
(from inside `lax.scan` over layers, inside `jax.jit`); `sm_scale` must be a Python float.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax

BACKENDS = ("xla", "pallas", "pallas-interpret")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    ragged_paged_attention: Callable[..., jax.Array]
    mla_ragged_paged_attention: Callable[..., jax.Array]


def default_backend_name(platform: str | None = None) -> str:
    """"pallas" on a GPU, "xla" elsewhere."""
    platform = platform or jax.default_backend()
    return "pallas" if platform in _GPU_PLATFORMS else "xla"


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """The backend called `name` (None: the platform's default). Raises ValueError for an
    unknown name, or for "pallas" without a GPU (use "pallas-interpret" there)."""
    name = name or default_backend_name()
    if name == "xla":
        from llmjax.attention import xla
        return AttentionBackend(name, xla.ragged_paged_attention, xla.mla_ragged_paged_attention)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "pallas" and jax.default_backend() not in _GPU_PLATFORMS:
        raise ValueError(f"attention backend 'pallas' needs a GPU (platform is "
                         f"{jax.default_backend()!r}); use 'pallas-interpret' or 'xla'")
    import pallas_kernels
    interpret = name == "pallas-interpret"
    return AttentionBackend(
        name,
        functools.partial(pallas_kernels.ragged_paged_attention, interpret=interpret),
        functools.partial(pallas_kernels.mla_ragged_paged_attention, interpret=interpret))
