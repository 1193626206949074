"""Build, load and register native CPU kernels (C++ sources with XLA FFI handlers).

A kernel is a `NativeKernel`: one C++17 source, its compiler flags, the FFI targets it
registers (target name -> handler symbol) and optionally an init symbol (`int f(void)`, run once
after loading; non-zero means the kernel cannot run on this machine). The attention kernel
(`cpu_kernels/paged_decode.cc`) is `PAGED_DECODE`; this module's `TARGET`, `SOURCE`, `FLAGS`,
`build()` and `available()` are about it.

A source is compiled on first use with the system C++ compiler (`$CXX`, else the first of
g++, c++, clang++ on PATH) into a cache directory (`$LLMJAX_NATIVE_CACHE`, default
`~/.cache/llmjax/native/`), one shared library per hash of the source, the flags, the compiler's
version, the CPU (model and feature flags: `-march=native`), the shared headers (`INCLUDE_DIR`)
and the jaxlib whose FFI headers it includes. The library is written to a temporary file and renamed into place, so processes
compiling at once (test workers, server replicas) never load a partial file.

`load(kernel)` compiles (if needed), loads the library with ctypes, runs its init symbol and
registers its handlers as XLA FFI targets on the CPU platform. It returns False, with one logged
warning saying why, when there is no compiler, compilation fails or the init symbol refuses;
callers then use their pure-JAX path. Callers cache its result (`available()` does, once per
process); threads racing on the first call may each build (safe, see above) and register (the
same handler again: harmless).
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
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17")
# Headers shared by the kernels (`#include "work_items.h"`); part of every build's hash.
INCLUDE_DIR = Path(__file__).parents[1] / "cpu_include"
_COMPILERS = ("g++", "c++", "clang++")


class BuildError(RuntimeError):
    """No C++ compiler, or the kernel did not compile, load or initialise."""


@dataclass(frozen=True)
class NativeKernel:
    """One C++ source and how to build and register it.

    `targets`: (FFI target name, handler symbol) pairs; `flags`: the full compiler flags;
    `init`: the symbol of an `int init(void)` run once after loading (0: ready; otherwise the
    kernel is unavailable, `init_errors` giving the reason for each code); `label` names the
    kernel in messages, `fallback` what callers use without it."""

    source: Path
    targets: tuple[tuple[str, str], ...]
    flags: tuple[str, ...] = FLAGS
    init: str | None = None
    init_errors: tuple[tuple[int, str], ...] = ()
    label: str = "native CPU kernel"
    fallback: str = "the pure-JAX path"


TARGET = "llmjax_paged_decode"  # the FFI target name (see paged_decode.cc for its operands)
SOURCE = Path(__file__).parent / "cpu_kernels" / "paged_decode.cc"
PAGED_DECODE = NativeKernel(SOURCE, ((TARGET, "LlmjaxPagedDecode"),),
                            label="native CPU attention kernel")


def cache_dir() -> Path:
    return Path(os.environ.get("LLMJAX_NATIVE_CACHE") or Path.home() / ".cache" / "llmjax" / "native")


def find_compiler() -> str:
    """`$CXX` (one executable, a path or a name on PATH), else the first of `_COMPILERS` on PATH;
    BuildError when `$CXX` names no executable or there is no compiler."""
    chosen = os.environ.get("CXX")
    if chosen:
        path = shutil.which(chosen)
        if path is None:
            raise BuildError(f"$CXX ({chosen!r}) is no executable on PATH (it names one compiler, without arguments)")
        return path
    for name in _COMPILERS:
        path = shutil.which(name)
        if path:
            return path
    raise BuildError(f"no C++ compiler found ($CXX or one of {', '.join(_COMPILERS)} on PATH)")


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature names as /proc/cpuinfo lists them (x86 `flags`, Arm `Features`); empty
    where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(name for line in lines if line.split(":")[0].strip() in ("flags", "Features")
                     for name in line.split(":", 1)[1].split())


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in keys}))


def build_library(kernel: NativeKernel, directory: Path | None = None) -> Path:
    """The compiled library for `kernel`'s source and flags, this compiler, CPU and jaxlib
    (compiling it if needed). Raises BuildError when there is no compiler or it fails (with the
    compiler's output)."""
    import jax
    import jaxlib

    compiler = find_compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{compiler} --version failed: {e}") from e
    include = jax.ffi.include_dir()
    source = kernel.source
    headers = [h.read_text() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(kernel.flags), version,
                                    _cpu_identity(), jaxlib.__version__]).encode()).hexdigest()[:20]
    directory = directory or cache_dir()
    target = directory / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    print(f"compiling the {kernel.label}", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *kernel.flags, f"-I{INCLUDE_DIR}", f"-I{include}", str(source), "-o", tmp],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise BuildError(f"{compiler} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(tmp, "rb") as written:  # on disk before it takes the cached name
            os.fsync(written.fileno())
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"compiling {source.name} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build(directory: Path | None = None) -> Path:
    """The compiled attention kernel library (`build_library(PAGED_DECODE, directory)`)."""
    return build_library(PAGED_DECODE, directory)


@functools.cache
def _register(kernel: NativeKernel, path: Path) -> None:
    import jax

    library = ctypes.cdll.LoadLibrary(str(path))
    if kernel.init is not None:
        init = getattr(library, kernel.init)
        init.restype = ctypes.c_int
        code = init()
        if code != 0:
            reason = dict(kernel.init_errors).get(code, f"code {code}")
            raise BuildError(f"{kernel.init} refused: {reason}")
    for target, symbol in kernel.targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")


def load(kernel: NativeKernel) -> bool:
    """Whether `kernel` is compiled, loaded, initialised and registered (see the module docstring).
    A cached library that does not load (a file cut short by a crash or a full disk) is deleted and
    built once more."""
    try:
        path = build_library(kernel)
        try:
            _register(kernel, path)
        except OSError:
            path.unlink(missing_ok=True)
            _register(kernel, build_library(kernel))
    except (BuildError, OSError, AttributeError) as e:
        log.warning("%s unavailable, using %s: %s", kernel.label, kernel.fallback, e)
        return False
    return True


@functools.cache
def available() -> bool:
    """Whether the attention kernel is compiled, loaded and registered (see the module docstring)."""
    return load(PAGED_DECODE)
