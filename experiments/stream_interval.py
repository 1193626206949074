"""Stream interval: what `--stream-interval N` buys a server under many concurrent streams.

Per run, a fresh `llmjax serve` (a subprocess; a tiny random-weight model by default, so the host's
work per token is large against the model's) serves `llmjax bench`'s random workload from this
process: `--num-prompts` streamed completions of `--input-len` prompt tokens and `--output-len`
output tokens, `--concurrency` in flight. The server's `--max-num-seqs` is the concurrency, so every
stream decodes in every step. Each interval runs `--rounds` times, the intervals in ascending order
in even rounds and descending in odd ones (so a drift of the shared machine falls on every interval
alike); each figure is the median over the rounds.

Measured per run: output tokens per second; TPOT (per request: (latency - TTFT) / (tokens - 1)) and
the time between SSE events, p50; SSE events per request (a stream that lags behind merges the
deltas it has not read into one event, so at N = 1 this can fall below the tokens per request); CPU
seconds per 1,000 output tokens of the server's event loop (its main thread: uvicorn, the SSE
responses), of the whole server process (with the engine thread and XLA's threads) and of the
client (this process: the bench's HTTP streams), read from /proc (Linux) around the bench.

Usage: python experiments/stream_interval.py            (intervals 1, 2, 4, 8; 3 rounds; ~7 min)
       python experiments/stream_interval.py --quick    (smoke run into build/results-quick/)
       python experiments/stream_interval.py --model smollm2 --concurrency 64 --output-len 64
Writes results/stream_interval.md, .json and .png.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common import (add_stream_args, alternating, change, cpu_seconds, free_port,  # experiments/common.py
                    medians_by, results_dir, server_process, stream_server_args, table,
                    write_report)

from llmjax.bench import add_bench_args, run_bench  # noqa: E402
from llmjax.cli_types import parse_quick, positive_int_list  # noqa: E402

def run_one(args: argparse.Namespace, interval: int, log) -> dict:
    """One fresh server at `interval`, one bench against it; the run's figures."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "llmjax.cli", "serve", args.model, "--port", str(port), "--stream-interval",
           str(interval), *stream_server_args(args), *args.server_args]
    with server_process(cmd, url, log) as server:
        parser = argparse.ArgumentParser()
        add_bench_args(parser)
        bench_args = parser.parse_args(["--base-url", url, "--num-prompts", str(args.num_prompts), "--random-input-len",
                                        str(args.input_len), "--random-output-len", str(args.output_len),
                                        "--max-concurrency", str(args.concurrency), "--seed", str(args.seed)])
        loop0, server0, client0 = cpu_seconds(server.pid, server.pid), cpu_seconds(server.pid), time.process_time()
        summary = run_bench(bench_args)
        loop1, server1, client1 = cpu_seconds(server.pid, server.pid), cpu_seconds(server.pid), time.process_time()
    if summary["failed"]:
        raise SystemExit(f"interval {interval}: {summary['failed']} requests failed: {summary['errors']}")
    per_k = 1000 / summary["total_output_tokens"]
    return {"interval": interval, "tok_s": summary["output_throughput"], "tpot_p50_ms": summary["tpot_ms"]["p50"],
            "event_gap_p50_ms": summary["itl_ms"]["p50"], "events": summary["stream_events_per_request"],
            "loop_cpu": (loop1 - loop0) * per_k, "server_cpu": (server1 - server0) * per_k,
            "client_cpu": (client1 - client0) * per_k}


def summarize_runs(runs: list[dict], intervals: list[int]) -> list[dict]:
    """Per interval, the median of each figure over its runs and the range of its tok/s; `speedup`: its
    median tok/s over the first interval's (1 by default)."""
    rows = medians_by(runs, "interval", intervals, tuple(k for k in runs[0] if k != "interval"))
    for row in rows:
        mine = [r["tok_s"] for r in runs if r["interval"] == row["interval"]]
        row["tok_s_range"] = f"{min(mine):.0f}-{max(mine):.0f}"
        row["speedup"] = row["tok_s"] / rows[0]["tok_s"]
    return rows


def plot(rows: list[dict], runs: list[dict], path: Path) -> None:
    xs = [r["interval"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(xs, [r["tok_s"] for r in rows], "o-", label="median")
    for x in xs:
        mine = [r["tok_s"] for r in runs if r["interval"] == x]
        left.plot([x] * len(mine), mine, "k.", alpha=0.5, label="runs" if x == xs[0] else None)
    left.legend()
    left.set(xscale="log", xlabel="--stream-interval", ylabel="output tokens / s", title="throughput", ylim=(0, None))
    for key, label in (("loop_cpu", "server event loop"), ("server_cpu", "server process"), ("client_cpu", "client")):
        right.plot(xs, [r[key] for r in rows], "o-", label=label)
    right.set(xscale="log", xlabel="--stream-interval", ylabel="CPU s per 1,000 output tokens", title="CPU",
              ylim=(0, None))
    for ax in (left, right):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stream_args(ap, num_prompts=512, quick_help="intervals 1 and 4, one round, 64 streams of 32 tokens")
    ap.add_argument("--intervals", type=positive_int_list, default="1,2,4,8")
    ap.add_argument("server_args", nargs="*", help="more flags for the server (after --)")
    args = parse_quick(ap, dict(intervals=[1, 4], rounds=1, num_prompts=64, concurrency=64, output_len=32))
    intervals = args.intervals
    runs = []
    with tempfile.NamedTemporaryFile("w", prefix="stream-interval-", suffix=".log", delete=False) as log:
        for round_, n in alternating(intervals, args.rounds):
            print(f"round {round_ + 1}/{args.rounds}: --stream-interval {n} (server log: {log.name})", flush=True)
            runs.append(run_one(args, n, log))
    rows = summarize_runs(runs, intervals)
    out = results_dir(quick=args.quick)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, runs, out / "stream_interval.png")
    columns = [("interval", "--stream-interval", ""), ("tok_s", "output tok/s", ".0f"),
               ("tok_s_range", "range over runs", ""),
               ("speedup", f"vs interval {intervals[0]}", ".2f"), ("tpot_p50_ms", "TPOT p50 ms", ".1f"),
               ("event_gap_p50_ms", "time between events p50 ms", ".1f"), ("events", "events per request", ".1f"),
               ("loop_cpu", "event loop CPU s / 1k tokens", ".3f"), ("server_cpu", "server CPU s / 1k tokens", ".3f"),
               ("client_cpu", "client CPU s / 1k tokens", ".3f")]
    first, last = rows[0], rows[-1]

    def finding(what: str, key: str, unit: str, digits: int) -> str:
        """The change of `key`'s median from the first interval to the last, counted only when the two
        intervals' runs do not overlap."""
        a, b = ([r[key] for r in runs if r["interval"] == row["interval"]] for row in (first, last))
        if max(min(a), min(b)) <= min(max(a), max(b)):
            return (f"leaves {what} within the runs' spread ({first[key]:.{digits}f} -> {last[key]:.{digits}f} "
                    f"{unit}, ranges overlapping)").replace(" ,", ",")
        return change(what, first[key], last[key], unit, digits, tolerance=0.0)

    findings = [finding(what, key, unit, digits) for what, key, unit, digits in (
        ("output throughput", "tok_s", "tok/s", 0), ("SSE events per request", "events", "", 1),
        ("the event loop's CPU per 1k tokens", "loop_cpu", "s", 3),
        ("the server process's CPU per 1k tokens", "server_cpu", "s", 3),
        ("the client's CPU per 1k tokens", "client_cpu", "s", 3), ("TPOT p50", "tpot_p50_ms", "ms", 1))]
    command = " ".join(["python experiments/stream_interval.py", *sys.argv[1:]])
    body = (f"`{command}`\n\n"
            f"`llmjax serve {args.model}` with `--stream-interval` N, a fresh server per run, against `llmjax bench`: "
            f"{args.num_prompts} streamed completions of {args.input_len} prompt and {args.output_len} output tokens, "
            f"{args.concurrency} in flight (the server's `--max-num-seqs`, so every stream decodes in every step). "
            f"Medians over {args.rounds} round(s), intervals ascending in even rounds and descending in odd ones. "
            "CPU: the server's event loop (its main thread), the whole server process, and the client, per 1,000 "
            "output tokens. Events per request can fall below the tokens per request at N = 1: a stream that lags "
            "behind gets the deltas it has not read merged into one event.\n\n"
            f"{table(rows, columns)}\n\n"
            f"From N = {first['interval']} to N = {last['interval']}: {'; '.join(findings)}. A change counts only "
            "when the two intervals' runs do not overlap (every run is in the JSON).\n\n"
            "![throughput and CPU](stream_interval.png)")
    write_report("stream_interval", "Stream interval under concurrent streams", body,
                 {"args": vars(args), "runs": runs, "rows": rows}, out)


if __name__ == "__main__":
    main()
