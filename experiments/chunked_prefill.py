"""Chunked prefill: the token budget trades long prompts' TTFT for running requests' inter-token latency.

Workload: a pool of running decodes (short prompts, long outputs, all arriving at the start) and long
prompts arriving among them (Poisson). Without chunking a long prompt's whole prefill shares one step
with the decodes, so every running request waits that step out: a spike in inter-token latency (ITL).
With chunked prefill at most `max_num_batched_tokens` tokens run per step, decodes first: a smaller
budget splits the prompt into more, cheaper steps (lower p99 ITL of the decodes) but the prompt needs
more steps to reach its first token (higher TTFT).

Swept: the budget, plus "no chunking" (budget = max_model_len, whole prompts). Measured: mean and p99
TTFT of the long prompts, p99 and max ITL of the decodes, output tokens/s. Two worlds:
1. the real engine on this CPU, preset `tiny-gqa`, wall clock (`common.replay_engine`);
2. the simulator, OPT-13B on an A100-40GB cost model (`llmjax.sim.A100_40GB_OPT_13B`).

    python experiments/chunked_prefill.py [--budgets 64,128,256] [--sim-budgets 128,256,512,1024,2048] [--quick]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from common import EngineConfig, TraceRequest, alternating, change, make_engine, medians_by, replay_engine, \
    replay_sim, results_dir, table, warm_engine, write_report  # noqa: E402
from llmjax.cli_types import non_negative_int, parse_quick, positive_int, positive_int_list  # noqa: E402
from paper_repro.traces import poisson_arrivals, random_tokens  # noqa: E402


def workload(seed: int, vocab: int, decodes: int, decode_out: int, longs: int, long_len: int,
             rate: float, start: float) -> list[TraceRequest]:
    """`decodes` requests (32-token prompts, `decode_out` outputs) at t=0, then `longs` prompts of `long_len`
    tokens (8-token outputs) arriving at `rate`/s from `start`."""
    rng = np.random.default_rng(seed)
    reqs = [TraceRequest(f"dec{i}", 0.0, random_tokens(rng, 32, vocab), decode_out) for i in range(decodes)]
    arrivals = start + poisson_arrivals(rng, longs, rate)
    return reqs + [TraceRequest(f"long{i}", float(t), random_tokens(rng, long_len, vocab), 8)
                   for i, t in enumerate(arrivals)]


def measure(replay, label: str, budget: int) -> dict:
    """TTFT of the long prompts; ITL of the decodes while long prompts are being served."""
    longs = [t for t in replay.timings if t.request_id.startswith("long")]
    window = (min(t.arrival for t in longs), max(t.token_times[0] for t in longs))
    itl = np.concatenate([np.diff(t.token_times)[(np.array(t.token_times[1:]) >= window[0])
                                                 & (np.array(t.token_times[1:]) <= window[1])]
                          for t in replay.timings if t.request_id.startswith("dec")])
    if not itl.size:
        raise RuntimeError(f"{label}: no decode token fell while the long prompts were served (the decodes "
                           "finished first); give the decodes more output tokens")
    ttft = np.array([t.ttft for t in longs]) * 1e3
    return {"budget": label, "tokens": budget, "ttft_mean_ms": ttft.mean(), "ttft_p99_ms": np.percentile(ttft, 99),
            "itl_p50_ms": np.percentile(itl, 50) * 1e3, "itl_p99_ms": np.percentile(itl, 99) * 1e3,
            "itl_max_ms": itl.max() * 1e3, "tokens_per_s": replay.stats()["tokens_per_s"],
            "preemptions": replay.extra["preemptions"], "prefill_fill": replay.extra.get("prefill_fill")}


def sweep(budgets: list[int], max_model_len: int, slots: int, run, passes: int = 1) -> list[dict]:
    """A row per budget (those below `max_model_len`, then no chunking): `run(config, label)`'s replay
    measured `passes` times, the budgets in turn, forward then backward (a drift of the shared machine
    falls on all of them alike); each value the median over the passes, `ranges` the span of the two
    headline values over them."""
    base = EngineConfig(max_model_len=max_model_len, max_num_seqs=slots, enable_prefix_caching=False)
    chunked = [b for b in budgets if b < max_model_len]
    labels = {b: (str(b) if b < max_model_len else f"no chunking ({b})") for b in chunked + [max_model_len]}
    runs = []
    for k, b in alternating(list(labels), passes):
        cfg = base.replace(max_num_batched_tokens=b, enable_chunked_prefill=b < max_model_len)
        label = f"budget {b}" if b < max_model_len else "no chunking"
        runs.append(measure(run(cfg, f"{label}, pass {k + 1}/{passes}"), labels[b], b))
    keys = tuple(key for key in runs[0] if key not in ("budget", "tokens") and runs[0][key] is not None)
    rows = medians_by(runs, "budget", list(labels.values()), keys)
    for row, b in zip(rows, labels):
        row["tokens"] = b
        mine = [r for r in runs if r["budget"] == row["budget"]]
        row["ranges"] = {key: [min(r[key] for r in mine), max(r[key] for r in mine)]
                         for key in ("ttft_mean_ms", "itl_p99_ms")}
    return rows


COLUMNS = [("budget", "token budget", ""), ("ttft_mean_ms", "long-prompt TTFT mean (ms)", ".0f"),
           ("ttft_p99_ms", "TTFT p99 (ms)", ".0f"), ("itl_p50_ms", "decode ITL p50 (ms)", ".1f"),
           ("itl_p99_ms", "ITL p99 (ms)", ".1f"), ("itl_max_ms", "ITL max (ms)", ".1f"),
           ("tokens_per_s", "output tok/s", ".1f"), ("preemptions", "preemptions", "g")]
# the CPU's rows are medians over passes: the span of the headline values over them too
CPU_COLUMNS = COLUMNS + [("ttft_span", "TTFT mean over passes (ms)", ""), ("itl_span", "ITL p99 over passes (ms)", ""),
                         ("prefill_fill", "prompt steps' bucket fill", ".0%")]
SIM_DECODES = 12


def record_prompt_step_fill(engine) -> list[int]:
    """Wrap the runner's `dispatch` so that the returned [computed, run] counts, over the steps
    that carry a prompt chunk, the tokens they compute and the tokens of their buckets (a step runs
    padded to a power-of-two token count, `llmjax.buckets`)."""
    counts, dispatch = [0, 0], engine.runner.dispatch

    def recorded(out, *args, **kwargs):
        if out.num_decodes < len(out.requests):
            counts[0] += int(out.num_new_tokens.sum())
            counts[1] += out.bucket[0]
        return dispatch(out, *args, **kwargs)

    engine.runner.dispatch = recorded
    return counts


def padding_note(cpu: list[dict]) -> str:
    """What the CPU rows owe to padding: a step runs in a power-of-two token bucket, so a budget's
    prompt steps may fill their buckets better than unchunked ones; names the budgets whose passes
    all beat no chunking on both TTFT and p99 ITL."""
    base = cpu[-1]
    both = [r["budget"] for r in cpu[:-1]
            if r["ranges"]["ttft_mean_ms"][1] < base["ranges"]["ttft_mean_ms"][0]
            and r["ranges"]["itl_p99_ms"][1] < base["ranges"]["itl_p99_ms"][0]]
    fills = ", ".join(f"{r['budget']}: {r['prefill_fill']:.0%}" for r in cpu)
    text = ("This engine runs a step padded to a power-of-two token count, so a step's cost follows its bucket, "
            f"not only the tokens it computes. Tokens computed over tokens run in the steps that carry a prompt chunk: "
            f"{fills}. ")
    if not both:
        return text + "No budget beat no chunking on both TTFT and p99 ITL in every pass."
    return text + (f"Budget {', '.join(both)} beat no chunking on both mean TTFT and p99 ITL in every pass, "
                   f"where the trade would have it lose on TTFT: the unchunked prompt steps filled "
                   f"{base['prefill_fill']:.0%} of their buckets, so against this baseline chunking's effect is mixed "
                   "with padding's.")


def plot(worlds: dict[str, list[dict]], path) -> None:
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5))
    for ax, (world, rows) in zip(axes, worlds.items()):
        x, y = [r["itl_p99_ms"] for r in rows], [r["ttft_mean_ms"] for r in rows]
        ax.plot(x[:-1], y[:-1], "o-", label="chunked prefill")
        ax.plot(x[-1:], y[-1:], "s", color="tab:red", ms=9, label="no chunking")
        for r, xi, yi in zip(rows, x, y):
            ax.annotate(r["budget"].split(" ")[0] if r["budget"][0].isdigit() else "", (xi, yi),
                        textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel("p99 inter-token latency of running decodes (ms)")
        ax.set_ylabel("mean TTFT of long prompts (ms)")
        ax.set_title(world, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("Chunked prefill: token budget (labels) trades TTFT for ITL")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=positive_int_list, default="64,128,256")
    ap.add_argument("--sim-budgets", type=positive_int_list, default="128,256,512,1024,2048")
    ap.add_argument("--seed", type=non_negative_int, default=0)
    ap.add_argument("--passes", type=positive_int, default=3,
                    help="passes of every CPU budget, in turn (the simulator is deterministic: one)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one CPU budget, shorter decodes, two simulated "
                    "budgets; written to build/results-quick/")
    args = parse_quick(ap, dict(budgets=[64], sim_budgets=[256, 1024], passes=1))
    out = results_dir(args.quick)
    cpu_decode_out = 400 if args.quick else 700  # enough that the decodes outlast the long prompts' arrivals
    budgets, sim_budgets = args.budgets, args.sim_budgets

    cpu_trace = workload(args.seed, 512, decodes=16, decode_out=cpu_decode_out, longs=8, long_len=250, rate=8.0,
                         start=0.1)

    def run_cpu(cfg, label):
        engine = make_engine("tiny-gqa", cfg.replace(kv_cache_memory_bytes=64 << 20))
        warm_engine(engine, cpu_trace)
        fill = record_prompt_step_fill(engine)
        replay = replay_engine(engine, cpu_trace, progress=f"CPU {label}")
        replay.extra["prefill_fill"] = fill[0] / fill[1]
        return replay

    # 12 decodes of at most 632 tokens (7,584) leave room for four long prompts of 1,808 tokens at once in
    # the simulated A100's 15,728-token KV pool, so the budget's effect is measured without preemption
    # (recompute) stalls mixed in (16 decodes preempted at some budgets); each row counts them all the same
    sim_trace = workload(args.seed, 50000, decodes=SIM_DECODES, decode_out=600, longs=30, long_len=1800, rate=1.0,
                         start=2.0)
    worlds = {
        "real engine on this CPU (tiny-gqa)": sweep(budgets, 1024, 32, run_cpu, args.passes),
        "simulated A100-40GB + OPT-13B": sweep(sim_budgets, 4096, 64,
                                               lambda cfg, label: replay_sim(cfg.replace(), sim_trace,
                                                                             progress=f"sim {label}")),
    }
    out.mkdir(parents=True, exist_ok=True)
    plot(worlds, out / "chunked_prefill.png")
    cpu, sim = worlds.values()
    lo, nc = sim[0], sim[-1]
    for row in cpu:
        row["ttft_span"] = "{:.0f}-{:.0f}".format(*row["ranges"]["ttft_mean_ms"])
        row["itl_span"] = "{:.1f}-{:.1f}".format(*row["ranges"]["itl_p99_ms"])
    preempted = [r["budget"] for r in sim if r["preemptions"]]
    body = "\n".join([
        "![TTFT vs p99 ITL](chunked_prefill.png)", "",
        f"## Real engine on this CPU: tiny-gqa, 16 running decodes ({cpu_decode_out} tokens each) and 8 prompts of 250 "
        f"tokens arriving at 8/s; each value the median of {args.passes} passes, the budgets in turn", "",
        table(cpu, CPU_COLUMNS), "",
        f"## Simulated A100-40GB + OPT-13B: {SIM_DECODES} running decodes (600 tokens) and 30 prompts of 1800 "
        "tokens at 1/s", "",
        table(sim, COLUMNS), "",
        "ITL is measured over the decodes' tokens produced while long prompts were arriving and prefilling. "
        "Preemptions (a request's KV freed and recomputed when the pool runs short) stall the decodes too: "
        "each row counts them, so a budget's effect can be told from theirs"
        + (f" (simulated rows with preemptions: {', '.join(preempted)})." if preempted else
           "; the simulated pool holds the workload, so no simulated row has any."), "",
        f"Headline (simulated A100): budget {lo['budget']} against no chunking "
        f"{change('the decodes p99 ITL', nc['itl_p99_ms'], lo['itl_p99_ms'], 'ms')} and "
        f"{change('the long prompts mean TTFT', nc['ttft_mean_ms'], lo['ttft_mean_ms'], 'ms')}; on the CPU engine "
        f"budget {cpu[0]['budget']} {change('p99 ITL', cpu[-1]['itl_p99_ms'], cpu[0]['itl_p99_ms'], 'ms')} and "
        f"{change('mean TTFT', cpu[-1]['ttft_mean_ms'], cpu[0]['ttft_mean_ms'], 'ms')}.", "",
        padding_note(cpu),
    ])
    write_report("chunked_prefill", "Chunked prefill: token budget sweep", body, worlds, out)


if __name__ == "__main__":
    main()
