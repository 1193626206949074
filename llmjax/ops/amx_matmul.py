"""bfloat16 matmuls with float32 accumulation on Intel AMX (`cpu_kernels/amx_matmul.cc`).

XLA:CPU (jaxlib 0.10) does not use AMX for bfloat16 dots; this kernel does, for weights packed
once at load time:

- `pack_weight(w [..., K, N] bfloat16) -> [..., ceil(N/32), ceil(K/32), 2, 16, 32] bfloat16`
  (numpy): W zero-padded to multiples of 32 and laid out as AMX B tiles (the layout is
  described in the C++ source); leading axes (stacked layers) are kept.
- `amx_matmul(x [..., K], packed, n=N, layer=None) -> float32 [..., N]`: `packed` one packed
  weight, or (with `layer`, an int32 scalar that may be traced) a stack `[L, ...]` of them of
  which the kernel reads weight `layer` in place (a layer scan then copies no weights); bfloat16
  values or their uint16 bits. x is rounded to bfloat16 (as `x.astype(jnp.bfloat16)`; XLA
  fuses the rounding into x's producer), every product is exact and summed in float32:
  `jnp.dot(x.astype(bf16), w, preferred_element_type=float32)` up to summation order. Runs
  on the calling thread and XLA's intra-op pool. CPU platform only.
- `available()`: whether the kernel can run here: the CPU lists amx_tile, amx_bf16 and
  avx512_bf16, the source compiled (`llmjax.attention.native`, with -mamx-tile -mamx-bf16
  -mavx512bf16) and Linux granted the AMX tile permission. Cached; False (one warning when a
  build or the permission failed) means callers use `jnp.dot`.
- `enabled(dtype)`: whether a model of `dtype` should run its linear layers here: bfloat16,
  the CPU backend with one device (several CPU devices mean tensor parallelism, whose sharding
  rules know only plain kernels), `available()`, and `LLMJAX_NO_AMX` unset (set it to 1 to
  compare with XLA's bfloat16 dots).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.attention import native

TARGET = "llmjax_amx_matmul"
DISABLE_ENV = "LLMJAX_NO_AMX"
CPU_FEATURES = ("amx_tile", "amx_bf16", "avx512_bf16")  # /proc/cpuinfo names
KERNEL = native.NativeKernel(
    Path(__file__).parent / "cpu_kernels" / "amx_matmul.cc",
    ((TARGET, "LlmjaxAmxMatmul"),),
    flags=(*native.FLAGS, "-mamx-tile", "-mamx-bf16", "-mavx512bf16"),
    init="LlmjaxAmxInit",
    init_errors=((1, "CPUID reports no AMX-TILE/AMX-BF16"),
                 (2, "Linux refused the AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM)")),
    label="AMX bfloat16 matmul kernel",
    fallback="XLA's bfloat16 dot",
)
PACKED_NDIM = 5  # one packed weight: [ceil(N/32), ceil(K/32), 2, 16, 32]
TILE_K = 32  # K rows per B tile (16 interleaved pairs)
BLOCK_N = 32  # N columns per packed block (two 16-column tiles)


def cpu_has_amx() -> bool:
    """Whether /proc/cpuinfo lists every feature the kernel is compiled for."""
    return native.cpu_features().issuperset(CPU_FEATURES)


@functools.cache
def available() -> bool:
    """Whether the kernel is compiled, permitted and registered (see the module docstring)."""
    return cpu_has_amx() and native.load(KERNEL)


def enabled(dtype) -> bool:
    """Whether a model with parameters of `dtype` runs its linear layers on AMX here."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"
            and jax.device_count() == 1 and not os.environ.get(DISABLE_ENV) and available())


def packed_shape(k: int, n: int) -> tuple[int, ...]:
    """The packed shape of one [k, n] weight."""
    return (-(-n // BLOCK_N), -(-k // TILE_K), 2, 16, TILE_K)


def pack_weight(w) -> np.ndarray:
    """`w [..., K, N]` (bfloat16 values, or their uint16 bits) -> bfloat16
    `[..., ceil(N/32), ceil(K/32), 2, 16, 32]`: element [nb, kb, t, r, 2c + p] is
    W[32 kb + 2 r + p, 32 nb + 16 t + c], 0 past K or N."""
    w = np.asarray(w)
    if w.dtype == np.uint16:
        w = w.view(jnp.bfloat16)
    if w.dtype != jnp.bfloat16:
        raise TypeError(f"pack_weight takes bfloat16 weights, got {w.dtype}")
    *lead, k, n = w.shape
    nb, kb = packed_shape(k, n)[:2]
    padded = np.zeros((*lead, kb * TILE_K, nb * BLOCK_N), w.dtype)
    padded[..., :k, :n] = w
    # axes of padded: (..., kb, r, p, nb, t, c) -> (..., nb, kb, t, r, c, p)
    tiles = padded.reshape(*lead, kb, 16, 2, nb, 2, 16)
    d = len(lead)
    order = (*range(d), d + 3, d, d + 4, d + 1, d + 5, d + 2)
    return np.ascontiguousarray(tiles.transpose(order)).reshape(*lead, *packed_shape(k, n))


def amx_matmul(x: jax.Array, packed: jax.Array, n: int,
               layer: jax.Array | int | None = None) -> jax.Array:
    """`x [..., K] @ W [K, n]` in float32 from bfloat16-rounded x, W packed by `pack_weight`
    (a stack of packed weights and the `layer` to read; see the module docstring). CPU only;
    RuntimeError when `available()` is False."""
    if not available():
        raise RuntimeError("the AMX matmul kernel is unavailable (see the logged warning)")
    *lead, k = x.shape
    stack = packed[None] if layer is None else packed
    if (stack.ndim != PACKED_NDIM + 1 or tuple(stack.shape[1:]) != packed_shape(k, n)
            or stack.dtype not in (jnp.bfloat16, jnp.uint16)):
        raise ValueError(f"packed weight {packed.dtype}{list(packed.shape)} does not pack a "
                         f"bfloat16 [{k}, {n}] weight (expected {list(packed_shape(k, n))}"
                         f"{' after the layer axis' if layer is not None else ''})")
    m = int(np.prod(lead, dtype=np.int64))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    return call(x.reshape(m, k).astype(jnp.bfloat16), stack, index).reshape(*lead, n)
