"""Bench client: what the load generator's HTTP client costs, and what it hides of the server.

`llmjax bench` streams its requests through aiohttp (`llmjax.bench.stream_completion`). This runs
that function and the same loop written on httpx (`aiter_lines`, as `llmjax bench` once did)
against one `llmjax serve` (a subprocess, a tiny random-weight model by default, so the host's work
per token dominates), in alternating order over `--rounds` rounds: `--num-prompts` streamed
completions of `--input-len` random prompt ids and `--output-len` tokens (`ignore_eos`),
`--concurrency` in flight, `--stream-interval 1` (one SSE event per token). Both clients open a
connection per request and parse every event's JSON.

Measured per run: the client's CPU time per SSE event (this process, `time.process_time`), output
tokens per second, and the server process's CPU per output token (from /proc). On a machine the
client shares with the server, every CPU second the client spends is taken from the server, so a
costlier client understates the server's throughput.

Usage: python experiments/bench_client.py            (3 rounds; ~3 min)
       python experiments/bench_client.py --quick    (smoke run into build/results-quick/)
Writes results/bench_client.md, .json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

import httpx
import numpy as np

from common import (add_stream_args, alternating, change, cpu_seconds, free_port,  # experiments/common.py
                    medians_by, plot_bars, results_dir, server_process, stream_server_args,
                    table, write_report)

from llmjax.bench import RequestResult, error_text, stream_completion, stream_session
from llmjax.cli_types import parse_quick

CLIENTS = ("httpx", "aiohttp")


async def httpx_stream(client: httpx.AsyncClient, payload: dict) -> RequestResult:
    """`stream_completion` on httpx: the same request, parsing, timing and rules for a failed one."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    result, start = RequestResult(), time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if line.startswith("data: [DONE]"):
                    break
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = error_text(chunk["error"])
                    return result
                result.add_event(chunk, start)
    except Exception as exc:  # a broken stream or a malformed event: this request only
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.last_event is not None and result.usage_seen
    result.error = "" if result.ok else "no output" if result.last_event is None else "no usage in the stream"
    return result


async def drive(kind: str, url: str, payloads: list[dict], concurrency: int) -> list[RequestResult]:
    """Every payload as a stream through client `kind`, `concurrency` at a time."""
    limit = asyncio.Semaphore(concurrency)
    if kind == "httpx":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits)
        send = lambda p: httpx_stream(client, p)  # noqa: E731
    else:
        client = stream_session(url)
        send = lambda p: stream_completion(client, p)  # noqa: E731

    async def one(payload: dict) -> RequestResult:
        async with limit:
            return await send(payload)

    try:
        return await asyncio.gather(*map(one, payloads))
    finally:
        await (client.aclose() if kind == "httpx" else client.close())


def run_one(kind: str, url: str, server_pid: int, payloads: list[dict], concurrency: int) -> dict:
    server0, client0, wall0 = cpu_seconds(server_pid), time.process_time(), time.perf_counter()
    results = asyncio.run(drive(kind, url, payloads, concurrency))
    server1, client1, wall1 = cpu_seconds(server_pid), time.process_time(), time.perf_counter()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{kind}: {len(failed)} requests failed: {sorted(set(failed))[:5]}")
    tokens = sum(r.output_tokens for r in results)
    events = sum(r.events for r in results)  # every JSON event, the usage chunk included ([DONE] is not parsed)
    return {"client": kind, "tok_s": tokens / (wall1 - wall0), "events": events,
            "client_us_per_event": 1e6 * (client1 - client0) / events,
            "server_us_per_token": 1e6 * (server1 - server0) / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stream_args(ap, num_prompts=384, quick_help="one round, 32 streams of 16 tokens")
    args = parse_quick(ap, dict(rounds=1, num_prompts=32, concurrency=32, output_len=16))
    rng = np.random.default_rng(args.seed)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "llmjax.cli", "serve", args.model, "--port", str(port), "--stream-interval", "1",
           *stream_server_args(args)]
    runs = []
    with tempfile.NamedTemporaryFile("w", prefix="bench-client-", suffix=".log", delete=False) as log, \
            server_process(cmd, url, log) as server:
        warm = [{"prompt": rng.integers(1, 50, args.input_len).tolist(), "max_tokens": 8, "ignore_eos": True}
                for _ in range(min(args.concurrency, 64))]
        run_one("aiohttp", url, server.pid, warm, args.concurrency)  # compiles the server's step shapes
        for round_, kind in alternating(CLIENTS, args.rounds):
            print(f"round {round_ + 1}/{args.rounds}: {kind} (server log: {log.name})", flush=True)
            payloads = [{"prompt": rng.integers(1, 50, args.input_len).tolist(), "max_tokens": args.output_len,
                         "ignore_eos": True} for _ in range(args.num_prompts)]
            runs.append(run_one(kind, url, server.pid, payloads, args.concurrency))
            print(f"  {runs[-1]['tok_s']:.0f} tok/s, client {runs[-1]['client_us_per_event']:.1f} µs per event",
                  flush=True)
    rows = medians_by(runs, "client", CLIENTS, ("tok_s", "client_us_per_event", "server_us_per_token", "events"))
    out = results_dir(quick=args.quick)
    out.mkdir(parents=True, exist_ok=True)
    plot_bars(out / "bench_client.png", rows, runs, "client", [
        ("client_us_per_event", "client CPU µs per SSE event"), ("tok_s", "output tokens / s"),
        ("server_us_per_token", "server CPU µs per output token")])
    before, after = rows
    findings = [change(what, before[key], after[key], unit, digits, tolerance=0.05) for what, key, unit, digits in (
        ("the client's CPU per SSE event", "client_us_per_event", "µs", 1),
        ("the measured output throughput", "tok_s", "tok/s", 0),
        ("the server's CPU per output token", "server_us_per_token", "µs", 1))]
    columns = [("client", "client", ""), ("client_us_per_event", "client CPU µs / event", ".1f"),
               ("tok_s", "output tok/s", ".0f"), ("server_us_per_token", "server CPU µs / token", ".1f"),
               ("events", "events per run", ".0f")]
    command = " ".join(["python experiments/bench_client.py", *sys.argv[1:]])
    body = (f"`{command}`\n\n"
            f"One `llmjax serve {args.model} --stream-interval 1`; per run, {args.num_prompts} streamed completions of "
            f"{args.input_len} prompt and {args.output_len} output tokens, {args.concurrency} in flight, through httpx "
            "or through `llmjax bench`'s aiohttp streams, in alternating order; medians over "
            f"{args.rounds} round(s) (every run is in the JSON).\n\n{table(rows, columns)}\n\n"
            f"From httpx to aiohttp: {'; '.join(findings)}. A change within 5% counts as none.\n\n"
            "![client CPU, throughput, server CPU](bench_client.png)")
    write_report("bench_client", "The bench client's cost", body, {"args": vars(args), "runs": runs, "rows": rows},
                 out)


if __name__ == "__main__":
    main()
