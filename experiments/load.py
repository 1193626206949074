"""Load test: many concurrent clients with valid, poison and abandoned requests against `llmjax
cluster` (two replicas behind the router), one replica killed with SIGKILL mid-run.

Starts the cluster itself (a subprocess: `python -m llmjax.cli cluster MODEL --replicas 2 ...`),
whose replicas warm up (compile their step shapes) before they answer `/health`, runs the mix
below unmeasured for `--warmup-load` seconds (failures still count), then for `--duration` seconds each of
`--clients` clients loops over a random mix of:
- valid: streamed and non-streamed completions, streamed chat (greedy, `ignore_eos`, so each must
  finish with "length" and exactly `max_tokens` tokens); sampling options (presence, frequency
  and repetition penalties, logit_bias, min_tokens, seeds above 32 bits); `n` > 1 (n choices of
  `max_tokens` tokens each);
- poison: values that once overflowed the sampler (`top_k` 2147483648; `seed` 1099511627776 is
  valid and must succeed), out-of-range and mistyped values, unknown fields, token ids outside
  the vocabulary, malformed JSON, unknown model (each must get its 4xx OpenAI error);
- abandoned: streams the client drops after a few chunks, non-streamed requests it times out.
A third of the way into the measured phase one replica gets SIGKILL: requests that had not
started streaming must still succeed (the router retries them on the other replica); streams it
had started may end with an error event (counted apart). The cluster restarts the replica.
A separate process fetches every replica's `/health` every 50 ms throughout.

Then it waits for the killed replica to be back and every replica to go idle, and checks: no
valid request failed, every poison request got its 4xx, nothing running or waiting and KV usage 0
on every replica (cached blocks aside), `/debug/kv_invariants` 200, the replica restarted, and
`/health` p99 under 50 ms with no non-200 answer. Writes results/load.md, .json and .png
(`llmjax/provenance.py` stamps them). Exit status 1 on any failure.

Usage: python experiments/load.py                      (tiny model, 64 clients, 45 s)
       python experiments/load.py --duration 20
       python experiments/load.py --model smollm2 -- --max-model-len 1024   (replica flags after --)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import httpx
from tqdm import tqdm

# experiments/common.py, first: it puts this checkout's llmjax on sys.path
from common import free_port
from llmjax.bench import percentiles, stream_completion, stream_session
from llmjax.cli_types import non_negative_int, positive_int, positive_seconds
from llmjax.provenance import results_dir, write_results
from llmjax.serve.cluster import replica_pids
from llmjax.serve.metrics import parse_metrics


TINY_SERVER_ARGS = ["--block-size", "8", "--max-model-len", "128", "--kv-cache-memory", str(4 << 20),
                    "--max-num-seqs", "32", "--max-num-batched-tokens", "64"]
MODEL_NAME = "load-test"
LETTERS = "abcdefghijklmnopqrstuvwxyz "
REPLICAS = 2
HEALTH_INTERVAL_S = 0.05
HEALTH_P99_LIMIT_MS = 50.0
HEALTH_TIMEOUT_S = 2.0  # a probe without an answer by then has none


def start_cluster(model: str, port: int, base_port: int, server_args: list[str], log_file) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmjax.cli", "cluster", model, "--replicas", str(REPLICAS), "--port", str(port),
           "--replica-base-port", str(base_port), "--served-model-name", MODEL_NAME, "--uvicorn-log-level",
           "warning", "--health-check-interval", "0.5", "--health-failure-threshold", "2", *server_args]
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)


def workers_up(router: str) -> list[bool]:
    try:
        return [w["up"] for w in httpx.get(f"{router}/workers", timeout=5).json()]
    except httpx.HTTPError:
        return []


def wait_all_up(router: str, cluster: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.poll() is not None:
            raise SystemExit("the cluster exited")
        if workers_up(router) == [True] * REPLICAS:
            return True
        time.sleep(0.25)
    return False


# --- /health probe (its own process, so the load's event loop does not delay it) --------------------------
def probe_health(urls: list[str], start: float, stop, conn) -> None:
    """Fetch each URL's /health in turn every HEALTH_INTERVAL_S until `stop` is set; send the
    samples (seconds since `start`, a `time.monotonic()` of the parent: the clock is system-wide;
    replica index, latency in seconds or None when there was no answer, status code or the
    error's name) through `conn`."""
    samples = []
    with httpx.Client(timeout=HEALTH_TIMEOUT_S) as client:
        while not stop.is_set():
            for i, url in enumerate(urls):
                t0 = time.monotonic()
                try:
                    status = client.get(f"{url}/health").status_code
                    samples.append((t0 - start, i, time.monotonic() - t0, status))
                except httpx.HTTPError as exc:
                    samples.append((t0 - start, i, None, type(exc).__name__))
            time.sleep(HEALTH_INTERVAL_S)
    conn.send(samples)


# --- the clients --------------------------------------------------------------------------------------------
class LoadClient:
    """One client's request mix; results accumulate in the shared `stats`. The streams timed as
    `llmjax bench` times them go through its aiohttp `session`, everything else through `client`."""

    def __init__(self, client: httpx.AsyncClient, session: aiohttp.ClientSession, rng: random.Random,
                 max_model_len: int, stats: dict):
        self.client, self.session, self.rng, self.max_len, self.stats = client, session, rng, max_model_len, stats

    def _prompt(self) -> str:
        return "".join(self.rng.choice(LETTERS) for _ in range(self.rng.randint(4, 48)))

    def _valid_body(self) -> dict:
        return {"model": MODEL_NAME, "max_tokens": self.rng.randint(1, 40), "temperature": 0, "ignore_eos": True}

    def _fail(self, kind: str, message: str, cut_stream_sent: float | None = None) -> None:
        """A valid request failed. `cut_stream_sent`: its stream had started and then broke, and this is
        when the request was sent (`time.monotonic()`); a stream sent before a replica was killed and
        cut counts apart (the router cannot retry a stream that started). Any other failure, a stream
        sent after the kill or a whole answer that is wrong included, counts as one."""
        killed_at = self.stats["killed_at"]
        excused = cut_stream_sent is not None and killed_at is not None and cut_stream_sent < killed_at
        self.stats["interrupted" if excused else "failures"].append(f"{kind}: {message}")

    async def _check_stream(self, kind: str, body: dict) -> None:
        sent = time.monotonic()
        result = await stream_completion(self.session, body)
        if not result.ok:
            return self._fail(kind, result.error, sent if result.text else None)
        if result.output_tokens != body["max_tokens"]:
            return self._fail(kind, f"{result.output_tokens} tokens, wanted {body['max_tokens']}")
        self.stats["ttft"].append(result.ttft)
        self.stats["e2e"].append(result.latency)

    async def valid_stream(self) -> None:
        await self._check_stream("stream", self._valid_body() | {"prompt": self._prompt()})

    async def valid_sampling(self) -> None:
        """Penalties, logit_bias (token ids of the tiny model's vocabulary), min_tokens, big seeds."""
        body = self._valid_body() | {"prompt": self._prompt(), "temperature": self.rng.choice([0, 0.8])}
        body |= self.rng.choice([
            {"presence_penalty": self.rng.uniform(-2, 2)}, {"frequency_penalty": self.rng.uniform(-2, 2)},
            {"repetition_penalty": self.rng.uniform(0.5, 2)},
            {"logit_bias": {str(self.rng.randrange(3, 90)): self.rng.uniform(-100, 100) for _ in range(3)}},
            {"min_tokens": body["max_tokens"], "ignore_eos": False}, {"seed": 1099511627776},
            {"seed": self.rng.randrange(-(2**63), 2**64)},
        ])
        await self._check_stream("sampling", body)

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

    async def valid_n(self) -> None:
        n = self.rng.randint(2, 4)
        body = self._valid_body() | {"prompt": self._prompt(), "n": n, "temperature": 0.8,
                                     "seed": self.rng.randrange(2**32)}
        start = time.perf_counter()
        r = await self.client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return self._fail("n", f"HTTP {r.status_code} {r.text[:200]}")
        out = r.json()
        choices = out["choices"]
        if (sorted(c["index"] for c in choices) != list(range(n)) or any(c["finish_reason"] != "length" for c in choices)
                or out["usage"]["completion_tokens"] != n * body["max_tokens"]):
            return self._fail("n", json.dumps(out)[:300])
        self.stats["e2e"].append(time.perf_counter() - start)

    async def valid_chat_stream(self) -> None:
        body = self._valid_body() | {"messages": [{"role": "user", "content": self._prompt()}], "stream": True,
                                     "stream_options": {"include_usage": True}}
        start, sent, usage, done, started, error = time.perf_counter(), time.monotonic(), None, False, False, None
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return self._fail("chat", f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]
                        break
                    started = True
                    usage = chunk.get("usage") or usage
        if error is not None or not done:
            return self._fail("chat", f"stream broke: {error or 'no [DONE]'}", sent if started else None)
        if usage is None or usage["completion_tokens"] != body["max_tokens"]:
            return self._fail("chat", f"usage {usage}, wanted {body['max_tokens']} tokens")
        self.stats["e2e"].append(time.perf_counter() - start)

    async def poison(self) -> None:
        good = self._valid_body() | {"prompt": "x"}
        body, status = self.rng.choice([
            (good | {"top_k": 2147483648}, 400), (good | {"seed": 2**64}, 400), (good | {"top_k": -2}, 400),
            (good | {"temperature": -1}, 400), (good | {"top_p": 2}, 400), (good | {"prompt": ""}, 400),
            (good | {"prompt": [5, 10**6]}, 400), (good | {"logit_bias": {"99999999": 1}}, 400),
            (good | {"logit_bias": {"5": 1000}}, 400), (good | {"n": 10**6}, 400), (good | {"stop": [""]}, 400),
            (good | {"prompt": "x" * (self.max_len + 10)}, 400), (good | {"max_tokens": self.max_len + 1}, 400),
            (good | {"max_tokens": 10**12}, 400), (good | {"presence_penalty": 1e30}, 400),
            (good | {"response_format": {"type": "json_object"}}, 400), (good | {"stream": "yes"}, 400),
            (good | {"model": "no-such-model"}, 404), (good | {"max_tokens": "lots"}, 400),
            (b'{"prompt": ', 400), (b'{"prompt": "x", "temperature": NaN}', 400),
        ])
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
        kinds = [self.valid_stream, self.valid_completion, self.valid_chat_stream, self.valid_sampling, self.valid_n,
                 self.poison, self.abandoned]
        weights = [20, 10, 10, 15, 10, 20, 15]
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                await kind()
            except httpx.HTTPError as exc:
                if kind != self.abandoned:
                    self._fail(kind.__name__, f"{type(exc).__name__}: {exc}")
            except (ValueError, KeyError, TypeError, IndexError) as exc:  # an answer of another shape
                self._fail(kind.__name__, f"malformed answer ({type(exc).__name__}: {exc})")
            self.stats["requests"][kind.__name__] += 1


async def drive(url: str, clients: int, duration: float, seed: int, max_model_len: int, desc: str,
                kill_after: float | None = None, kill=None) -> dict:
    stats = {"requests": Counter(), "failures": [], "interrupted": [], "bad_errors": [], "ttft": [], "e2e": [],
             "killed_at": None}
    # A connection per request, as `llmjax bench` opens them: a pooled one that the router closes as
    # idle while a client reuses it would fail a valid request with a ReadError.
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client, \
            stream_session(url, read_timeout=120) as session:
        start = time.monotonic()
        deadline = start + duration
        workers = [asyncio.ensure_future(LoadClient(client, session, random.Random(seed + i), max_model_len,
                                                    stats).run(deadline)) for i in range(clients)]
        killed = kill_after is None
        with tqdm(total=round(duration), desc=desc, unit="s") as bar:
            while not all(w.done() for w in workers):
                await asyncio.sleep(1.0)
                bar.n = min(round(time.monotonic() - start), round(duration))
                bar.set_postfix(requests=sum(stats["requests"].values()), failed=len(stats["failures"]))
                if not killed and time.monotonic() - start >= kill_after:
                    kill()
                    killed, stats["killed_at"] = True, time.monotonic()
        await asyncio.gather(*workers)
    return stats


def replica_state(url: str) -> dict:
    m = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    invariants = httpx.get(f"{url}/debug/kv_invariants", timeout=60)
    return {"running": m["llmjax:num_requests_running"], "waiting": m["llmjax:num_requests_waiting"],
            "kv_usage": m["llmjax:kv_cache_usage_perc"], "kv_invariants": invariants.status_code,
            "preemptions": m["llmjax:num_preemptions_total"], "generated": m["llmjax:generation_tokens_total"],
            "engine_errors": m["llmjax:engine_errors_total"]}


def wait_idle(urls: list[str], timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        states = [replica_state(u) for u in urls]
        if all(s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0 for s in states):
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(0.2)


def is_timeout(error_name: str) -> bool:
    """Whether a probe's error (its httpx class name) is a timeout: a replica that holds the
    connection and does not answer, as against one that is gone."""
    error = getattr(httpx, error_name, None)
    return isinstance(error, type) and issubclass(error, httpx.TimeoutException)


def health_summary(samples: list[tuple], kill_at: float | None) -> dict:
    """The probes' latencies (answered ones) and the unanswered ones: `unreachable`, a replica gone
    (the connection refused or cut) by a probe that may have run into the kill (it ended after it),
    the killed replica down or restarting; `stalled`, a probe that timed out, or found a replica gone
    before any kill: a failure of a live replica."""
    answered = [lat for _, _, lat, _ in samples if lat is not None]
    unanswered = [(t, i, status) for t, i, lat, status in samples if lat is None]
    stalled = [(t, i, status) for t, i, status in unanswered
               if is_timeout(status) or kill_at is None or t + HEALTH_TIMEOUT_S < kill_at]
    p = percentiles(answered)
    return {"probes": len(samples), "answered": len(answered), "unreachable": len(unanswered) - len(stalled),
            "stalled": len(stalled), "no_answer": dict(Counter(status for _, _, status in unanswered)),
            "no_answer_by_replica": dict(Counter(i for _, i, _ in unanswered)),
            "non_200": sum(1 for _, _, lat, status in samples if lat is not None and status != 200),
            "p50_ms": p["p50"], "p99_ms": p["p99"], "max_ms": max(answered) * 1e3 if answered else 0.0}


def plot(samples: list[tuple], kill_at: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for replica in range(REPLICAS):
        points = [(t, lat * 1e3) for t, i, lat, _ in samples if i == replica and lat is not None]
        ax.plot([t for t, _ in points], [v for _, v in points], ".", ms=2, label=f"replica {replica}")
    if kill_at is not None:
        ax.axvline(kill_at, color="red", lw=1, label="SIGKILL")
    ax.axhline(HEALTH_P99_LIMIT_MS, color="gray", ls="--", lw=1, label=f"{HEALTH_P99_LIMIT_MS:g} ms")
    ax.set(xlabel="seconds since the load started", ylabel="/health latency (ms)", yscale="log",
           title="/health during the load (gaps: replica down)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args, stats: dict, states: list[dict], health: dict, restarted: bool, elapsed: float) -> tuple[str, bool]:
    ttft, e2e = percentiles(stats["ttft"]), percentiles(stats["e2e"])
    leaked = any(s["running"] or s["waiting"] or s["kv_usage"] or s["kv_invariants"] != 200 for s in states)
    health_ok = health["p99_ms"] < HEALTH_P99_LIMIT_MS and health["non_200"] == 0 and health["stalled"] == 0
    ok = not stats["failures"] and not stats["bad_errors"] and not leaked and health_ok and restarted
    total = sum(stats["requests"].values())
    lines = [
        f"`python experiments/load.py --duration {args.duration:g} --clients {args.clients} --warmup-load "
        f"{args.warmup_load:g}` against `llmjax cluster {args.model} --replicas {REPLICAS}` "
        f"({' '.join(args.server_args)}); one replica killed with SIGKILL {args.duration / 3:.0f} s into the "
        "measured phase. Request counts and latencies are of the measured phase; failures of both phases count; "
        "the `/health` probes run from the warm-up's start until the replicas are idle after the measured phase "
        "(the wait for the killed replica's restart included).", "",
        f"- result: **{'PASS' if ok else 'FAIL'}**",
        f"- requests: {total} in {elapsed:.1f} s ({total / elapsed:.1f} req/s): "
        + ", ".join(f"{k} {v}" for k, v in sorted(stats["requests"].items())),
        f"- failed valid requests: {len(stats['failures'])}",
        f"- streams sent before the kill and cut by it after they had started: {len(stats['interrupted'])} (not "
        "failures: the router retries only what has not started; a stream sent after the kill that breaks is one)",
        f"- poison requests answered wrongly: {len(stats['bad_errors'])}",
        f"- killed replica restarted and back in the router: {'yes' if restarted else 'NO'}",
        "- after the run, per replica: " + "; ".join(
            f"running {s['running']:g}, waiting {s['waiting']:g}, KV usage {s['kv_usage']:g}, "
            f"/debug/kv_invariants {s['kv_invariants']}, engine errors {s['engine_errors']:g}" for s in states),
        f"- `/health` of both replicas every {HEALTH_INTERVAL_S * 1e3:.0f} ms from a separate process: "
        f"{health['answered']} answered, p50 {health['p50_ms']:.1f} ms, p99 {health['p99_ms']:.1f} ms, max "
        f"{health['max_ms']:.1f} ms, {health['non_200']} not 200 (limit: p99 < {HEALTH_P99_LIMIT_MS:g} ms); "
        f"{health['unreachable']} probes found a replica gone after the kill (killed, restarting), "
        f"{health['stalled']} timed out or found one gone before it (limit: 0); unanswered by replica: "
        + ", ".join(f"{i}: {n}" for i, n in sorted(health["no_answer_by_replica"].items())), "",
        "| latency (ms) | mean | p50 | p90 | p99 |", "|---|---|---|---|---|",
        f"| TTFT (streamed completions) | {ttft['mean']:.1f} | {ttft['p50']:.1f} | {ttft['p90']:.1f} | {ttft['p99']:.1f} |",
        f"| end to end (valid requests) | {e2e['mean']:.1f} | {e2e['p50']:.1f} | {e2e['p90']:.1f} | {e2e['p99']:.1f} |",
        "", "![/health latency](load.png)",
    ]
    for title, items in (("Failures", stats["failures"]), ("Streams cut by the kill", stats["interrupted"]),
                         ("Wrong error answers", stats["bad_errors"])):
        if items:
            lines += ["", f"## {title}", ""] + [f"- {x}" for x in items[:20]]
    return "\n".join(lines) + "\n", ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-gqa")
    parser.add_argument("--duration", type=positive_seconds, default=45.0, help="seconds of measured load")
    parser.add_argument("--clients", type=positive_int, default=64)
    parser.add_argument("--warmup-load", type=positive_seconds, default=10.0, help="seconds of unmeasured load first")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--startup-timeout", type=positive_seconds, default=600.0)
    parser.add_argument("--restart-timeout", type=positive_seconds, default=120.0,
                        help="seconds to wait after the run for the killed replica to be back")
    parser.add_argument("server_args", nargs="*", help="flags for the replicas (after --); default: tiny settings")
    args = parser.parse_args()
    args.server_args = args.server_args or TINY_SERVER_ARGS

    base = free_port(REPLICAS + 1)  # the replicas' ports, then the router's
    port = base + REPLICAS
    router, urls = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{base + i}" for i in range(REPLICAS)]
    context = multiprocessing.get_context("spawn")
    stop, (receive, send) = context.Event(), context.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        cluster = start_cluster(args.model, port, base, args.server_args, log)
        probe = None
        try:
            if not wait_all_up(router, cluster, args.startup_timeout):
                raise SystemExit("the cluster did not come up in time")
            max_len = httpx.get(f"{router}/v1/models").json()["data"][0]["max_model_len"]
            probe_start = time.monotonic()
            probe = context.Process(target=probe_health, args=(urls, probe_start, stop, send))
            probe.start()
            print(f"cluster up at {router}; {args.clients} clients, {args.warmup_load:g} s warm-up, "
                  f"{args.duration:g} s measured", flush=True)
            warm = asyncio.run(drive(router, args.clients, args.warmup_load, args.seed + 10_000, max_len, "warm-up"))
            killed = []

            def kill() -> None:
                victim = replica_pids(cluster.pid)[0]
                os.kill(victim, signal.SIGKILL)
                killed.append(time.monotonic() - probe_start)

            start = time.monotonic()
            stats = asyncio.run(drive(router, args.clients, args.duration, args.seed, max_len, "measured",
                                      args.duration / 3, kill))
            elapsed = time.monotonic() - start
            for key in ("failures", "interrupted", "bad_errors"):
                stats[key] += warm[key]
            restarted = bool(killed) and wait_all_up(router, cluster, args.restart_timeout)
            states = wait_idle(urls)
            stop.set()
            samples = receive.recv()
            probe.join()
        finally:
            stop.set()
            if probe is not None and probe.is_alive():
                probe.join(10)
            cluster.terminate()
            cluster.wait(60)
            log.seek(0)
            cluster_log = log.read()
    health = health_summary(samples, killed[0] if killed else None)
    text, ok = report(args, stats, states, health, restarted, elapsed)
    out = results_dir()
    plot(samples, killed[0] if killed else None, out / "load.png")
    data = {"args": vars(args), "ok": ok, "requests": dict(stats["requests"]), "failures": stats["failures"],
            "interrupted": stats["interrupted"], "bad_errors": stats["bad_errors"], "replicas_after": states,
            "health": health, "killed_at_s": killed[0] if killed else None, "restarted": restarted,
            "ttft_ms": percentiles(stats["ttft"]), "e2e_ms": percentiles(stats["e2e"]), "elapsed_s": elapsed,
            # the headline's counts (experiments/results_table.py)
            "replicas": REPLICAS, "total_requests": sum(stats["requests"].values()),
            "poison_requests": stats["requests"]["poison"], "num_failures": len(stats["failures"]),
            "num_bad_errors": len(stats["bad_errors"]), "num_interrupted": len(stats["interrupted"]),
            "leaked_replicas": sum(1 for s in states if s["running"] or s["waiting"] or s["kv_usage"]
                                   or s["kv_invariants"] != 200)}
    write_results(out, "load", "# Load test\n\n" + text, data)
    print(text)
    if not ok:
        print("cluster log (tail):\n" + cluster_log[-3000:])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
