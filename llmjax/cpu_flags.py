"""XLA:CPU settings the engine applies before JAX starts its CPU backend.

XLA reads `XLA_FLAGS` once, when the first backend initialises, and aborts the process on a
flag name it does not know. So `apply_cpu_flags()` must run before anything touches a JAX
device (the engine calls it first thing in `LLMEngine.from_config`), and it passes on only the
flags whose names appear in the installed jaxlib's binary; the others are skipped with a
warning. A flag the user already set in `XLA_FLAGS` is left as the user set it. Once the
backend is up, the call does nothing (returns None).

`CPU_XLA_FLAGS` is the measured choice (timed on the model's matmul shapes against jaxlib's
defaults; no results file keeps that run):
jaxlib 0.10 already sends bfloat16 x bfloat16 -> float32 dots to its YNNPACK fusion, the fastest
matmul path we found for the mixed-precision model; the oneDNN fusion
(`--xla_cpu_experimental_onednn_fusion_type=dot`) widens bfloat16 operands to float32 before
calling oneDNN (ONEDNN_VERBOSE shows `brg_matmul:avx512_core` with f32 tensors), so it does not
reach AMX, and it did not beat the default on the model's shapes.
`LLMJAX_NO_CPU_FLAGS=1` turns the whole mechanism off.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger(__name__)

# name -> value; the empty dict means the measured best was jaxlib's defaults.
CPU_XLA_FLAGS: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def _jaxlib_binaries() -> tuple[Path, ...]:
    import jaxlib

    root = Path(jaxlib.__file__).parent
    return tuple(sorted(root.glob("*.so"), key=lambda p: -p.stat().st_size))


def known_flag(name: str) -> bool:
    """Whether the installed jaxlib's binaries contain the flag name (a NUL-terminated string)."""
    needle = name.encode() + b"\0"
    for path in _jaxlib_binaries():
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(needle) >= 0:
                return True
    return False


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def apply_cpu_flags(flags: dict[str, str] | None = None) -> list[str] | None:
    """Add `flags` (default `CPU_XLA_FLAGS`) to `XLA_FLAGS` if JAX's backend has not started.

    Returns the flags added (as `--name=value`), or None when it was too late (or disabled).
    """
    flags = CPU_XLA_FLAGS if flags is None else flags
    if os.environ.get("LLMJAX_NO_CPU_FLAGS") or _backend_started():
        return None
    current = os.environ.get("XLA_FLAGS", "")
    added = []
    for name, value in flags.items():
        if f"--{name}" in current:
            continue  # the user's setting wins
        if not known_flag(name):
            log.warning("XLA flag --%s is not in this jaxlib; not set", name)
            continue
        added.append(f"--{name}={value}")
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
