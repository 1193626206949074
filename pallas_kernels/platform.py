"""Where the kernels run: GPU detection, the interpret-mode default, the SM count, and
lowering for CUDA on a host without a GPU.

Everything that depends on the JAX version or on the device lives here, so the kernels
and their tests stay version-agnostic:

- `on_gpu()` / `default_interpret()`: tests and scripts run kernels natively
  (`interpret=False`) on a GPU and in interpret mode elsewhere.
- `sm_count()`: the multiprocessor count split-K sizes its grid from (the device's own
  on a GPU; `DEFAULT_SM_COUNT`, an H100/H200 SXM, when lowering elsewhere).
- `lower_for_cuda(fn, *args)`: `jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))`.
  From JAX 0.11 the Triton lowering asks the device for its kind and, on a CPU host, fails
  with "No supported GPU devices found"; there the lowering runs under an abstract mesh
  whose `jax.sharding.AbstractDevice` names a GPU (the ahead-of-time target), which JAX
  0.10 accepts too (it falls back to compute capability 9.0 without a GPU).
"""

from __future__ import annotations

import contextlib

import jax

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
DEFAULT_SM_COUNT = 132  # H100 / H200 SXM
DEFAULT_DEVICE_KIND = "NVIDIA H200"


def on_gpu() -> bool:
    return jax.default_backend() in GPU_PLATFORMS


def default_interpret() -> bool:
    """Interpret mode unless a GPU is present."""
    return not on_gpu()


def sm_count() -> int:
    """Streaming multiprocessors of the default device (DEFAULT_SM_COUNT off a GPU)."""
    if not on_gpu():
        return DEFAULT_SM_COUNT
    return int(getattr(jax.devices()[0], "core_count", None) or DEFAULT_SM_COUNT)


def _abstract_gpu_mesh(device_kind: str):
    """A one-device abstract mesh on a GPU of `device_kind`, or None where this JAX has no
    abstract devices (then the lowering needs none)."""
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if abstract_device is None or not hasattr(jax.sharding, "use_abstract_mesh"):
        return None
    device = abstract_device(device_kind=device_kind, num_cores=None, platform="cuda")
    try:
        return jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
    except TypeError:  # an AbstractMesh without the abstract_device argument
        return None


def lower_for_cuda(fn, *args, device_kind: str = DEFAULT_DEVICE_KIND) -> jax.stages.Lowered:
    """Lower `jax.jit(fn)(*args)` for CUDA, on any host (see the module docstring).
    Nothing runs; GPU-only lowering errors (Triton's) surface here."""
    mesh = None if on_gpu() else _abstract_gpu_mesh(device_kind)
    scope = contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh)
    with scope:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
