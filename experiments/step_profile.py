"""Per-step device time of the engine's jitted step on representative batches, and attention's share.

Builds the engine for each of `--dtypes` (embedded SmolLM2-135M; T=512, S=64, max_model_len 1024,
1 GiB of KV; bfloat16 is the mixed-precision path with a bfloat16 KV cache), makes
realistic `StepInput`s (distinct block tables, real positions and slots, greedy sampling) and runs
them through `engine.runner._step`, next to the same step with other attention implementations:

- `engine`: the step as the engine runs it (the configured attention backend);
- `baseline`: the same step with `llmjax/attention/xla.py` taken from a git revision
  (`--baseline-ref`, e.g. the commit before an attention change);
- `no attention`: attention replaced by a zero-cost stub (returns q): the rest of the step;
- with `--wide-tables`, `engine 2B`: the engine's step on the same batch with block tables twice
  its bucket's width (B), what a larger block-table floor (`llmjax.buckets.MIN_BLOCK_TOKENS`) costs.

Every variant is compiled first, then the variants run in alternation (`--repeats` rounds) so a
shared, noisy CPU slows them alike; the table gives medians of wall time and of process CPU time
(on a busy machine CPU time is the steadier of the two). Attention's share is
(engine - no attention) / engine.

    python experiments/step_profile.py [--baseline-ref REV] [--cases decode,mixed,prefill]
                                       [--dtypes float32,bfloat16]
                                       [--repeats 5] [--attention-backend xla] [--wide-tables]
                                       [--out-name step_profile] [--quick]

Writes results/<out-name>.md, .json (stamped by `llmjax.provenance`) and .png (attention's share);
`--quick` (the decode case, bfloat16, 2 rounds) writes to build/results-quick/. The report says
which of the engine's linear layers ran on a packed native matmul (`llmjax.ops.packed_matmul`: on a
CPU with AMX or AVX512-BF16 a bfloat16 model's do, unless `LLMJAX_NO_PACKED_MATMUL` is set), since
the rest of the step's time, and so attention's share, depends on it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's llmjax, whichever one the environment installed

from llmjax.cli_types import choice_list, non_empty, parse_quick, positive_int  # noqa: E402
from llmjax.provenance import results_dir, write_results  # noqa: E402


def make_step(q_lens, contexts, t, s, b, block_size, num_blocks, rng):
    """A StepInput of bucket (t, s, b): request i computes its last q_lens[i] tokens of contexts[i]."""
    from llmjax.step_input import StepInput

    q_lens, contexts = np.asarray(q_lens, np.int32), np.asarray(contexts, np.int32)
    n, total = len(q_lens), int(q_lens.sum())
    qsl = np.full(s + 1, total, np.int32)
    qsl[0] = 0
    np.cumsum(q_lens, out=qsl[1 : n + 1])
    seq_lens = np.zeros(s, np.int32)
    seq_lens[:n] = contexts
    tables = np.zeros((s, b), np.int32)
    first = 1
    for i in range(n):  # distinct blocks per request (wrapping around a small pool)
        k = -(-int(contexts[i]) // block_size)
        tables[i, :k] = (np.arange(first, first + k) - 1) % (num_blocks - 1) + 1
        first += k
    req = np.repeat(np.arange(n), q_lens)
    positions = np.zeros(t, np.int32)
    positions[:total] = (contexts - q_lens)[req] + np.arange(total) - qsl[req]
    slots = np.zeros(t, np.int32)
    slots[:total] = tables[req, positions[:total] // block_size] * block_size + positions[:total] % block_size
    tokens = np.zeros(t, np.int32)
    tokens[:total] = rng.integers(100, 49152, total)
    logits_idx = np.zeros(s, np.int32)
    logits_idx[:n] = qsl[1 : n + 1] - 1
    num_decodes = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else n
    return StepInput(token_ids=tokens, token_source=np.full(t, -1, np.int32), positions=positions, slot_mapping=slots,
                     query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables, logits_indices=logits_idx,
                     num_decodes=np.int32(num_decodes))


def cases(rng):
    """name -> (description, q_lens, contexts); decodes first, then prefill chunks."""
    dec_ctx = rng.integers(380, 421, 64)
    return {
        "decode": ("decode-only: 64 requests, contexts 380-420", [1] * 64, dec_ctx),
        "mixed": ("mixed: 63 decodes (ctx 380-420) + one 449-token prompt", [1] * 63 + [449],
                  list(dec_ctx[:63]) + [449]),
        "prefill": ("prefill-only: one 512-token prompt", [512], [512]),
        "prefill16": ("prefill-only: 16 prompts of 32 tokens", [32] * 16, [32] * 16),
        "mixed-few": ("mixed: 4 decodes (ctx ~400) + 8 prompts of 60", [1] * 4 + [60] * 8,
                      list(dec_ctx[:4]) + [60] * 8),
    }


def load_attention_from_git(ref: str):
    """`llmjax/attention/xla.py` as of git revision `ref`, imported as a standalone module."""
    src = subprocess.run(["git", "show", f"{ref}:llmjax/attention/xla.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_xla.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("baseline_xla", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-ref", default=None, help="git revision whose attention/xla.py is the baseline")
    parser.add_argument("--cases", type=choice_list("decode", "mixed", "prefill"), default="decode,mixed,prefill")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--dtypes", type=choice_list("float32", "bfloat16"), default="float32,bfloat16",
                        help="model dtypes to profile side by side")
    parser.add_argument("--attention-backend", default=None, help="the engine's backend (default: the platform's)")
    parser.add_argument("--wide-tables", action="store_true",
                        help="also run the engine's step with block tables twice as wide (B x 2)")
    parser.add_argument("--out-name", type=non_empty, default="step_profile",
                        help="results/<name>.md, .json and .png (default %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the decode case in bfloat16, 2 rounds; written to build/results-quick/")
    args = parse_quick(parser, dict(cases=["decode"], dtypes=["bfloat16"], repeats=2))

    import jax

    from llmjax.attention.backend import AttentionBackend
    from llmjax.config import EngineConfig
    from llmjax.engine import LLMEngine
    from llmjax.ops import packed_matmul
    from llmjax.step_input import HostInputs

    engines, variants = {}, {}
    for dtype in args.dtypes:
        config = EngineConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024,
                              kv_cache_memory_bytes=1 << 30, dtype=dtype, attention_backend=args.attention_backend)
        engine = engines[dtype] = LLMEngine.from_config(None, config)
        runner = engine.runner

        def step_fn(backend, runner=runner):
            return runner.step_function(backend)[0]

        variants[f"engine {dtype}"] = (runner, None, 1)  # (runner, step function or its own, B multiple)
        if args.wide_tables:
            variants[f"engine 2B {dtype}"] = (runner, None, 2)
        if args.baseline_ref:
            old = load_attention_from_git(args.baseline_ref)
            variants[f"baseline {dtype}"] = (runner, step_fn(AttentionBackend(
                f"xla@{args.baseline_ref}", old.ragged_paged_attention, old.mla_ragged_paged_attention)), 1)
        stub = AttentionBackend("stub", lambda q, *a, **k: q, lambda q, *a, **k: q)
        variants[f"no attention {dtype}"] = (runner, step_fn(stub), 1)
    engine = next(iter(engines.values()))
    runner, bs = engine.runner, engine.config.block_size
    kernel = packed_matmul.selected()
    linear = {d: f"packed {kernel.name} kernel" if packed_matmul.enabled(d) else "XLA dot" for d in engines}

    rng = np.random.default_rng(0)
    all_cases = cases(rng)
    rows = []
    for name in args.cases:
        desc, q_lens, contexts = all_cases[name]
        t, s, b = runner.buckets.shape(sum(q_lens), len(q_lens), -(-max(contexts) // bs))
        inputs = {}  # B multiple -> the batch's inputs (the same batch: its tables widened with null blocks)
        seed = int(rng.integers(2**31))
        for k in sorted({widen for *_, widen in variants.values()}):
            step = make_step(q_lens, contexts, t, s, k * b, bs, engine.num_blocks, np.random.default_rng(seed))
            inputs[k] = HostInputs.pack(step, runner.padding_inputs(t, s, k * b).sampling_input())  # greedy
        decode_only = int(step.num_decodes) == len(q_lens)

        def run(variant):
            owner, fn, widen = variant
            own = owner._step_fn
            owner._step_fn = fn or own  # None: the engine's own step
            try:
                out = owner.run(inputs[widen], decode_only)
            finally:
                owner._step_fn = own
            jax.block_until_ready(out)

        compile_s = {}
        print(f"{name}: compiling {len(variants)} variants of bucket {(t, s, b)}, then {args.repeats} rounds",
              flush=True)
        for v, variant in variants.items():
            t0 = time.perf_counter()
            run(variant)
            compile_s[v] = time.perf_counter() - t0
        wall = {v: [] for v in variants}
        cpu = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v, variant in variants.items():
                w0, c0 = time.perf_counter(), time.process_time()
                run(variant)
                wall[v].append(time.perf_counter() - w0)
                cpu[v].append(time.process_time() - c0)
        med = {v: (statistics.median(wall[v]), statistics.median(cpu[v])) for v in variants}
        rows.append((name, desc, (t, s, b, decode_only), med, compile_s))
        print(f"{name}: " + "  ".join(f"{v} {w:.3f}s wall / {c:.3f}s cpu" for v, (w, c) in med.items()),
              flush=True)

    names = list(variants)
    dtypes = list(engines)
    head = "| step | bucket (T, S, B, decode-only) | " + " | ".join(f"{v} wall / cpu (s)" for v in names)
    head += "".join(f" | attention share {d} (cpu)" for d in dtypes) + " |"
    if args.baseline_ref:
        head += "".join(f" baseline / engine {d} (cpu) |" for d in dtypes)
    if args.wide_tables:
        head += "".join(f" 2B / B {d} (cpu) |" for d in dtypes)
    if len(dtypes) > 1:
        head += f" {dtypes[0]} / {dtypes[1]} (cpu) |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, desc, bucket, med, _ in rows:
        cells = [f"{med[v][0]:.3f} / {med[v][1]:.3f}" for v in names]
        line = f"| {desc} | {bucket} | " + " | ".join(cells) + " |"
        for d in dtypes:
            share = (med[f"engine {d}"][1] - med[f"no attention {d}"][1]) / med[f"engine {d}"][1]
            line += f" {share:.0%} |"
        if args.baseline_ref:
            line += "".join(f" {med[f'baseline {d}'][1] / med[f'engine {d}'][1]:.2f}x |" for d in dtypes)
        if args.wide_tables:
            line += "".join(f" {med[f'engine 2B {d}'][1] / med[f'engine {d}'][1]:.3f}x |" for d in dtypes)
        if len(dtypes) > 1:
            line += f" {med[f'engine {dtypes[0]}'][1] / med[f'engine {dtypes[1]}'][1]:.2f}x |"
        lines.append(line)
    table = "\n".join(lines)
    note = (f"\nMedians of {args.repeats} alternating runs per variant; jax {jax.__version__}, "
            f"{jax.devices()[0].platform}, backend {runner.backend.name}, "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; linear layers: "
            + ", ".join(f"{d} on the {how}" for d, how in linear.items())
            + (f", baseline attention from {args.baseline_ref}" if args.baseline_ref else "") + ".")
    print("\n" + table + note)
    shares = {d: {name: (med[f"engine {d}"][1] - med[f"no attention {d}"][1]) / med[f"engine {d}"][1]
                  for name, _, _, med, _ in rows} for d in dtypes}
    out = results_dir(args.quick)
    plot_shares(shares, [desc for _, desc, *_ in rows], out / f"{args.out_name}.png")
    write_results(out, args.out_name, f"# Step profile\n\n`python experiments/step_profile.py {' '.join(sys.argv[1:])}`"
                  f"\n\n![attention's share]({args.out_name}.png)\n\n{table}\n{note}\n",
                  {"args": vars(args), "backend": runner.backend.name, "linear_layers": linear,
                   "attention_share_cpu": shares,
                   "cases": [{"case": name, "description": desc, "bucket": list(bucket),
                              "wall_s": {v: m[0] for v, m in med.items()}, "cpu_s": {v: m[1] for v, m in med.items()},
                              "compile_s": compile_s} for name, desc, bucket, med, compile_s in rows]})


def plot_shares(shares: dict[str, dict[str, float]], descriptions: list[str], path: Path) -> None:
    """A bar per case and dtype: attention's share of the step's CPU time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(shares)
    for k, (dtype, by_case) in enumerate(shares.items()):
        xs = [i + k * width for i in range(len(by_case))]
        ax.bar(xs, [100 * v for v in by_case.values()], width, label=dtype)
    ax.set_xticks([i + width * (len(shares) - 1) / 2 for i in range(len(descriptions))])
    ax.set_xticklabels([d.split(":")[0] for d in descriptions])
    ax.set(ylabel="attention's share of the step (%)", ylim=(0, 100), title="where a jitted step's time goes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
