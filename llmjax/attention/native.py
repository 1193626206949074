"""Build, load and register the native CPU attention kernel (`cpu_kernels/paged_decode.cc`).

The kernel is compiled on first use with the system C++ compiler (`$CXX`, else the first of
g++, c++, clang++ on PATH) into a cache directory (`$LLMJAX_NATIVE_CACHE`, default
`~/.cache/llmjax/native/`), one shared library per hash of the source, the flags, the compiler's
version, the CPU (model and feature flags: `-march=native`) and the jaxlib whose FFI headers it
includes. The library is written to a temporary file and renamed into place, so processes
compiling at once (test workers, server replicas) never load a partial file.

`available()` compiles (if needed), loads the library with ctypes and registers its handler as
the XLA FFI target `TARGET` on the CPU platform, once per process. It returns False, with one
logged warning saying why, when there is no compiler or compilation fails; callers then use the
pure-JAX path. Its result is cached; threads racing on the first call may each build (safe, see
above) and register (the same handler again: harmless).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

TARGET = "llmjax_paged_decode"  # the FFI target name (see paged_decode.cc for its operands)
SOURCE = Path(__file__).parent / "cpu_kernels" / "paged_decode.cc"
_SYMBOL = "LlmjaxPagedDecode"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17")
_COMPILERS = ("g++", "c++", "clang++")


class BuildError(RuntimeError):
    """No C++ compiler, or the kernel did not compile."""


def cache_dir() -> Path:
    return Path(os.environ.get("LLMJAX_NATIVE_CACHE") or Path.home() / ".cache" / "llmjax" / "native")


def find_compiler() -> str:
    """`$CXX`, else the first of `_COMPILERS` on PATH; BuildError when there is none."""
    for name in filter(None, (os.environ.get("CXX"), *_COMPILERS)):
        path = shutil.which(name)
        if path:
            return path
    raise BuildError(f"no C++ compiler found ($CXX or one of {', '.join(_COMPILERS)} on PATH)")


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in keys}))


def build(directory: Path | None = None) -> Path:
    """The compiled library for this source, compiler, CPU and jaxlib (compiling it if needed).

    Raises BuildError when there is no compiler or it fails (with the compiler's output)."""
    import jax
    import jaxlib

    compiler = find_compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{compiler} --version failed: {e}") from e
    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_identity(),
                                    jaxlib.__version__]).encode()).hexdigest()[:20]
    directory = directory or cache_dir()
    target = directory / f"paged_decode-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    print("compiling the native CPU attention kernel", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise BuildError(f"{compiler} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"compiling {SOURCE.name} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _register(path: Path) -> None:
    import jax

    library = ctypes.cdll.LoadLibrary(str(path))
    handler = getattr(library, _SYMBOL)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")


@functools.cache
def available() -> bool:
    """Whether the kernel is compiled, loaded and registered (see the module docstring)."""
    try:
        _register(build())
    except (BuildError, OSError, AttributeError) as e:
        log.warning("native CPU attention kernel unavailable, using the pure-JAX path: %s", e)
        return False
    return True
