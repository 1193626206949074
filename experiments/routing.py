"""Routing across replicas: `round_robin` vs `cache_aware` on a shared-prefix workload.

Workload (both parts): G prefix groups, each a long system prompt, times R requests that add their
own question. Requests arrive in R rounds, each round the G groups in a fresh random order (so
round-robin gets no accidental affinity, as it would with groups in a fixed order).

1. HTTP, on this machine: per policy, `llmjax cluster --replicas N MODEL` (a subprocess: N
   `llmjax serve` replicas and the router; tiny random-weight replicas by default) serves the
   workload through the router, at most `--concurrency` requests in flight, every request a
   streamed completion timed by the bench client (`llmjax.bench`). A warm-up first serves the
   same workload with other prefixes (same policy), so the step shapes are compiled before timing
   (a replica that compiles also answers `/health` late). `--http-rounds` rounds (2) of a run per
   policy, the policies' order alternating, each round reported apart. The first run on a machine compiles for
   minutes; later runs load JAX's persistent compilation cache. Reported: prefix-cache hit rate
   (hit / queried prompt tokens, from every replica's `/metrics`), TTFT, throughput, requests per
   replica, and how often a replica sat idle while another had requests waiting (sampled from the
   replicas' gauges every 100 ms; a request that arrives during a step waits until the next one,
   so short waits count too).
2. Simulated, at 2, 4 and 8 replicas: one `llmjax.sim.Simulator` per replica (the real scheduler and KV
   manager over the A100-40GB + OPT-13B cost model), all stepped on one virtual clock, requests
   routed at their arrival by the very policy objects the HTTP router uses
   (`llmjax.serve.routing`), with each replica's requests in flight as its load. Poisson arrivals
   at `--sim-rate` requests/s per replica; G = 4 groups per replica. Idle-while-queued is sampled at
   the arrivals (Poisson arrivals see time averages): a replica with nothing to do while another
   holds a request that had arrived before its last step and got no work in it.

These setup choices fix the numbers, and the report states each: requests per group R and the
prefix's share of the prompt set the ceiling no policy beats ((R-1)/R of the prefix share); the KV
pool size (HTTP: one request more than a replica's share of the groups under cache-aware routing;
simulated: 12 GiB of OPT-13B KV, whatever number of 1200-token prefixes that holds) against the
G groups, and the replica count N, set round-robin's level: it hits only where a replica still
caches the group's prefix, which at a pool that holds few of the G prefixes is when the group's
previous request went to the same replica, about 1 time in N. The HTTP pools are sized for that
regime; the simulated pools hold all 4N groups at small N, where round-robin reaches the ceiling
too. Prints the report (table, ratios, targets met) and writes it to results/routing.md, with
results/routing.json and .png.

Usage: python experiments/routing.py                     (4 tiny replicas; 2, 4, 8 simulated; ~7 min)
       python experiments/routing.py --skip-http         (the simulated part only, seconds)
       python experiments/routing.py --quick             (smoke run into build/results-quick/)
       python experiments/routing.py --replicas 2 --skip-sim
       python experiments/routing.py --model smollm2 --prefix-len 400 -- --max-model-len 1024
                                                          (flags after -- go to every replica)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

# experiments/common.py, first: it puts this checkout's llmjax on sys.path
from common import SIM_COST, SIM_KV_BYTES, free_port, results_dir, server_process, table, write_report
from llmjax.bench import percentiles, run_jobs, stream_session, summarize
from llmjax.cli_types import parse_quick
from llmjax.config import PRESETS, EngineConfig
from llmjax.kv import KVCacheManager
from llmjax.request import Request
from llmjax.sampling_params import SamplingParams
from llmjax.serve import routing
from llmjax.serve.metrics import parse_metrics
from llmjax.sim import Simulator, TraceRequest, finish_step


POLICIES = ("round_robin", "cache_aware")
BLOCK_SIZE = 16
TINY_SERVER_ARGS = ["--block-size", str(BLOCK_SIZE), "--max-model-len", "1024", "--attention-backend", "xla",
                    "--max-num-seqs", "16", "--max-num-batched-tokens", "512"]
LETTERS = "abcdefghijklmnopqrstuvwxyz     "


def arrival_order(groups: int, per_group: int, seed: int) -> list[int]:
    """The group of each request in arrival order: `per_group` rounds, each a shuffle of all groups."""
    rng = random.Random(seed)
    order = []
    for _ in range(per_group):
        round_ = list(range(groups))
        rng.shuffle(round_)
        order += round_
    return order


# --- part 1: HTTP --------------------------------------------------------------------------------------
@contextlib.contextmanager
def cluster(args: argparse.Namespace, policy: str, log):
    """`llmjax cluster` in a subprocess; yields the router URL once it is up."""
    base = free_port(args.replicas + 1)  # the replicas' ports, then the router's
    port = base + args.replicas
    cmd = [sys.executable, "-m", "llmjax.cli", "cluster", args.model, "--replicas", str(args.replicas),
           "--port", str(port), "--replica-base-port", str(base), "--policy", policy,
           "--uvicorn-log-level", "warning", *args.server_args]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url, log):
        yield url


def tiny_server_args(args: argparse.Namespace) -> list[str]:
    """Replica flags for a tiny preset, with a KV pool (float32) of one request more than a
    replica's share of the groups under cache-aware routing: it holds that share's prefixes, not all
    of them, the regime where routing decides the hit rate."""
    per_token = PRESETS[args.model].kv_bytes_per_token(4)
    request_blocks = math.ceil((1 + args.prefix_len + args.suffix_len + args.max_tokens) / BLOCK_SIZE)
    blocks = (math.ceil(args.groups / args.replicas) + 1) * request_blocks + 1  # + the null block
    return [*TINY_SERVER_ARGS, "--kv-cache-memory", str(blocks * BLOCK_SIZE * per_token)]


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(n))


Sample = list[tuple[int, bool]]  # per replica: requests it holds, whether one of them is queued


def load_stats(samples: list[Sample]) -> dict[str, float]:
    """`idle_while_queued`: fraction of samples in which a replica held nothing while another had a
    request queued (`any_queued`: ... whether or not one was idle); `inflight_spread`: mean over
    samples of max - min requests held."""
    queued = [any(q for _, q in row) for row in samples]
    idle = [q and any(n == 0 for n, _ in row) for q, row in zip(queued, samples)]
    spread = [max(n for n, _ in row) - min(n for n, _ in row) for row in samples]
    return {"idle_while_queued": float(np.mean(idle)) if idle else 0.0,
            "any_queued": float(np.mean(queued)) if queued else 0.0,
            "inflight_spread": float(np.mean(spread)) if spread else 0.0}


async def sample_loads(client: httpx.AsyncClient, workers: list[str], samples: list[Sample]):
    """Every 100 ms, each replica's gauges: running + waiting, and waiting > 0 as queued."""
    while True:
        row = []
        for w in workers:
            m = parse_metrics((await client.get(f"{w}/metrics")).text)
            waiting = int(m["llmjax:num_requests_waiting"])
            row.append((int(m["llmjax:num_requests_running"]) + waiting, waiting > 0))
        samples.append(row)
        await asyncio.sleep(0.1)


def http_prompts(args: argparse.Namespace, seed: int, per_group: int) -> list[str]:
    rng = random.Random(seed)
    systems = [text(rng, args.prefix_len) for _ in range(args.groups)]
    return [systems[g] + text(rng, args.suffix_len) for g in arrival_order(args.groups, per_group, seed)]


async def serve_workload(url: str, args: argparse.Namespace) -> dict:
    prompts = http_prompts(args, args.seed, args.per_group)
    warmup = http_prompts(args, args.seed + 1, args.per_group)  # other prefixes, same step shapes
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    def jobs(texts: list[str]):
        def job(prompt: str):
            async def run(send):
                await send({"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0})
            return run
        return [job(t) for t in texts]

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client, \
            stream_session(url) as session:  # the completions, streamed as `llmjax bench` streams them
        workers = [w["url"] for w in (await client.get("/workers")).json()]
        await run_jobs(session, jobs(warmup), len(warmup), math.inf, args.concurrency, args.seed)

        async def scrape() -> list[dict[str, float]]:
            return [parse_metrics((await client.get(f"{w}/metrics")).text) for w in workers]

        async def routed() -> dict[str, int]:
            return {w["url"]: w["requests"] for w in (await client.get("/workers")).json()}

        before, routed_before = await scrape(), await routed()
        samples: list[Sample] = []
        sampler = asyncio.create_task(sample_loads(client, workers, samples))
        results, duration = await run_jobs(session, jobs(prompts), len(prompts), math.inf, args.concurrency, args.seed)
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        after = await scrape()
        per_worker = [n - routed_before[url] for url, n in (await routed()).items()]
    queried = sum(a["llmjax:prefix_cache_queries_total"] - b["llmjax:prefix_cache_queries_total"]
                  for a, b in zip(after, before))
    hits = sum(a["llmjax:prefix_cache_hits_total"] - b["llmjax:prefix_cache_hits_total"] for a, b in zip(after, before))
    s = summarize(results, duration, {})
    return {"hit_rate": hits / queried if queried else 0.0, "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "throughput_rps": s["request_throughput"], "throughput_tok_s": s["total_token_throughput"],
            "requests_per_replica": per_worker, **load_stats(samples), "failed": s["failed"]}


def http_part(args: argparse.Namespace) -> list[dict[str, dict]]:
    """`--http-rounds` rounds, each a run per policy, the policies' order alternating from round to round
    (a drift in the shared machine's speed does not always favour the same one)."""
    rounds = []
    with tempfile.NamedTemporaryFile("w", prefix="routing-cluster-", suffix=".log", delete=False) as log:
        for k in range(args.http_rounds):
            out = {}
            for policy in (POLICIES if k % 2 == 0 else POLICIES[::-1]):
                print(f"HTTP round {k + 1}: {args.replicas} x {args.model} replicas, {policy} (cluster log: "
                      f"{log.name})", flush=True)
                with cluster(args, policy, log) as url:
                    out[policy] = asyncio.run(serve_workload(url, args))
            rounds.append(out)
    return rounds


# --- part 2: simulated replicas on one virtual clock --------------------------------------------------
SIM_CONFIG = EngineConfig(max_num_batched_tokens=2048, max_num_seqs=64, block_size=16, max_model_len=2048)


class SimReplica:
    """One replica: a `Simulator`'s scheduler, KV manager and cost model, stepped by `run_sim_cluster`.
    `Simulator.run` replays a whole trace; here each request is routed at its arrival, so this
    steps the simulator's parts the way `Simulator.run` does (schedule, advance the clock by the
    step's cost, the scheduler's update with one dummy token per sampling request)."""

    def __init__(self):
        num_blocks = SIM_KV_BYTES // (SIM_COST.kv_bytes_per_token * SIM_CONFIG.block_size)
        self.sim = Simulator(SIM_CONFIG, KVCacheManager(num_blocks, SIM_CONFIG.block_size), SIM_COST)
        self.submitted = 0
        self.finished: list[Request] = []
        self.last_schedule = 0.0

    @property
    def in_flight(self) -> int:
        return self.submitted - len(self.finished)

    def submit(self, t: TraceRequest) -> None:
        """Queue `t` (after `advance(t.arrival)`: the clock is at or past its arrival)."""
        params = SamplingParams(temperature=0.0, max_tokens=t.output_len, ignore_eos=True)
        self.sim.scheduler.add(Request(t.request_id, list(t.prompt), params, seed=0, arrival_time=t.arrival))
        self.submitted += 1

    def queued(self) -> bool:
        """A request that had arrived when the last step was formed got no work in it: not admitted,
        or admitted without any prompt tokens (the token budget went to others)."""
        sched = self.sim.scheduler
        return any(r.num_computed_tokens == 0 and r.arrival_time < self.last_schedule
                   for r in [*sched.waiting, *sched.running])

    def advance(self, until: float) -> None:
        """Run steps that start before `until` (the last may end after it)."""
        sim, sched = self.sim, self.sim.scheduler
        while sim.now < until and sched.has_unfinished():
            self.last_schedule = sim.now
            out = sched.schedule()
            if out.empty:
                if out.preempted:
                    continue
                break  # nothing admissible now (the drain then leaves it unfinished, and the check fails)
            sim.now += sim.cost.step_time(out)
            self.finished.extend(finish_step(sched, out))
        if math.isfinite(until):
            sim.now = max(sim.now, until)  # idle until then


@dataclass
class SimOutcome:
    replicas: list[SimReplica]
    samples: list[Sample] = field(default_factory=list)  # at each arrival


def sim_trace(n_replicas: int, args: argparse.Namespace) -> list[TraceRequest]:
    groups = 4 * n_replicas
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(3, 50_000, args.sim_prefix_len).tolist() for _ in range(groups)]
    trace, t = [], 0.0
    for i, g in enumerate(arrival_order(groups, args.per_group, args.seed)):
        t += float(rng.exponential(1.0 / (args.sim_rate * n_replicas)))
        prompt = systems[g] + rng.integers(3, 50_000, args.sim_suffix_len).tolist()
        trace.append(TraceRequest(f"r{i}", t, prompt, args.sim_output_len))
    return trace


def run_sim_cluster(trace: list[TraceRequest], policy: routing.RoutingPolicy, n_replicas: int,
                    desc: str) -> SimOutcome:
    """Route each request at its arrival (after every replica has run up to that time), then drain."""
    outcome = SimOutcome([SimReplica() for _ in range(n_replicas)])
    reps = outcome.replicas
    for t in tqdm(trace, desc=desc, unit="req", leave=False):
        for r in reps:
            r.advance(t.arrival)
        outcome.samples.append([(r.in_flight, r.queued()) for r in reps])
        key = " ".join(map(str, t.prompt))  # token ids as text, as the router writes them (less its trailing space)
        reps[policy.select(key, {i: r.in_flight for i, r in enumerate(reps)}).worker].submit(t)
    for r in reps:
        r.advance(math.inf)
    return outcome


def sim_summary(outcome: SimOutcome, trace: list[TraceRequest]) -> dict:
    reps = outcome.replicas
    finished = [req for r in reps for req in r.finished]
    assert len(finished) == len(trace), "a simulated request did not finish"
    stats = [r.sim.kv.stats() for r in reps]
    queried = sum(s.queried_tokens for s in stats)
    duration = max(r.sim.now for r in reps) - trace[0].arrival
    ttft = percentiles([req.first_token_time - req.arrival_time for req in finished])
    tokens = sum(len(req.prompt_token_ids) + len(req.output_token_ids) for req in finished)
    return {"hit_rate": sum(s.hit_tokens for s in stats) / queried if queried else 0.0,
            "ttft_p50_ms": ttft["p50"], "ttft_mean_ms": ttft["mean"], "ttft_p99_ms": ttft["p99"],
            "throughput_rps": len(finished) / duration, "throughput_tok_s": tokens / duration,
            "requests_per_replica": [r.submitted for r in reps], **load_stats(outcome.samples)}


def sim_part(args: argparse.Namespace) -> dict[int, dict[str, dict]]:
    out = {}
    for n in args.sim_replicas:
        trace = sim_trace(n, args)
        out[n] = {}
        for policy in POLICIES:
            outcome = run_sim_cluster(trace, routing.make_policy(policy), n, f"sim {n} replicas, {policy}")
            out[n][policy] = sim_summary(outcome, trace)
    return out


# --- report ----------------------------------------------------------------------------------------------
Rows = list[tuple[str, dict[str, dict]]]  # (setting, policy -> measurements)
COLUMNS = [("setting", "setting", ""), ("policy", "policy", ""), ("hit_rate", "hit rate", ".1%"),
           ("ttft_p50_ms", "TTFT p50 (ms)", ".0f"), ("ttft_p99_ms", "TTFT p99 (ms)", ".0f"),
           ("throughput_rps", "req/s", ".2f"), ("throughput_tok_s", "tok/s", ".0f"),
           ("per_replica", "requests per replica (min / max)", ""), ("inflight_spread", "in flight, max - min", ".1f"),
           ("idle_while_queued", "idle while queued", ".1%")]
RATIO_COLUMNS = [("setting", "setting", ""), ("hit", "hit rate, cache_aware / round_robin", ".1f"),
                 ("ttft", "TTFT p50, round_robin / cache_aware", ".1f"),
                 ("throughput", "throughput, cache_aware / round_robin", ".2f"), ("targets", "targets met", "")]


TTFT_MARGIN = 0.05  # a median TTFT counts as lower only when it is at least this much lower


def ratio_row(setting: str, by_policy: dict[str, dict]) -> dict:
    """The ratios and the targets: cache_aware at least 2x round_robin's hit rate, a median TTFT at
    least `TTFT_MARGIN` lower, no replica idle while another queues."""
    ca, rr = by_policy["cache_aware"], by_policy["round_robin"]
    checks = {"hit rate >= 2x": ca["hit_rate"] >= 2 * rr["hit_rate"],
              f"TTFT p50 >= {TTFT_MARGIN:.0%} lower": ca["ttft_p50_ms"] <= (1 - TTFT_MARGIN) * rr["ttft_p50_ms"],
              "never idle while another queues": ca["idle_while_queued"] == 0.0}
    return {"setting": setting, "hit": ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf,
            "ttft": rr["ttft_p50_ms"] / ca["ttft_p50_ms"], "throughput": ca["throughput_rps"] / rr["throughput_rps"],
            "targets": ", ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks.items())}


def pool_notes(args: argparse.Namespace, rows: Rows) -> str:
    """How many requests one replica's KV pool holds against the groups, and round-robin's hit rate as a
    share of the ceiling per setting: the setup choices that, with the replica count, set its level."""
    blocks = SIM_KV_BYTES // (SIM_COST.kv_bytes_per_token * SIM_CONFIG.block_size)
    request = args.sim_prefix_len + args.sim_suffix_len + args.sim_output_len
    sim_ceiling = (args.per_group - 1) / args.per_group * args.sim_prefix_len / (args.sim_prefix_len + args.sim_suffix_len)
    shares = [f"{by_policy['round_robin']['hit_rate'] / sim_ceiling:.0%} (cache-aware "
              f"{by_policy['cache_aware']['hit_rate'] / sim_ceiling:.0%}) at N = {setting.split()[1]}"
              for setting, by_policy in rows if setting.startswith("sim")]
    sim = ("" if args.skip_sim else
           f"A simulated replica's pool holds {blocks * SIM_CONFIG.block_size // request} whole requests of {request} "
           f"tokens against 4N groups; round-robin's hit rate as a share of the simulated ceiling: {', '.join(shares)}. "
           "The larger N, the fewer of "
           "the groups a pool keeps and the closer round-robin falls to hitting only when a group's previous "
           "request went to the same replica, 1 time in N.")
    http = ("" if args.skip_http else
            f" An HTTP replica's pool holds ceil(G/N) + 1 = {math.ceil(args.groups / args.replicas) + 1} requests for "
            f"G = {args.groups} groups at N = {args.replicas} (chosen so that cache-aware routing's share of the "
            "groups fits and round-robin's does not): a smaller N or a larger pool would raise round-robin's rate.")
    return sim + http


def report_body(rows: Rows, args: argparse.Namespace) -> str:
    http = (f"- HTTP: {args.replicas} x `{args.model}` replicas on this machine through `llmjax cluster`, "
            f"{args.http_rounds} round(s) of one run per policy, the policies' order alternating (round 1: "
            f"{POLICIES[0]} first), each round a setting below; "
            f"{args.groups} groups x {args.per_group} requests, system prompts of {args.prefix_len} characters, "
            f"questions of {args.suffix_len}, {args.max_tokens} tokens generated, {args.concurrency} in flight; "
            f"replica flags `{' '.join(args.server_args)}`. Wall-clock timings on a shared machine: load average "
            f"{getattr(args, 'load_average', 'not measured')}.")
    sim = (f"- Simulated: {', '.join(map(str, args.sim_replicas))} replicas, {SIM_COST.name} cost model, "
           f"{SIM_KV_BYTES >> 30} GiB of KV each ({SIM_CONFIG.block_size}-token blocks), 4 groups per replica x "
           f"{args.per_group} requests, system prompts of {args.sim_prefix_len} tokens, questions of "
           f"{args.sim_suffix_len}, {args.sim_output_len} tokens generated, Poisson arrivals at {args.sim_rate} "
           "requests/s per replica.")
    both = ("- Both: requests arrive in rounds, each a fresh random order of the groups. `cache_aware` has SGLang's "
            "original defaults (cache_threshold 0.5, balance_abs_threshold 32, balance_rel_threshold 1.0001). Hit "
            "rate: prefix-cache hit tokens / queried prompt tokens over all replicas. In flight, max - min: the "
            "mean spread of the requests replicas hold. Idle while queued: share of samples in which a replica "
            "held nothing while another had a queued request.")
    ceiling = (args.per_group - 1) / args.per_group
    notes = ("Reading: every group's first request misses, so no policy beats (R-1)/R of the prefix's share of "
             f"the prompt tokens: {ceiling:.3f} x {args.sim_prefix_len}/{args.sim_prefix_len + args.sim_suffix_len} = "
             f"{ceiling * args.sim_prefix_len / (args.sim_prefix_len + args.sim_suffix_len):.1%} simulated"
             + ("" if args.skip_http or args.model not in PRESETS else
                f", {ceiling:.3f} x {args.prefix_len}/{args.prefix_len + args.suffix_len + 1} = "
                f"{ceiling * args.prefix_len / (args.prefix_len + args.suffix_len + 1):.1%} over HTTP (one character "
                "per token, plus BOS)")
             + ". Round-robin finds a group's prefix only on a replica that still caches it. " + pool_notes(args, rows)
             + " The HTTP timings come from tiny replicas sharing a small CPU with whatever else runs; "
             "the hit rates do not depend on it.")
    measured = [{"setting": setting, "policy": policy, **r,
                 "per_replica": f"{min(r['requests_per_replica'])} / {max(r['requests_per_replica'])}"}
                for setting, by_policy in rows for policy, r in by_policy.items()]
    return "\n\n".join(["Written by `python experiments/routing.py` (its docstring has the method).",
                         "\n".join([*([] if args.skip_http else [http]), *([] if args.skip_sim else [sim]), both]),
                         table(measured, COLUMNS),
                         table([ratio_row(*row) for row in rows], RATIO_COLUMNS), notes,
                         "![hit rate, TTFT and throughput per setting](routing.png)"])


def plot(rows: Rows, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = np.arange(len(rows))
    for k, policy in enumerate(POLICIES):
        values = [[r[policy]["hit_rate"] * 100 for _, r in rows], [r[policy]["ttft_p50_ms"] for _, r in rows],
                  [r[policy]["throughput_rps"] / len(r[policy]["requests_per_replica"]) for _, r in rows]]
        for ax, v in zip(axes, values):
            ax.bar(x + (k - 0.5) * 0.38, v, 0.38, label=policy)
    for ax, title in zip(axes, ("prefix-cache hit rate (%)", "median TTFT (ms, log)",
                                "throughput per replica (requests/s)")):
        ax.set_title(title)
        ax.set_xticks(x, [s for s, _ in rows], rotation=15, fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle("Routing a shared-prefix workload: round_robin vs cache_aware")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", ncol=2)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-gqa")
    parser.add_argument("--replicas", type=int, default=4, help="HTTP part: replicas on this machine")
    parser.add_argument("--groups", type=int, default=16, help="HTTP part: prefix groups")
    parser.add_argument("--per-group", type=int, default=8, help="requests per group (both parts)")
    parser.add_argument("--prefix-len", type=int, default=512, help="HTTP part: system prompt characters")
    parser.add_argument("--suffix-len", type=int, default=32, help="HTTP part: question characters")
    parser.add_argument("--max-tokens", type=int, default=8, help="HTTP part: tokens generated per request")
    parser.add_argument("--concurrency", type=int, default=16, help="HTTP part: requests in flight")
    parser.add_argument("--http-rounds", type=int, default=2, help="HTTP part: runs per policy, in alternating order")
    parser.add_argument("--sim-replicas", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--sim-rate", type=float, default=3.0, help="Poisson arrivals per second per replica")
    parser.add_argument("--sim-prefix-len", type=int, default=1200)
    parser.add_argument("--sim-suffix-len", type=int, default=100)
    parser.add_argument("--sim-output-len", type=int, default=64)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: simulated part only, 2 replicas, 3 "
                        "requests per group; written to build/results-quick/")
    parser.add_argument("server_args", nargs="*", help="after --: flags for every replica (default for tiny "
                        "presets: " + " ".join(TINY_SERVER_ARGS) + " and a KV pool sized by tiny_server_args)")
    args = parse_quick(parser, dict(skip_http=True, sim_replicas=[2], per_group=3))
    out = results_dir(args.quick)
    if not args.server_args and args.model in PRESETS:
        args.server_args = tiny_server_args(args)

    rows: Rows = []
    if not args.skip_http:
        load = os.getloadavg()[0]
        rows += [(f"HTTP, {args.replicas} x {args.model}, round {k + 1}", by_policy)
                 for k, by_policy in enumerate(http_part(args))]
        args.load_average = f"{load:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores"
    if not args.skip_sim:
        for n, by_policy in sim_part(args).items():
            rows.append((f"sim, {n} x A100 OPT-13B", by_policy))
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "routing.png")
    write_report("routing", "Routing: round_robin vs cache_aware", report_body(rows, args),
                 {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                  "replicas": ([] if args.skip_http else [args.replicas] * args.http_rounds)
                  + ([] if args.skip_sim else args.sim_replicas),
                  "ceiling": (args.per_group - 1) / args.per_group * args.sim_prefix_len
                  / (args.sim_prefix_len + args.sim_suffix_len)}, out)


if __name__ == "__main__":
    main()
