"""The packed bfloat16 matmul kernel (`llmjax/ops/packed_matmul.py`) against XLA's bfloat16 dots:
on SmolLM2's matmul shapes, then in the engine's steps.

1. Matmuls: every shape of SmolLM2-135M's linear layers and LM head at 64 and 512 rows (a decode
   step's and a prefill chunk's), bfloat16 x bfloat16 accumulated in float32, run by XLA's dot,
   each packed kernel this CPU has (AMX, AVX512-BF16) and torch's bfloat16 matmul (oneDNN), in
   alternation over `--rounds` rounds (each a best of `--repeats` calls): GFLOP/s per shape and
   for the model's FLOP-weighted mix (each shape weighted by its count per token).
2. The engine: the embedded SmolLM2 in bfloat16, built twice in one process (the selected packed
   kernel, and `LLMJAX_NO_PACKED_MATMUL=1`: XLA's dots), with prefix caching off; passes of a
   decode-heavy workload (64 requests of 32-token prompts, 64 output tokens: decode steps of 64
   rows) and of a prefill-heavy one (16 requests of 480-token prompts, 1 output token: chunks of
   up to 512 tokens) alternate between the two engines; output (decode) or prompt (prefill)
   tokens per second, medians, and the ratio per pair of neighbouring passes.

Writes results/<--out-name>.md, .json and .png (default `packed_matmul`; another machine's run
keeps its own name).

    python experiments/packed_matmul.py [--rounds 5] [--passes 4] [--out-name packed_matmul_epyc]
    python experiments/packed_matmul.py --quick    (smoke run into build/results-quick/)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmjax.cli_types import parse_quick  # noqa: E402
from llmjax.provenance import results_dir, write_results  # noqa: E402
from common import best_time  # noqa: E402

ROWS = (64, 512)


def matmul_shapes(cfg) -> list[tuple[str, int, int, int]]:
    """(name, in, out, count per token) of the model's matmuls."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    return [("q/o", h, cfg.num_heads * d, 2 * layers), ("k/v", h, cfg.num_kv_heads * d, 2 * layers),
            ("gate/up", h, cfg.intermediate_size, 2 * layers), ("down", cfg.intermediate_size, h, layers),
            ("LM head", h, cfg.vocab_size, 1)]


def matmul_functions(rows: int, k: int, n: int, kernels) -> dict:
    """name -> a call that runs one [rows, k] @ [k, n] product and waits for it."""
    import jax
    import jax.numpy as jnp
    import torch

    from llmjax.ops import packed_matmul as pmm

    rng = np.random.default_rng(rows + k + n)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    calls = {"xla": lambda: dot(x, w).block_until_ready()}
    packed = jnp.asarray(pmm.pack_weight(np.asarray(w)))
    for kernel in kernels:
        f = jax.jit(lambda a, p, kernel=kernel: pmm.packed_matmul(a, p, n, kernel=kernel))
        calls[kernel.name] = lambda f=f: f(x, packed).block_until_ready()
    tx, tw = torch.from_numpy(np.asarray(x.astype(jnp.float32))).bfloat16(), \
        torch.from_numpy(np.asarray(w.astype(jnp.float32))).bfloat16()
    calls["torch"] = lambda: tx @ tw
    return calls


def measure_matmuls(cfg, kernels, rounds: int, repeats: int) -> list[dict]:
    """Per (rows, shape, library): GFLOP/s, the median over rounds of each round's best call."""
    rows_out = []
    for rows in ROWS:
        for name, k, n, count in matmul_shapes(cfg):
            calls = matmul_functions(rows, k, n, kernels)
            for call in calls.values():
                call()  # compile and warm up
            times: dict[str, list[float]] = {lib: [] for lib in calls}
            for _ in range(rounds):
                for lib, call in calls.items():
                    times[lib].append(best_time(call, repeats))
            for lib, ts in times.items():
                seconds = statistics.median(ts)
                rows_out.append(dict(rows=rows, shape=name, k=k, n=n, count=count, library=lib, seconds=seconds,
                                     gflops=2 * rows * k * n / seconds / 1e9))
            print(f"  {rows} rows, {name} [{k} x {n}]: " + ", ".join(
                f"{r['library']} {r['gflops']:.0f}" for r in rows_out[-len(calls):]) + " GFLOP/s", flush=True)
    return rows_out


def mix(matmuls: list[dict], rows: int, library: str) -> float:
    """GFLOP/s of the FLOP-weighted mix: total FLOPs over total time, each shape times its count."""
    sel = [r for r in matmuls if r["rows"] == rows and r["library"] == library]
    return sum(2 * rows * r["k"] * r["n"] * r["count"] for r in sel) / sum(r["seconds"] * r["count"] for r in sel) / 1e9


def measure_engine(passes: int, quick: bool) -> dict:
    """Tokens per second of the two engines on the decode and prefill workloads, passes alternating."""
    from llmjax.llm import LLM
    from llmjax.ops import packed_matmul as pmm
    from llmjax.sampling_params import SamplingParams

    settings = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=512,
                    enable_prefix_caching=False)
    engines = {}
    for name, disabled in (("packed", False), ("xla", True)):
        if disabled:
            os.environ[pmm.DISABLE_ENV] = "1"
        else:
            os.environ.pop(pmm.DISABLE_ENV, None)
        print(f"building the {name} engine", flush=True)
        engines[name] = LLM(None, **settings)
    os.environ.pop(pmm.DISABLE_ENV, None)
    rng = np.random.default_rng(0)
    n_dec, n_pre = (8, 4) if quick else (64, 16)
    workloads = {
        "decode": ([{"prompt_token_ids": rng.integers(100, 40000, 32).tolist()} for _ in range(n_dec)],
                   SamplingParams(temperature=0, max_tokens=16 if quick else 64, ignore_eos=True)),
        "prefill": ([{"prompt_token_ids": rng.integers(100, 40000, 480).tolist()} for _ in range(n_pre)],
                    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
    }
    results = {w: {e: [] for e in engines} for w in workloads}
    tokens = {}
    for w, (prompts, params) in workloads.items():
        for name, llm in engines.items():
            print(f"warming up {name} on {w}", flush=True)
            llm.generate(prompts, params, use_tqdm=False)
        for i in range(passes):
            order = list(engines) if i % 2 == 0 else list(reversed(engines))  # ABBA
            for name in order:
                t = time.perf_counter()
                outs = engines[name].generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t
                count = sum(len(o.outputs[0].token_ids) for o in outs) if w == "decode" else \
                    sum(len(o.prompt_token_ids) for o in outs)
                tokens[w] = count
                results[w][name].append(count / dt)
            print(f"  {w} pass {i + 1}/{passes}: " + ", ".join(
                f"{n} {results[w][n][-1]:.0f} tok/s" for n in engines), flush=True)
    return dict(kernel=pmm.selected().name if pmm.selected() else None, tok_per_s=results, tokens=tokens,
                settings=settings)


def plot(matmuls: list[dict], libraries: list[str], engine: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw=dict(width_ratios=[3, 3, 2]))
    shapes = list(dict.fromkeys(r["shape"] for r in matmuls)) + ["mix"]
    width = 0.8 / len(libraries)
    for ax, rows in zip(axes, ROWS):
        for j, lib in enumerate(libraries):
            values = [next(r["gflops"] for r in matmuls if r["rows"] == rows and r["shape"] == s
                           and r["library"] == lib) for s in shapes[:-1]] + [mix(matmuls, rows, lib)]
            ax.bar(np.arange(len(shapes)) + j * width, values, width, label=lib)
        ax.set_xticks(np.arange(len(shapes)) + width * (len(libraries) - 1) / 2, shapes)
        ax.set_title(f"{rows} rows (bfloat16, float32 accumulation)")
        ax.set_ylabel("GFLOP/s")
        ax.legend(fontsize=8)
    ax = axes[2]
    for i, (w, by_engine) in enumerate(engine["tok_per_s"].items()):
        for j, name in enumerate(by_engine):
            values = by_engine[name]
            color = f"C{libraries.index(engine['kernel'] if name == 'packed' else name)}"
            label = f"{engine['kernel']} (packed)" if name == "packed" else name
            ax.bar(i + j * 0.4, statistics.median(values), 0.4, color=color, label=label if i == 0 else None)
            ax.plot([i + j * 0.4] * len(values), values, "k.", markersize=4)
    ax.set_xticks([0.2, 1.2], list(engine["tok_per_s"]))
    ax.set_ylabel("tokens / s (median, dots: passes)")
    ax.set_title("the engine (SmolLM2, bfloat16)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the matmul timings")
    ap.add_argument("--repeats", type=int, default=7, help="calls per round (its best counts)")
    ap.add_argument("--passes", type=int, default=4, help="timed passes of each workload per engine")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, 2 passes of small workloads, "
                    "written to build/results-quick/")
    ap.add_argument("--out-name", default="packed_matmul")
    args = parse_quick(ap, dict(rounds=1, repeats=2, passes=2))

    from llmjax.models.loader import load_model
    from llmjax.ops import packed_matmul as pmm

    kernels = [k for k in pmm.KERNELS if k.cpu_supports() and pmm.loads(k)]
    if not kernels:
        sys.exit("no packed matmul kernel runs on this CPU (it lacks AMX and AVX512-BF16, or no compiler)")
    cfg = load_model(None, dtype="bfloat16").config
    print(f"matmuls on SmolLM2's shapes ({args.rounds} rounds, best of {args.repeats} calls each)", flush=True)
    matmuls = measure_matmuls(cfg, kernels, args.rounds, args.repeats)
    engine = measure_engine(args.passes, args.quick)

    libraries = ["xla", *(k.name for k in kernels), "torch"]
    lines = ["## Matmuls on SmolLM2-135M's shapes", "",
             "GFLOP/s, bfloat16 x bfloat16 accumulated in float32; median over rounds of each round's best call; "
             "mix: the model's FLOP-weighted mix (each shape times its count per token; the LM head once).", "",
             "| rows | shape | " + " | ".join(libraries) + f" | {kernels[0].name} / xla |",
             "| --- | --- | " + " | ".join("---" for _ in libraries) + " | --- |"]
    for rows in ROWS:
        for name, k, n, count in matmul_shapes(cfg):
            g = {r["library"]: r["gflops"] for r in matmuls if r["rows"] == rows and r["shape"] == name}
            lines.append(f"| {rows} | {name} [{k} x {n}] x{count} | " + " | ".join(f"{g[lib]:.0f}" for lib in libraries)
                         + f" | {g[kernels[0].name] / g['xla']:.2f}x |")
        m = {lib: mix(matmuls, rows, lib) for lib in libraries}
        lines.append(f"| {rows} | **mix** | " + " | ".join(f"**{m[lib]:.0f}**" for lib in libraries)
                     + f" | **{m[kernels[0].name] / m['xla']:.2f}x** |")
    lines += ["", f"## The engine: SmolLM2-135M in bfloat16, the {engine['kernel']} kernel against XLA's dots", "",
              f"Settings {engine['settings']}; decode: output tokens per second of 64 requests with 32-token prompts "
              "and 64 output tokens each (greedy, ignore_eos); prefill: prompt tokens per second of 16 requests "
              "with 480-token prompts and one output token. Passes alternate between the engines (ABBA); ratio: "
              "packed / xla per pair of neighbouring passes.", "",
              "| workload | packed tok/s (median) | xla tok/s (median) | ratio by pair | median ratio |",
              "| --- | --- | --- | --- | --- |"]
    for w, by_engine in engine["tok_per_s"].items():
        ratios = [a / b for a, b in zip(by_engine["packed"], by_engine["xla"])]
        engine.setdefault("ratios", {})[w] = ratios
        engine.setdefault("ratio_median", {})[w] = statistics.median(ratios)
        lines.append(f"| {w} | {statistics.median(by_engine['packed']):.0f} | {statistics.median(by_engine['xla']):.0f}"
                     f" | {' / '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}x** |")
    body = "\n".join(lines)
    print(body)
    out = results_dir(quick=args.quick)
    write_results(out, args.out_name, "# Packed bfloat16 matmul\n\n" + body + "\n",
                  dict(matmuls=matmuls, engine=engine, args=vars(args), kernel=kernels[0].name,
                       mix={str(rows): {lib: mix(matmuls, rows, lib) for lib in libraries} for rows in ROWS}))
    plot(matmuls, libraries, engine, out / f"{args.out_name}.png")


if __name__ == "__main__":
    main()
