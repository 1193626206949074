"""Router overhead: what relaying streams through `llmjax router` costs, against the replica direct.

Starts `llmjax cluster MODEL --replicas 1` (a subprocess: the router in the main process, the
replica in a child; a tiny random-weight model by default, so the host's work per token dominates)
and runs `llmjax bench`'s random workload from this process, in alternating order over `--rounds`
rounds, through the router and straight to the replica: `--num-prompts` streamed completions of
`--input-len` prompt and `--output-len` output tokens, `--concurrency` in flight,
`--stream-interval 1` (an SSE event per token: the router relays every one).

Measured per run: output tokens per second, TTFT and TPOT p50, and the router process's CPU time
per output token (from /proc; the replica's process is not in it). On this machine the router
shares the cores with the replica and the client, so its CPU is taken from them.

Usage: python experiments/router_overhead.py            (3 rounds; ~3 min)
       python experiments/router_overhead.py --quick    (smoke run into build/results-quick/)
Writes results/router_overhead.md, .json and .png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


from common import (add_stream_args, alternating, change, cpu_seconds, free_port,  # experiments/common.py
                    medians_by, plot_bars, results_dir, server_process, stream_server_args,
                    table, write_report)

from llmjax.bench import add_bench_args, run_bench
from llmjax.cli_types import parse_quick

PATHS = ("direct", "router")


def bench(url: str, args: argparse.Namespace, num_prompts: int, output_len: int, seed: int) -> dict:
    """`llmjax bench`'s random workload from `seed` (each run its own prompts: none finds another's in the
    replica's prefix cache)."""
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    summary = run_bench(parser.parse_args([
        "--base-url", url, "--num-prompts", str(num_prompts), "--random-input-len", str(args.input_len),
        "--random-output-len", str(output_len), "--max-concurrency", str(args.concurrency), "--seed", str(seed)]))
    if summary["failed"]:
        raise SystemExit(f"{url}: {summary['failed']} requests failed: {summary['errors']}")
    return summary


def run_one(path: str, urls: dict[str, str], router_pid: int, args: argparse.Namespace, seed: int) -> dict:
    before = cpu_seconds(router_pid)
    summary = bench(urls[path], args, args.num_prompts, args.output_len, seed)
    router_cpu = cpu_seconds(router_pid) - before
    return {"path": path, "tok_s": summary["output_throughput"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"],
            "router_us_per_token": 1e6 * router_cpu / summary["total_output_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stream_args(ap, num_prompts=384, quick_help="one round, 32 streams of 16 tokens")
    args = parse_quick(ap, dict(rounds=1, num_prompts=32, concurrency=32, output_len=16))
    replica_port = free_port(2)  # the replica's port, then the router's
    port = replica_port + 1
    urls = {"router": f"http://127.0.0.1:{port}", "direct": f"http://127.0.0.1:{replica_port}"}
    cmd = [sys.executable, "-m", "llmjax.cli", "cluster", args.model, "--replicas", "1", "--port", str(port),
           "--replica-base-port", str(replica_port), "--stream-interval", "1", *stream_server_args(args)]
    runs = []
    with tempfile.NamedTemporaryFile("w", prefix="router-overhead-", suffix=".log", delete=False) as log, \
            server_process(cmd, urls["router"], log) as router:
        print(f"warm-up through the router (cluster log: {log.name})", flush=True)
        bench(urls["router"], args, min(args.concurrency, 64), 8, args.seed)
        for round_, path in alternating(PATHS, args.rounds):
            print(f"round {round_ + 1}/{args.rounds}: {path}", flush=True)
            runs.append(run_one(path, urls, router.pid, args, args.seed + 1 + len(runs)))
    rows = medians_by(runs, "path", PATHS, ("tok_s", "ttft_p50_ms", "tpot_p50_ms", "router_us_per_token"))
    direct, routed = rows
    for row in rows:
        row["vs_direct"] = row["tok_s"] / direct["tok_s"]
    out = results_dir(quick=args.quick)
    out.mkdir(parents=True, exist_ok=True)
    plot_bars(out / "router_overhead.png", rows, runs, "path", [
        ("tok_s", "output tokens / s"), ("tpot_p50_ms", "TPOT p50 (ms)"),
        ("router_us_per_token", "router CPU µs per output token")])
    findings = [change(what, direct[key], routed[key], unit, digits, tolerance=0.05) for what, key, unit, digits in (
        ("output throughput", "tok_s", "tok/s", 0), ("TPOT p50", "tpot_p50_ms", "ms", 1),
        ("TTFT p50", "ttft_p50_ms", "ms", 0))]
    columns = [("path", "path", ""), ("tok_s", "output tok/s", ".0f"), ("vs_direct", "vs direct", ".2f"),
               ("ttft_p50_ms", "TTFT p50 ms", ".0f"), ("tpot_p50_ms", "TPOT p50 ms", ".1f"),
               ("router_us_per_token", "router CPU µs / token", ".1f")]
    command = " ".join(["python experiments/router_overhead.py", *sys.argv[1:]])
    body = (f"`{command}`\n\n"
            f"`llmjax cluster {args.model} --replicas 1 --stream-interval 1`; per run, {args.num_prompts} streamed "
            f"completions of {args.input_len} prompt and {args.output_len} output tokens, {args.concurrency} in "
            "flight, through the router or straight to the replica, in alternating order; medians over "
            f"{args.rounds} round(s) (every run is in the JSON).\n\n{table(rows, columns)}\n\n"
            f"Through the router instead of direct: {'; '.join(findings)}; the router spends "
            f"{routed['router_us_per_token']:.1f} µs of CPU per relayed token. A change within 5% counts as none. "
            f"The router, the replica and this client share this machine's {os.cpu_count()} cores, so the router's "
            "CPU is taken from the replica's: the throughput and latency costs include that, and a router with "
            "cores of its own would cost less.\n\n"
            "![throughput, TPOT, router CPU](router_overhead.png)")
    write_report("router_overhead", "Router overhead on streams", body, {"args": vars(args), "runs": runs,
                                                                        "rows": rows}, out)


if __name__ == "__main__":
    main()
