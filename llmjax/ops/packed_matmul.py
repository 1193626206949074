"""bfloat16 matmuls with float32 accumulation by a native CPU kernel (XLA FFI), on weights packed
once at load time. Two kernels read the same packed layout:

- `AMX` (`cpu_kernels/amx_matmul.cc`): Intel AMX tiles (Sapphire Rapids and later);
- `AVX512_BF16` (`cpu_kernels/avx512_bf16_matmul.cc`): AVX512-BF16's VDPBF16PS (AMD Zen 4 and
  later, Intel Cooper Lake and later).

On SmolLM2's matmul mix at 64 rows (a decode step's), XLA:CPU's bfloat16 dots (jaxlib 0.10's
YNNPACK fusions) reached about two thirds of either kernel's GFLOP/s: the AMX kernel's on an Intel
Xeon, the AVX512-BF16 kernel's on an AMD EPYC (`experiments/packed_matmul.py`; docs/architecture.md
has the numbers).

- `pack_weight(w [..., K, N] bfloat16) -> [..., ceil(N/32), ceil(K/32), 2, 16, 32] bfloat16`
  (numpy): W zero-padded to multiples of 32 and laid out as AMX B tiles, whose rows are also
  VDPBF16PS's operands (the layout is described in the C++ sources); leading axes (stacked
  layers) are kept.
- `packed_matmul(x [..., K], packed, n=N, layer=None, kernel=None) -> float32 [..., N]`: `packed`
  one packed weight, or (with `layer`, an int32 scalar that may be traced) a stack `[L, ...]` of
  them of which the kernel reads weight `layer` in place (a layer scan then copies no weights);
  bfloat16 values or their uint16 bits. x is rounded to bfloat16 (as `x.astype(jnp.bfloat16)`;
  XLA fuses the rounding into x's producer), every product is exact and summed in float32:
  `jnp.dot(x.astype(bf16), w, preferred_element_type=float32)` up to summation order. Runs on
  the calling thread and XLA's intra-op pool. CPU platform only. `kernel`: the one to run
  (default `selected()`).
- `selected()`: the first kernel this CPU has the features for (AMX, then AVX512-BF16) whose
  source compiled and that initialised (AMX also needs Linux's tile permission), or None
  (one warning when a build or the permission failed). Cached.
- `enabled(dtype)`: whether a model of `dtype` should run its linear layers here: bfloat16,
  the CPU backend with one device (several CPU devices mean tensor parallelism, whose sharding
  rules know only plain kernels), a `selected()` kernel, and `LLMJAX_NO_PACKED_MATMUL` not set
  to 1, true, yes or on (set it to compare with XLA's bfloat16 dots).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.attention import native

DISABLE_ENV = "LLMJAX_NO_PACKED_MATMUL"
_SOURCES = Path(__file__).parent / "cpu_kernels"


@dataclass(frozen=True)
class PackedKernel:
    """A native kernel of `packed_matmul`: its build, and the /proc/cpuinfo features it needs."""

    name: str
    build: native.NativeKernel
    cpu_features: tuple[str, ...]

    @property
    def target(self) -> str:
        return self.build.targets[0][0]

    def cpu_supports(self) -> bool:
        return native.cpu_features().issuperset(self.cpu_features)


AMX = PackedKernel("amx", native.NativeKernel(
    _SOURCES / "amx_matmul.cc",
    (("llmjax_amx_matmul", "LlmjaxAmxMatmul"),),
    flags=(*native.FLAGS, "-mamx-tile", "-mamx-bf16", "-mavx512bf16"),
    init="LlmjaxAmxInit",
    init_errors=((1, "CPUID reports no AMX-TILE/AMX-BF16"),
                 (2, "Linux refused the AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM)")),
    label="AMX bfloat16 matmul kernel",
    fallback="the next bfloat16 matmul kernel, else XLA's bfloat16 dot",
), ("amx_tile", "amx_bf16", "avx512_bf16"))
AVX512_BF16 = PackedKernel("avx512_bf16", native.NativeKernel(
    _SOURCES / "avx512_bf16_matmul.cc",
    (("llmjax_avx512_bf16_matmul", "LlmjaxAvx512Bf16Matmul"),),
    flags=(*native.FLAGS, "-mavx512f", "-mavx512bf16"),
    label="AVX512-BF16 bfloat16 matmul kernel",
    fallback="XLA's bfloat16 dot",
), ("avx512f", "avx512_bf16"))
KERNELS = (AMX, AVX512_BF16)  # in order of preference
PACKED_NDIM = 5  # one packed weight: [ceil(N/32), ceil(K/32), 2, 16, 32]
TILE_K = 32  # K rows per B tile (16 interleaved pairs)
BLOCK_N = 32  # N columns per packed block (two 16-column tiles)


@functools.cache
def loads(kernel: PackedKernel) -> bool:
    """Whether `kernel` compiled, initialised and registered (once per process; a failure is logged)."""
    return native.load(kernel.build)


@functools.cache
def selected() -> PackedKernel | None:
    """The kernel `packed_matmul` runs here (see the module docstring), or None."""
    return next((k for k in KERNELS if k.cpu_supports() and loads(k)), None)


def enabled(dtype) -> bool:
    """Whether a model with parameters of `dtype` runs its linear layers on a packed kernel here."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"
            and jax.device_count() == 1 and not disabled_by_env() and selected() is not None)


def disabled_by_env() -> bool:
    """Whether `LLMJAX_NO_PACKED_MATMUL` turns the packed kernels off (1, true, yes or on; 0, false,
    no, off or empty leave them on)."""
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise ValueError(f"{DISABLE_ENV} is 1 / true / yes / on or 0 / false / no / off, got {value!r}")
    return value in ("1", "true", "yes", "on")


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


def packed_matmul(x: jax.Array, packed: jax.Array, n: int, layer: jax.Array | int | None = None,
                  kernel: PackedKernel | None = None) -> jax.Array:
    """`x [..., K] @ W [K, n]` in float32 from bfloat16-rounded x, W packed by `pack_weight`
    (a stack of packed weights and the `layer` to read; see the module docstring), on `kernel`
    (default: `selected()`). CPU only; RuntimeError when no kernel is available, or `kernel` needs
    CPU features this CPU lacks or did not load."""
    kernel = kernel or selected()
    if kernel is None or not kernel.cpu_supports() or not loads(kernel):
        raise RuntimeError("no packed bfloat16 matmul kernel is available here (see the logged warning)")
    *lead, k = x.shape
    stack = packed[None] if layer is None else packed
    if (stack.ndim != PACKED_NDIM + 1 or tuple(stack.shape[1:]) != packed_shape(k, n)
            or stack.dtype not in (jnp.bfloat16, jnp.uint16)):
        raise ValueError(f"packed weight {packed.dtype}{list(packed.shape)} does not pack a "
                         f"bfloat16 [{k}, {n}] weight (expected {list(packed_shape(k, n))}"
                         f"{' after the layer axis' if layer is not None else ''})")
    m = int(np.prod(lead, dtype=np.int64))
    call = jax.ffi.ffi_call(kernel.target, jax.ShapeDtypeStruct((m, n), jnp.float32))
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    return call(x.reshape(m, k).astype(jnp.bfloat16), stack, index).reshape(*lead, n)
