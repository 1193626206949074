"""The optimizations added one at a time on one workload, from HF transformers `generate` to the full engine.

Workload: `--requests` requests arriving at once (offline), every prompt = one of `--prefixes` shared
system prompts (`--prefix-len` tokens) + a unique question; log-normal output lengths; greedy,
ignore_eos. The embedded SmolLM2-135M (float32 up to rung 6) on this CPU. The rungs, each adding one thing:

0. HF transformers `generate` at its best setting: static batches of each of `--hf-batches` in bfloat16
   and float32 (left padding, KV cache on, torch threads = the cores), all swept in this run, on every
   request (or, with `--hf-requests N`, on the first N only, its time scaled to the workload by output
   tokens), one pass each; the fastest is rung 0, and the sweep is reported. Rung 0 (and HF at rung 1's
   dtype and batch, its "previous") is then timed in the engine rungs' passes, like them.
1. llmjax, static batching, contiguous KV: a contiguous cache reserves max_model_len per request, so the
   fixed KV budget (`--slots` x max_model_len tokens) admits `--slots` requests: emulated by
   max_num_seqs = batch_size = `--slots` (our paged pool of the same size holds them).
2. + paged KV: the same budget, paged, admits requests by their real length: static batches of the
   number of average-length requests the budget holds (`paged_batch`).
3. + continuous batching: freed slots refilled every step (max_num_seqs = `paged_batch`).
4. + chunked prefill: token budget `--chunk` per step, prefill chunks mixed with decodes.
5. + prefix caching: the shared system prompts are computed once.
6. on a GPU: + Pallas kernels (rungs 1-5 use the pure-JAX attention);
   on CPU: + the native CPU attention kernel, then
7. + bfloat16 mixed precision (bfloat16 weights and KV cache, float32 accumulation; the KV pool keeps
   the same number of tokens).

Measured per rung: output tokens/s, mean TTFT and p50 TPOT from the start of the run, and the multiple
over rung 0. Each engine rung's step buckets are compiled before it is timed; the rungs (HF's among
them) run `--passes` times, the ladder forward, then backward, ..., and each reports its median pass.
A rung's ratio to the previous one is taken pass by pass (the two ran one after the other, so a drift
in the shared machine's speed weighs on both): the median of those ratios, which counts as resolved
only when every pass puts it on the same side of 1.

    python experiments/synergy.py [--requests 32] [--slots 4] [--hf-batches 4,8,16,32] [--passes 5]
    python experiments/synergy.py --quick      (smoke run into build/results-quick/)
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common import EngineConfig, Replay, Timing, TraceRequest, make_engine, replay_engine, results_dir, table, \
    warm_engine, write_report  # noqa: E402
from llmjax.cli_types import non_negative_int, parse_quick, positive_int, positive_int_list  # noqa: E402
from llmjax.workloads import lognormal_lengths  # noqa: E402
from paper_repro.traces import random_tokens  # noqa: E402

MAX_MODEL_LEN = 512
BLOCK_SIZE = 16  # EngineConfig's default, which the rungs keep
HF_BEST, HF_AT_RUNG_1 = "0. HF generate, best of the sweep", "HF generate at rung 1's dtype and batch"


def workload(n: int, prefixes: int, prefix_len: int, seed: int, vocab: int) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    systems = [random_tokens(rng, prefix_len, vocab) for _ in range(prefixes)]
    outputs = lognormal_lengths(rng, n, 40, 0.6, 96)
    return [TraceRequest(f"q{i}", 0.0, systems[i % prefixes] + random_tokens(rng, int(rng.integers(8, 40)), vocab),
                         int(outputs[i])) for i in range(n)]


def run_hf(requests: list[TraceRequest], batch: int, dtype: str) -> Replay:
    """HF `generate` in static batches. Every decoding step's end is timed through `generate`'s streamer
    hook (which receives each step's tokens as they are sampled), so a request's token times are the
    times of its batch's first `output_len` steps: its TTFT includes its batch's padded prefill and the
    batches queued before it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from llmjax.models.loader import embedded_model_path

    class StepClock(BaseStreamer):
        """Records when each decoding step's tokens arrive (the first `put` is the prompt, not a step)."""

        def __init__(self) -> None:
            self.puts: list[float] = []

        def put(self, value) -> None:
            self.puts.append(time.perf_counter() - start)

        def end(self) -> None:
            pass

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
    def padded(group: list[TraceRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's prompts left-padded to the longest, and their attention mask."""
        width = max(len(r.prompt) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(group):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        return ids, mask

    with torch.no_grad():  # untimed, as the engine rungs are warmed: torch's first calls of a shape pay set-up
        ids, mask = padded(requests[:batch])
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    timings, start = [], time.perf_counter()
    for b in tqdm(range(0, len(requests), batch), desc=f"0. HF generate, batch {batch}, {dtype}", unit="batch"):
        group = requests[b : b + batch]
        ids, mask = padded(group)
        new = max(r.output_len for r in group)
        clock = StepClock()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, eos_token_id=None, streamer=clock)
        steps = clock.puts[1:]
        if len(steps) != new:
            raise RuntimeError(f"HF generate streamed {len(steps)} steps, expected {new}")
        for r in group:  # the batch runs `new` steps; a request's tokens are its first output_len of them
            timings.append(Timing(r.request_id, 0.0, steps[: r.output_len], len(r.prompt)))
    return Replay(timings, [], time.perf_counter() - start, batch)


def kv_bytes_per_token(dtype_bytes: int) -> int:
    """SmolLM2-135M's KV cache bytes per token: K and V, 3 KV heads of 64, 30 layers."""
    return 2 * 3 * 64 * 30 * dtype_bytes


def rungs(slots: int, paged_batch: int, chunk: int, kv_tokens: int, gpu: bool) -> dict[str, EngineConfig]:
    """The engine rungs in order, the first five on the pure-JAX attention in float32; then, with a GPU,
    the Pallas kernels; on CPU, the native attention kernel, then bfloat16 mixed precision. Every rung's
    KV pool holds `kv_tokens` tokens."""
    base = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=1024, enable_chunked_prefill=False,
                        enable_prefix_caching=False, kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(4),
                        scheduling_policy="static",
                        batch_size=slots, max_num_seqs=slots, attention_backend="xla")
    paged = base.replace(batch_size=paged_batch, max_num_seqs=paged_batch)
    cont = paged.replace(scheduling_policy="continuous")
    chunked = cont.replace(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    cached = chunked.replace(enable_prefix_caching=True)
    ladder = {"1. llmjax static batching, contiguous KV": base, "2. + paged KV": paged, "3. + continuous batching": cont,
              "4. + chunked prefill": chunked, "5. + prefix caching": cached}
    if gpu:
        ladder["6. + Pallas kernels"] = cached.replace(attention_backend="pallas")
    else:
        native = cached.replace(attention_backend="cpu")
        ladder["6. + native CPU attention"] = native
        ladder["7. + bfloat16 mixed precision"] = native.replace(
            dtype="bfloat16", kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(2))  # the same tokens
    return ladder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=32)
    ap.add_argument("--hf-requests", type=non_negative_int, default=0,
                    help="run HF on the first N requests only (0: all)")
    ap.add_argument("--slots", type=positive_int, default=4, help="requests a contiguous max-length KV budget admits")
    ap.add_argument("--prefixes", type=positive_int, default=2)
    ap.add_argument("--prefix-len", type=positive_int, default=96)
    ap.add_argument("--chunk", type=positive_int, default=256)
    ap.add_argument("--hf-batches", type=positive_int_list, default="4,8,16,32",
                    help="HF batch sizes swept (each in bfloat16 and float32)")
    ap.add_argument("--passes", type=positive_int, default=5,
                    help="timed passes of each engine rung (the median is reported)")
    ap.add_argument("--seed", type=non_negative_int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, HF batch 4, one pass; written to "
                    "build/results-quick/")
    args = parse_quick(ap, dict(requests=8, hf_batches=[4], passes=1))
    out = results_dir(args.quick)
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # HF at its strongest: every core (recorded below)

    requests = workload(args.requests, args.prefixes, args.prefix_len, args.seed, vocab=49152)
    out_tokens = sum(r.output_len for r in requests)
    mean_len = np.mean([len(r.prompt) + r.output_len for r in requests])
    paged_batch = int(args.slots * MAX_MODEL_LEN // mean_len)
    # the budget, plus block rounding: one partly filled block per request of a paged batch, and the null block
    kv_tokens = args.slots * MAX_MODEL_LEN + (paged_batch + 1) * BLOCK_SIZE

    results: dict[str, Replay] = {}
    hf_subset = requests[: args.hf_requests or None]
    sweep = []
    for dtype in ("bfloat16", "float32"):
        for batch in args.hf_batches:
            sweep.append({"batch": batch, "dtype": dtype,
                          "tokens_per_s": run_hf(hf_subset, batch, dtype).stats()["tokens_per_s"]})
    best = max(sweep, key=lambda r: r["tokens_per_s"])
    hf_scale = out_tokens / sum(r.output_len for r in hf_subset)
    # HF's settings timed in the passes: rung 0, and HF at rung 1's dtype and batch (its "previous") if swept
    hf_settings = {HF_BEST: (best["batch"], best["dtype"])}
    if args.slots in args.hf_batches:
        hf_settings[HF_AT_RUNG_1] = (args.slots, "float32")
    gpu = jax.default_backend() == "gpu"
    engines = {}
    for name, cfg in rungs(args.slots, paged_batch, args.chunk, kv_tokens, gpu).items():
        engines[name] = make_engine(None, cfg)
        warm_engine(engines[name], requests, full_pass=False)  # offline: the simulator's schedule is exact
    ladder = [*hf_settings, *engines]
    passes: dict[str, list[Replay]] = {name: [] for name in ladder}
    for k in range(args.passes):  # forward, then backward, ...: a drift in the machine's speed weighs on all rungs
        for name in (ladder if k % 2 == 0 else ladder[::-1]):
            if name in hf_settings:
                passes[name].append(run_hf(hf_subset, *hf_settings[name]))
                continue
            engines[name].kv.reset_prefix_cache()  # each pass computes the shared prompts anew
            passes[name].append(replay_engine(engines[name], requests, progress=f"{name}, pass {k + 1}"))
    for name, runs in passes.items():
        results[name] = sorted(runs, key=lambda r: r.duration)[(len(runs) - 1) // 2]  # the median pass
    hf = results.pop(HF_BEST)
    rung1_baseline = results.pop(HF_AT_RUNG_1, None)

    def rates(name: str) -> list[float]:
        return [p.stats()["tokens_per_s"] for p in passes[name]]

    rows = []
    hf_stats = hf.stats()
    subset = f" ({len(hf_subset)} requests, scaled; TTFT n/a)" if len(hf_subset) < len(requests) else ""
    rows.append({"rung": f"0. HF generate, best of the sweep: batch {best['batch']}, {best['dtype']}{subset}",
                 "tokens_per_s": hf_stats["tokens_per_s"], "duration_s": hf.duration * hf_scale,
                 # on a subset fewer batches queue before the last: its TTFT is not the workload's
                 "ttft_mean_ms": float("nan") if subset else hf_stats["ttft_mean_ms"],
                 "tpot_p50_ms": hf_stats["tpot_p50_ms"], "compiles": 0, "rates": rates(HF_BEST)})
    for name, r in results.items():
        rows.append({"rung": name, **r.stats(), "compiles": sum(p.compiles for p in passes[name]),
                     "rates": rates(name)})
    # Rung 1 differs from rung 0 (HF's best) in more than one thing: its "previous" is HF at rung 1's own
    # dtype and batch, where the sweep has it
    previous = [rows[0], {"tokens_per_s": rung1_baseline.stats()["tokens_per_s"], "rates": rates(HF_AT_RUNG_1)}
                if rung1_baseline else None, *rows[1:-1]]
    for row, prev in zip(rows, previous):
        row["vs_hf"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["range"] = f"{min(row['rates']):.1f}-{max(row['rates']):.1f}"
        if prev is None:
            row["vs_prev"], row["vs_prev_range"], row["resolved"] = float("nan"), "", "n/a"
        elif prev is row:
            row["vs_prev"], row["vs_prev_range"], row["resolved"] = 1.0, "", ""
        else:
            per_pass = [a / b for a, b in zip(row["rates"], prev["rates"])]  # the two rungs of one pass
            row["vs_prev"], row["vs_prev_passes"] = float(np.median(per_pass)), per_pass
            row["vs_prev_range"] = f"{min(per_pass):.2f}-{max(per_pass):.2f}"
            same_side = min(per_pass) > 1 or max(per_pass) < 1
            row["resolved"] = "yes" if same_side else "no: the passes disagree"

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    labels = [r["rung"].split(" (")[0] for r in rows]
    axes[0].barh(labels, [r["vs_hf"] for r in rows], color=["tab:gray"] + ["tab:blue"] * (len(rows) - 1))
    for i, r in enumerate(rows):
        axes[0].text(r["vs_hf"], i, f" {r['vs_hf']:.2f}x ({r['tokens_per_s']:.0f} tok/s)", va="center", fontsize=8)
    axes[0].invert_yaxis(), axes[0].set_xlabel("output tokens/s, multiple of HF generate")
    axes[0].set_xlim(0, max(r["vs_hf"] for r in rows) * 1.35)
    axes[0].set_title("throughput ladder (SmolLM2-135M, this CPU)")
    axes[1].barh(labels, [r["ttft_mean_ms"] / 1e3 for r in rows], color="tab:orange", label="mean TTFT")
    axes[1].invert_yaxis(), axes[1].set_xlabel("mean TTFT (s, all requests queued at t=0)")
    axes[1].set_yticklabels([]), axes[1].set_title("mean time to first token")
    fig.tight_layout()
    fig.savefig(out / "synergy.png", dpi=110)

    last = rows[-1]
    baseline = {"batch": args.slots, "dtype": "float32"}
    if rung1_baseline:
        baseline.update(tokens_per_s=previous[1]["tokens_per_s"], rates=previous[1]["rates"])
    columns = [("rung", "rung", ""), ("tokens_per_s", "output tok/s", ".1f"), ("vs_prev", "vs previous", ".2f"),
               ("vs_prev_range", "vs previous, pass by pass", ""), ("resolved", "every pass agrees", ""),
               ("vs_hf", "vs HF", ".2f"), ("ttft_mean_ms", "mean TTFT (ms)", ".0f"),
               ("tpot_p50_ms", "TPOT p50 (ms)", ".0f"), ("range", "tok/s over passes", ""),
               ("compiles", "compile stalls", "d")]
    body = "\n".join([
        "![throughput ladder](synergy.png)", "",
        f"Workload: {args.requests} requests at t=0, prompts = one of {args.prefixes} shared {args.prefix_len}-token "
        f"system prompts + 8-39 unique tokens, {out_tokens} output tokens (log-normal, mean 40, cap 96); "
        f"SmolLM2-135M (float32 unless a rung says otherwise) on this CPU, greedy, ignore_eos. KV budget: {args.slots} x {MAX_MODEL_LEN} "
        f"(max_model_len) tokens, which a contiguous cache fills with {args.slots} requests and the paged "
        f"cache with {paged_batch} (average request {mean_len:.0f} tokens); the pool holds {kv_tokens} tokens, the "
        f"budget plus one {BLOCK_SIZE}-token block per paged request and the null block for block rounding. Chunk budget {args.chunk} tokens. "
        f"Rung 1 emulates contiguous KV by capping the batch at {args.slots} (see the script's docstring). "
        f"HF runs {len(hf_subset)} of the {args.requests} requests (each step timed through `generate`'s "
        f"streamer hook), torch threads {torch.get_num_threads()}; its sweep (output tok/s): "
        + ", ".join(f"batch {r['batch']} {r['dtype']} {r['tokens_per_s']:.1f}" for r in sweep)
        + "; rung 0 is the fastest. Rungs 1-5 use the pure-JAX attention in float32; "
        + ("rung 6 adds the Pallas kernels." if gpu else "rung 6 adds the native CPU attention kernel, rung 7 "
           "bfloat16 weights and KV cache (float32 accumulation); the Pallas rung runs only on a GPU."), "",
        table(rows, columns), "",
        f"Headline: the full engine serves {last['vs_hf']:.1f}x HF generate's output tokens/s "
        f"({last['tokens_per_s']:.0f} vs {rows[0]['tokens_per_s']:.0f} tok/s); scheduling and memory management "
        f"alone (rung 3 over rung 1): {rows[3]['tokens_per_s'] / rows[1]['tokens_per_s']:.1f}x. (The article: "
        "several-fold; vLLM: up to 24x over HF on a GPU.)", "",
        f"HF's best setting gave {best['tokens_per_s']:.1f} tok/s in its sweep pass and a median of "
        f"{rows[0]['tokens_per_s']:.1f} (passes {rows[0]['range']}) in the timed passes, which run between the "
        f"engine rungs; against its sweep figure the full engine serves "
        f"{last['tokens_per_s'] / best['tokens_per_s']:.1f}x. The headline uses the timed passes, run in turns "
        "with the engine's.", "",
        f"Rung 1's \"vs previous\" is against HF at its own dtype and batch (float32, batch {args.slots}"
        + (f": {baseline['tokens_per_s']:.1f} tok/s, the median of passes {min(baseline['rates']):.1f}-"
           f"{max(baseline['rates']):.1f}" if rung1_baseline else ": not in this run's sweep")
        + "), not against rung 0; each later rung's is against the rung above it. "
        f"Each rung, HF's rung 0 and HF at rung 1's setting included, is the median of {args.passes} passes, the "
        "ladder run forward, then backward, and so on (so a drift in the shared CPU's speed weighs on every "
        "rung); the range over its passes is this CPU's run-to-run noise. \"vs previous\" is the median of the "
        "ratios taken pass by pass, the two rungs having run one after the other, and counts as resolved only "
        "when every pass puts it on the same side of 1. HF's sweep, which picks rung 0, "
        "is one pass per setting, each after an untimed call. For the gain of continuous over static batching at GPU scale (simulated A100 "
        "with OPT-13B), see [batching](batching.md).",
    ])
    write_report("synergy", "Optimizations one at a time", body,
                 {"rows": rows, "hf_sweep": sweep,
                  "hf_best": {"batch": best["batch"], "dtype": best["dtype"]},
                  "rung1_baseline": baseline, "torch_threads": torch.get_num_threads(),
                  "args": vars(args)}, out)


if __name__ == "__main__":
    main()
