"""The native CPU attention kernel's decode rows (`llmjax/attention/cpu_kernels/paged_decode.cc`)
built three ways, side by side: the engine's build (each row prefetches its next chunk into L2,
and over its last chunk the first chunk of its thread's next row); without that prefetch of the
next row (`-DLLMJAX_PREFETCH_FOLLOWING=0`); with the prefetches into L1
(`-DLLMJAX_PREFETCH_LOCALITY=3`).

Each case is a decode-only step of SmolLM2-135M's attention geometry (from the embedded GGUF's
metadata: layers, query and KV heads, head dim): `--rows` requests of one context length, their
blocks (16 tokens) shuffled across a cache of exactly the blocks they use, all layers called in a
`lax.scan` as the model does. The builds alternate over `--rounds` rounds (each round the best
of `--repeats` calls per build); the table gives medians of milliseconds per step, the KV bytes
read per second (and as a share of the machine's read bandwidth, measured in every round, as
`offline_throughput.py` does it: torch summing 1 GiB on all cores; on a shared machine it moves
from run to run), and each other build's time over the engine build's (median and range of the
per-round ratios). The KV cache is float32 or
bfloat16 (`--dtypes`).

Writes results/<--out-name>.md, .json and .png (default `decode_attention`).

    python experiments/decode_attention.py [--contexts 128,400,1000] [--rows 64] [--rounds 7]
    python experiments/decode_attention.py --quick    (smoke run into build/results-quick/)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternating, best_time, table, write_report  # noqa: E402
from offline_throughput import memory_bandwidth  # noqa: E402

from llmjax.cli_types import choice_list, parse_quick, positive_int, positive_int_list  # noqa: E402
from llmjax.provenance import results_dir  # noqa: E402


BLOCK = 16
ENGINE = "engine build"
# build -> (FFI target, compiler flags added to the engine's)
VARIANTS = {"no next-row prefetch": ("llmjax_paged_decode_no_following", ("-DLLMJAX_PREFETCH_FOLLOWING=0",)),
            "L1 prefetch": ("llmjax_paged_decode_l1", ("-DLLMJAX_PREFETCH_LOCALITY=3",))}
BUILDS = (ENGINE, *VARIANTS)


def geometry() -> dict:
    """SmolLM2-135M's attention shapes, from the embedded GGUF's metadata."""
    from llmjax.config import model_config_from_gguf_metadata
    from llmjax.models.loader import embedded_model_path, gguf_metadata, read_gguf

    cfg = model_config_from_gguf_metadata(gguf_metadata(read_gguf(embedded_model_path())))
    return dict(layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                scale=cfg.softmax_scale())


def load_builds() -> dict[str, str]:
    """Build and register the engine's kernel and each of `VARIANTS`; build -> FFI target."""
    from llmjax.attention import native

    if not native.available():
        raise SystemExit("the native CPU attention kernel did not build here (see the warning above)")
    targets = {ENGINE: native.TARGET}
    for build, (target, flags) in VARIANTS.items():
        kernel = native.NativeKernel(native.SOURCE, ((target, "LlmjaxPagedDecode"),), flags=native.FLAGS + flags,
                                     label=f"native CPU attention kernel, {build}")
        if not native.load(kernel):
            raise SystemExit(f"the kernel's {build} build failed (see the warning above)")
        targets[build] = target
    return targets


def step_functions(geo: dict, targets: dict[str, str], rows: int, context: int, dtype: str,
                   seed: int = 0) -> tuple[dict, int]:
    """build -> a call running one decode step over all layers and waiting for it; the KV bytes
    one step reads."""
    import jax
    import jax.numpy as jnp

    from llmjax.attention import cpu
    from llmjax.attention.cache_dtype import BF16_BITS, to_storage

    rng = np.random.default_rng(seed)
    per_row = -(-context // BLOCK)
    num_blocks = rows * per_row + 1  # block 0: the null block
    shape = (geo["layers"], num_blocks, BLOCK, geo["kv_heads"], geo["head_dim"])
    caches = []
    for _ in range(2):
        x = jnp.asarray(rng.standard_normal(shape, np.float32))
        caches.append(to_storage(x, BF16_BITS) if dtype == "bfloat16" else x)
    tables = jnp.asarray(rng.permutation(np.arange(1, num_blocks)).reshape(rows, per_row).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((rows, geo["heads"], geo["head_dim"]), np.float32))
    query_start_loc = jnp.arange(rows + 1, dtype=jnp.int32)
    seq_lens = jnp.full((rows,), context, jnp.int32)

    def step(target):
        @jax.jit
        def run(q, k, v):
            def layer(carry, index):
                out = cpu.paged_attention(q + carry, k, v, index, query_start_loc, seq_lens, tables, rows,
                                          sm_scale=geo["scale"], decode_only=True, target=target)
                return carry + 1e-6 * out, None  # each layer depends on the last, as in the model
            return jax.lax.scan(layer, jnp.zeros_like(q), jnp.arange(geo["layers"]))[0]

        run(q, *caches).block_until_ready()  # compile
        return lambda: run(q, *caches).block_until_ready()

    item_bytes = 2 if dtype == "bfloat16" else 4
    kv_bytes = 2 * geo["layers"] * rows * context * geo["kv_heads"] * geo["head_dim"] * item_bytes
    return {build: step(target) for build, target in targets.items()}, kv_bytes


def measure(geo: dict, targets: dict[str, str], rows: int, contexts: list[int], dtypes: list[str], rounds: int,
            repeats: int) -> list[dict]:
    results = []
    for dtype in dtypes:
        for context in contexts:
            print(f"{dtype} cache, {rows} rows at {context} keys: compiling each build", flush=True)
            calls, kv_bytes = step_functions(geo, targets, rows, context, dtype)
            times: dict[str, list[float]] = {b: [0.0] * rounds for b in BUILDS}
            bandwidths = [0.0] * rounds
            for round_, build in alternating(BUILDS, rounds):
                if not bandwidths[round_]:  # the round's first build: its bandwidth first
                    bandwidths[round_] = memory_bandwidth(3)
                times[build][round_] = best_time(calls[build], repeats)
            row = dict(dtype=dtype, context=context, rows=rows, kv_mb=kv_bytes / 1e6,
                       bandwidth_gb_s=[b / 1e9 for b in bandwidths])
            for build in BUILDS:
                ms = 1e3 * statistics.median(times[build])
                ratios = [times[build][r] / times[ENGINE][r] for r in range(rounds)]
                row[build] = dict(ms=ms, gb_s=kv_bytes / ms / 1e6, ms_per_round=[1e3 * t for t in times[build]],
                                  vs_engine=statistics.median(ratios), vs_engine_min=min(ratios),
                                  vs_engine_max=max(ratios),
                                  bandwidth_share=statistics.median(
                                      kv_bytes / t / bw for t, bw in zip(times[build], bandwidths)))
            print("  " + ", ".join(f"{b} {row[b]['ms']:.1f} ms ({row[b]['vs_engine']:.2f}x)" for b in BUILDS),
                  flush=True)
            results.append(row)
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(results))
    width = 0.8 / len(BUILDS)
    for i, build in enumerate(BUILDS):
        ax.bar(x + (i - (len(BUILDS) - 1) / 2) * width, [r[build]["gb_s"] for r in results], width, label=build)
    ax.set_xticks(x, [f"{r['dtype']}\n{r['context']} keys" for r in results])
    ax.set_ylabel("KV cache read, GB/s")
    ax.set_title(f"Decode attention, SmolLM2-135M geometry, {results[0]['rows']} rows, all layers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=positive_int_list, default="128,400,1000",
                    help="context lengths (keys per row), comma-separated")
    ap.add_argument("--rows", type=positive_int, default=64, help="decode rows per step")
    ap.add_argument("--dtypes", type=choice_list("bfloat16", "float32"), default="bfloat16,float32",
                    help="KV cache dtypes, comma-separated")
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--repeats", type=positive_int, default=5, help="calls per build per round (the best counts)")
    ap.add_argument("--out-name", default="decode_attention")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 8 rows at 64 keys, bfloat16 (a smoke run)")
    args = parse_quick(ap, dict(contexts=[64], rows=8, dtypes=["bfloat16"], rounds=2, repeats=2))
    contexts, dtypes = args.contexts, args.dtypes

    targets = load_builds()
    geo = geometry()
    results = measure(geo, targets, args.rows, contexts, dtypes, args.rounds, args.repeats)
    out = results_dir(args.quick)
    plot(results, out / f"{args.out_name}.png")
    columns = [("dtype", "KV cache", ""), ("context", "keys per row", ""), ("kv_mb", "KV MB per step", ".0f"),
               ("bandwidth", "read bandwidth GB/s", "")]
    rows = []
    for r in results:
        row = dict(r, bandwidth=f"{min(r['bandwidth_gb_s']):.1f}-{max(r['bandwidth_gb_s']):.1f}")
        for build in BUILDS:
            b = r[build]
            row[build] = f"{b['ms']:.1f} ms, {b['gb_s']:.1f} GB/s ({b['bandwidth_share']:.0%})"
            if build != ENGINE:
                row[build] += f", {b['vs_engine']:.2f}x ({b['vs_engine_min']:.2f}-{b['vs_engine_max']:.2f})"
        rows.append(row)
    columns += [(b, b, "") for b in BUILDS]
    body = (f"`python {' '.join(sys.argv)}`\n\n"
            f"Decode-only steps of SmolLM2-135M's attention ({geo['layers']} layers, {geo['heads']} query heads, "
            f"{geo['kv_heads']} KV heads, head dim {geo['head_dim']}): {args.rows} rows of one context length, "
            f"blocks of {BLOCK} tokens shuffled over the cache, all layers in one `lax.scan`. Median over "
            f"{args.rounds} rounds (builds alternating) of the best of {args.repeats} calls; GB/s: the KV "
            "bytes the step reads per second (in parentheses: the median over rounds of its share of the "
            "machine's read bandwidth measured in the same round, torch summing 1 GiB of float32 on all cores, "
            "best of 3; the bandwidth column gives the range of those measurements); for the "
            "other builds, their time over the engine build's (median of the rounds, range).\n\n"
            + table(rows, columns) + "\n\n"
            f"![decode attention]({args.out_name}.png)\n")
    write_report(args.out_name, "Decode attention: how the native kernel prefetches", body,
                 dict(geometry=geo, results=results), out)


if __name__ == "__main__":
    main()
