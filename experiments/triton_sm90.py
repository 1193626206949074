"""Registers, spills and shared memory of every Pallas kernel on sm_90 (H100/H200), read on any host.

Each kernel is lowered for CUDA on this host (`pallas_kernels.platform.lower_for_cuda`), which
embeds the Triton IR (TTIR) of each Pallas call in the StableHLO, with its `num_warps` and
`num_stages`. The IR is printed as text with jaxlib's Triton dialect, then compiled for sm_90 by
the `triton` package (`pip install triton`: its compiler and `ptxas`, no GPU needed) in a child
process, and `cuobjdump --dump-resource-usage` reads the cubin: registers per thread, local
memory (spills) and static shared memory; Triton's metadata gives the dynamic shared memory
(the pipelined tiles); from them, the blocks an SM can hold at once (registers: 64 Ki per SM,
allocated per warp in units of 256; shared memory: 228 KiB per SM). Rows cover the engine's shapes (head dims 64 and 128, GQA groups 3 and
4, MLA's 512 + 64) at the default knobs and at the knobs `kernel_bench.py` sweeps.

Caveat: XLA compiles the same TTIR with the Triton it was built with, through its own pass
pipeline; the `triton` package here is another version, so the counts are an estimate of what
the GPU will build (the knobs' trends carry over; a kernel near 255 registers or with spills
wants other knobs). The versions are printed with the results.

    python experiments/triton_sm90.py [--quick]      (about 1-3 minutes; needs `pip install triton`)
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmjax.provenance import results_dir, write_results  # noqa: E402

# Run in a child process with the `triton` package: compile one TTIR file for sm_90 and report
# (registers, local bytes, static shared bytes, dynamic shared bytes) as JSON on stdout.
COMPILE_CHILD = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as compile_ir
path, num_warps, num_stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kernel = compile_ir(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
os.unlink(f.name)
field = lambda name: int(re.search(name + r":(\d+)", usage).group(1))
print(json.dumps(dict(registers=field("REG"), local_bytes=field("LOCAL"), static_shared=field("SHARED"),
                      dynamic_shared=int(kernel.metadata.shared), triton=triton.__version__)))
"""


def triton_calls(lowered) -> list[dict]:
    """The Triton custom calls of a lowered function: name, TTIR text, num_warps, num_stages, grid."""
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as triton_dialect

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call" and \
                            "triton" in ir.StringAttr(inner.operation.attributes["call_target_name"]).value:
                        calls.append(ir.DictAttr(inner.operation.attributes["mhlo.backend_config"]))
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    out = []
    for config in calls:
        with ir.Context() as ctx:
            triton_dialect.register_dialect(ctx)
            text = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
        get = lambda key: ir.IntegerAttr(config[key]).value  # noqa: E731
        out.append(dict(name=ir.StringAttr(config["name"]).value, ttir=text, num_warps=get("num_warps"),
                        num_stages=get("num_stages"), grid=(get("grid_x"), get("grid_y"), get("grid_z"))))
    return out


def kernel_cases(quick: bool):
    """(row label, function, arguments) at the engine's shapes and the benchmark's knobs."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import (flash_attention, flash_prefill, mla_ragged_paged_attention, paged_attention,
                                prefill_segment_starts, ragged_paged_attention)
    from tests.attention_cases import make_batch

    bf16 = jnp.bfloat16
    rng = np.random.default_rng(0)
    cases = []
    for dim in (64, 128):
        q, k = jnp.zeros((1, 2048, 8, dim), bf16), jnp.zeros((1, 2048, 2, dim), bf16)
        knobs = [{}] + ([] if quick else [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
                                          for bq, bk, w, st in ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                                                                (128, 64, 4, 4))])
        for kn in knobs:
            cases.append((f"flash d{dim}", kn, functools.partial(flash_attention, **kn), (q, k, k)))
        qf, kf = jnp.zeros((2048, 8, dim), bf16), jnp.zeros((2048, 2, dim), bf16)
        segments = prefill_segment_starts(jnp.asarray([0, 512, 2048], jnp.int32), 2048)
        cases.append((f"flash prefill (varlen) d{dim}", {}, functools.partial(flash_prefill, sm_scale=dim ** -0.5),
                      (qf, kf, kf, segments)))
    for dim, kv_heads, group in ((64, 3, 3), (128, 8, 4)):
        for kind in ("mixed", "decode"):
            b = make_batch(rng, kind, block_size=16, max_blocks=64)
            cache = jnp.zeros((2, b.num_blocks, 16, kv_heads, dim), bf16)
            q = jnp.zeros((b.num_tokens, kv_heads * group, dim), bf16)
            meta = (jnp.int32(0), *b.args())
            decode_only = kind == "decode"
            knobs = [{}] + ([] if quick else [dict(pages_per_step=p) for p in (1, 2, 8)]
                            + ([dict(tile_rows=128)] if not decode_only else []))
            for kn in knobs:
                cases.append((f"ragged {kind}{' decode_only' if decode_only else ''} d{dim} G{group}", kn,
                              functools.partial(ragged_paged_attention, sm_scale=dim ** -0.5, decode_only=decode_only,
                                                **kn), (q, cache, cache, *meta)))
            if decode_only:
                qsl, seq_lens, tables, _ = b.args()
                cases.append((f"paged decode d{dim} G{group}", {}, functools.partial(paged_attention, sm_scale=0.1),
                              (q[:seq_lens.shape[0]], cache, cache, jnp.int32(0), seq_lens, tables)))
    for kind in ("mixed", "decode"):
        b = make_batch(rng, kind, block_size=16, max_blocks=64)
        lat = jnp.zeros((2, b.num_blocks, 16, 576), bf16)
        ql, qr = jnp.zeros((b.num_tokens, 16, 512), bf16), jnp.zeros((b.num_tokens, 16, 64), bf16)
        cases.append((f"mla {kind} r512+64 h16", {}, functools.partial(
            mla_ragged_paged_attention, sm_scale=0.1, decode_only=kind == "decode"), (ql, qr, lat, jnp.int32(0),
                                                                                   *b.args())))
    return cases


SM90_REGISTERS = 65536  # per SM
SM90_SHARED = 228 * 1024  # per SM (at most 227 KiB for one block); 1 KiB of it reserved per block
MAX_BLOCKS_PER_SM = 32


def blocks_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Resident blocks per SM allowed by registers (allocated per warp in units of 256) and
    shared memory: the occupancy a launch of this kernel can reach."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90_REGISTERS // (per_warp * num_warps)
    by_shared = SM90_SHARED // (shared_bytes + 1024)
    return min(by_registers, by_shared, MAX_BLOCKS_PER_SM)


def compile_sm90(call: dict) -> dict:
    """Resource usage of one Triton call compiled for sm_90 in a child process (see COMPILE_CHILD)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
        f.write(call["ttir"])
    try:
        done = subprocess.run([sys.executable, "-c", COMPILE_CHILD, f.name, str(call["num_warps"]),
                               str(call["num_stages"])], capture_output=True, text=True, timeout=300)
    finally:
        Path(f.name).unlink()
    if done.returncode != 0:
        return dict(error=(done.stderr.strip().splitlines() or ["failed"])[-1][:200])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="default knobs only; written to build/results-quick/")
    args = ap.parse_args()
    try:
        import importlib.metadata
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("this needs the `triton` package (pip install triton): its compiler and ptxas")
    import jax
    from tqdm import tqdm

    from pallas_kernels.platform import lower_for_cuda

    rows = []
    cases = kernel_cases(args.quick)
    for label, knobs, fn, fn_args in tqdm(cases, desc="lower and compile for sm_90", unit="kernel"):
        for call in triton_calls(lower_for_cuda(fn, *fn_args)):
            usage = compile_sm90(call)
            rows.append(dict(kernel=label, knobs=" ".join(f"{k}={v}" for k, v in knobs.items()) or "default",
                             call=call["name"], num_warps=call["num_warps"], num_stages=call["num_stages"],
                             grid=list(call["grid"]), **usage))
    for r in rows:
        if "registers" in r:
            r["blocks_per_sm"] = blocks_per_sm(r["registers"], r["num_warps"], r["static_shared"] + r["dynamic_shared"])
    head = ("| kernel | knobs | Triton call | warps | stages | registers / thread | spills (local bytes) "
            "| shared KiB (static + dynamic) | blocks / SM | error |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        shared = f"{(r['static_shared'] + r['dynamic_shared']) / 1024:.1f}" if "registers" in r else "-"
        lines.append(f"| {r['kernel']} | {r['knobs']} | {r['call']} | {r['num_warps']} | {r['num_stages']} | "
                     f"{r.get('registers', '-')} | {r.get('local_bytes', '-')} | {shared} | "
                     f"{r.get('blocks_per_sm', '-')} | {r.get('error', '')} |")
    ok = [r for r in rows if "registers" in r]
    spilling = [r for r in ok if r["local_bytes"] > 0]
    at_limit = [r for r in ok if r["registers"] >= 240]
    findings = [
        f"{len(ok)} of {len(rows)} Triton calls compiled for sm_90; {len(spilling)} spill "
        f"({', '.join(sorted({r['kernel'] + ' ' + r['knobs'] for r in spilling})) or 'none'}); "
        f"{len(at_limit)} use 240 or more of the 255 registers a thread can have "
        f"({', '.join(sorted({r['kernel'] + ' ' + r['knobs'] for r in at_limit})) or 'none'})."]
    body = "\n".join([
        "`python experiments/triton_sm90.py" + (" --quick" if args.quick else "") + "`", "",
        f"Each Pallas kernel lowered for CUDA by jax {jax.__version__} on this host; its Triton IR compiled for "
        f"sm_90 by triton {triton_version} (ptxas), resource usage read from the cubin with cuobjdump. An "
        "estimate of what XLA's own Triton builds on the GPU (see the script's docstring).", "",
        *lines, "", *findings])
    out = results_dir(args.quick)
    write_results(out, "triton_sm90", "# Pallas kernels on sm_90: registers, spills, shared memory\n\n" + body,
                  {"rows": rows, "triton": triton_version, "args": vars(args),
                   "summary": {"calls": len(rows), "compiled": len(ok), "spilling": len(spilling),
                               "near_register_limit": len(at_limit)}})
    print(body)


if __name__ == "__main__":
    main()
