"""Load test: many concurrent clients with valid, invalid and abandoned requests against `llmjax serve`.

Starts the server itself (a subprocess: `python -m llmjax.cli serve MODEL ...`), runs the mix
below unmeasured for `--warmup-load` seconds (a fresh server compiles its step shapes under the
first load; failures still count), then for `--duration` seconds each of `--clients` clients
loops over a random mix of:
- valid: streamed completions, non-streamed completions, streamed chat (greedy, `ignore_eos`,
  so every one must finish with "length" and exactly `max_tokens` tokens);
- invalid: bad sampling values, empty or too-long prompts, malformed JSON, unknown model
  (each must get its 4xx OpenAI error, never a 5xx);
- abandoned: streams the client drops after a few chunks, non-streamed requests it times out.
Then it waits for the server to go idle and checks: no valid request failed, nothing running or
waiting, KV usage 0 (cached blocks aside), `/health` 200 (the KV invariants hold). Prints the
p50/p99 latencies and writes the report to `--out` (default results/load.md). Exit status 1 on
any failure.

Usage: python experiments/load.py                      (tiny model, 64 clients, 60 s)
       python experiments/load.py --duration 20
       python experiments/load.py --model smollm2 -- --max-model-len 1024   (server flags after --)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from llmjax.bench import percentiles, stream_completion
from llmjax.serve.metrics import parse_metrics

TINY_SERVER_ARGS = ["--block-size", "8", "--max-model-len", "128", "--kv-cache-memory", str(4 << 20),
                    "--attention-backend", "xla", "--max-num-seqs", "64", "--max-num-batched-tokens", "128"]
MODEL_NAME = "load-test"
LETTERS = "abcdefghijklmnopqrstuvwxyz "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, server_args: list[str], log_file) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmjax.cli", "serve", model, "--port", str(port), "--served-model-name",
           MODEL_NAME, "--uvicorn-log-level", "warning", *server_args]
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)


def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("the server exited during startup")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy in time")


class LoadClient:
    """One client's request mix; results accumulate in the shared `stats`."""

    def __init__(self, client: httpx.AsyncClient, rng: random.Random, max_model_len: int, stats: dict):
        self.client, self.rng, self.max_len, self.stats = client, rng, max_model_len, stats

    def _prompt(self) -> str:
        return "".join(self.rng.choice(LETTERS) for _ in range(self.rng.randint(4, 48)))

    def _valid_body(self) -> dict:
        return {"model": MODEL_NAME, "max_tokens": self.rng.randint(1, 40), "temperature": 0, "ignore_eos": True}

    def _fail(self, kind: str, message: str) -> None:
        self.stats["failures"].append(f"{kind}: {message}")

    async def valid_stream(self) -> None:
        body = self._valid_body() | {"prompt": self._prompt()}
        result = await stream_completion(self.client, body)
        if not result.ok or result.output_tokens != body["max_tokens"]:
            return self._fail("stream", result.error or f"{result.output_tokens} tokens, wanted {body['max_tokens']}")
        self.stats["ttft"].append(result.ttft)
        self.stats["e2e"].append(result.latency)

    async def valid_completion(self) -> None:
        body = self._valid_body() | {"prompt": self._prompt()}
        start = time.perf_counter()
        r = await self.client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return self._fail("completion", f"HTTP {r.status_code} {r.text[:200]}")
        out = r.json()
        if out["choices"][0]["finish_reason"] != "length" or out["usage"]["completion_tokens"] != body["max_tokens"]:
            return self._fail("completion", json.dumps(out)[:200])
        self.stats["e2e"].append(time.perf_counter() - start)

    async def valid_chat_stream(self) -> None:
        body = self._valid_body() | {"messages": [{"role": "user", "content": self._prompt()}], "stream": True,
                                     "stream_options": {"include_usage": True}}
        start, usage, done = time.perf_counter(), None, False
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return self._fail("chat", f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    usage = json.loads(line[6:]).get("usage") or usage
        if not done or usage is None or usage["completion_tokens"] != body["max_tokens"]:
            return self._fail("chat", f"done={done} usage={usage}")
        self.stats["e2e"].append(time.perf_counter() - start)

    async def invalid(self) -> None:
        good = self._valid_body() | {"prompt": "x"}
        bad = self.rng.choice([
            (good | {"temperature": -1}, 400), (good | {"top_p": 2}, 400), (good | {"prompt": ""}, 400),
            (good | {"prompt": "x" * (self.max_len + 10)}, 400), (good | {"max_tokens": self.max_len + 1}, 400),
            (good | {"model": "no-such-model"}, 404), (good | {"n": 3}, 400), (b'{"prompt": ', 400),
            (good | {"max_tokens": "lots"}, 400),
        ])
        body, status = bad
        if isinstance(body, bytes):
            r = await self.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        else:
            r = await self.client.post("/v1/completions", json=body)
        if r.status_code != status or "error" not in r.json():
            self.stats["bad_errors"].append(f"wanted {status}, got {r.status_code}: {r.text[:200]}")

    async def abandoned(self) -> None:
        body = self._valid_body() | {"prompt": self._prompt(), "max_tokens": 60}
        if self.rng.random() < 0.5:
            chunks = self.rng.randint(1, 4)
            async with self.client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                async for line in r.aiter_lines():
                    chunks -= line.startswith("data: ")
                    if chunks == 0:
                        break  # leaving the block drops the connection mid-stream
        else:
            try:
                await self.client.post("/v1/completions", json=body, timeout=self.rng.uniform(0.01, 0.3))
            except httpx.TimeoutException:
                pass

    async def run(self, deadline: float) -> None:
        kinds = [self.valid_stream, self.valid_completion, self.valid_chat_stream, self.invalid, self.abandoned]
        weights = [35, 15, 15, 20, 15]
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                await kind()
            except httpx.HTTPError as exc:
                if kind != self.abandoned:
                    self._fail(kind.__name__, f"{type(exc).__name__}: {exc}")
            self.stats["requests"][kind.__name__] += 1


async def drive(url: str, clients: int, duration: float, seed: int, max_model_len: int) -> dict:
    stats = {"requests": Counter(), "failures": [], "bad_errors": [], "ttft": [], "e2e": []}
    limits = httpx.Limits(max_connections=clients * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        deadline = time.monotonic() + duration
        workers = [LoadClient(client, random.Random(seed + i), max_model_len, stats).run(deadline)
                   for i in range(clients)]
        await asyncio.gather(*workers)
    return stats


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics(httpx.get(f"{url}/metrics").text)
        if m["llmjax:num_requests_running"] == 0 and m["llmjax:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def report(args, stats: dict, m: dict[str, float], health: int, elapsed: float) -> tuple[str, bool]:
    ttft, e2e = percentiles(stats["ttft"]), percentiles(stats["e2e"])
    leaked = m["llmjax:num_requests_running"] or m["llmjax:num_requests_waiting"] or m["llmjax:kv_cache_usage_perc"]
    ok = not stats["failures"] and not stats["bad_errors"] and not leaked and health == 200
    total = sum(stats["requests"].values())
    lines = [
        "# Load test", "",
        f"`python experiments/load.py --duration {args.duration:g} --clients {args.clients} --warmup-load "
        f"{args.warmup_load:g}` against `llmjax serve {args.model}` ({' '.join(args.server_args)}). "
        "Counts and latencies are of the measured phase; failures of both phases count.", "",
        f"- result: **{'PASS' if ok else 'FAIL'}**",
        f"- requests: {total} in {elapsed:.1f} s ({total / elapsed:.1f} req/s): "
        + ", ".join(f"{k} {v}" for k, v in sorted(stats["requests"].items())),
        f"- failed valid requests: {len(stats['failures'])}",
        f"- invalid requests answered wrongly: {len(stats['bad_errors'])}",
        f"- after the run: running {m['llmjax:num_requests_running']:g}, waiting "
        f"{m['llmjax:num_requests_waiting']:g}, KV usage {m['llmjax:kv_cache_usage_perc']:g} "
        f"(cached blocks not counted), /health {health}",
        f"- preemptions {m['llmjax:num_preemptions_total']:g}; prefix cache hit tokens "
        f"{m['llmjax:prefix_cache_hits_total']:g} of {m['llmjax:prefix_cache_queries_total']:g} queried; "
        f"generated tokens {m['llmjax:generation_tokens_total']:g}", "",
        "| latency (ms) | mean | p50 | p90 | p99 |", "|---|---|---|---|---|",
        f"| TTFT (streamed completions) | {ttft['mean']:.1f} | {ttft['p50']:.1f} | {ttft['p90']:.1f} | {ttft['p99']:.1f} |",
        f"| end to end (valid requests) | {e2e['mean']:.1f} | {e2e['p50']:.1f} | {e2e['p90']:.1f} | {e2e['p99']:.1f} |",
    ]
    for title, items in (("Failures", stats["failures"]), ("Wrong error answers", stats["bad_errors"])):
        if items:
            lines += ["", f"## {title}", ""] + [f"- {x}" for x in items[:20]]
    return "\n".join(lines) + "\n", ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gqa")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--warmup-load", type=float, default=15.0, help="seconds of unmeasured load first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", default="results/load.md")
    parser.add_argument("server_args", nargs="*", help="flags for `llmjax serve` (after --); default: tiny settings")
    args = parser.parse_args()
    args.server_args = args.server_args or TINY_SERVER_ARGS

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        server = start_server(args.model, port, args.server_args, log)
        try:
            wait_healthy(url, server, args.startup_timeout)
            max_len = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
            print(f"server up at {url}; {args.clients} clients, {args.warmup_load:g} s warm-up, "
                  f"{args.duration:g} s measured", flush=True)
            warm = asyncio.run(drive(url, args.clients, args.warmup_load, args.seed + 10_000, max_len))
            start = time.monotonic()
            stats = asyncio.run(drive(url, args.clients, args.duration, args.seed, max_len))
            stats["failures"] += warm["failures"]
            stats["bad_errors"] += warm["bad_errors"]
            elapsed = time.monotonic() - start
            m = wait_idle(url)
            health = httpx.get(f"{url}/health").status_code
        finally:
            server.terminate()
            server.wait(30)
            log.seek(0)
            server_log = log.read()
    text, ok = report(args, stats, m, health, elapsed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    if not ok:
        print("server log (tail):\n" + server_log[-3000:])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
