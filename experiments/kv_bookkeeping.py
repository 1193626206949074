"""Speed of the KV cache bookkeeping (plain Python, no device): is it negligible beside a decode step?

Two measurements, one run:

1. A synthetic stream of requests sharing a few long system prompts flows through
   allocate (prefix match + fresh blocks) / grow (one token per decode step) / free (caching
   the request's full pages), continuous-batching style with at most --num-running requests,
   preempting (free + re-admit) when the pool runs dry. Prints calls and time per operation (an
   allocation the pool refuses counted apart from one it admits).
2. The bookkeeping of one decode step for --num-running requests: grow each by one token, by
   one `grow` call per request and by one `grow_each` call given the same tuple every step (as the
   scheduler's steady decode step calls it), against 1 ms: the threshold taken here for the
   shortest GPU decode step (an assumption, not measured), under which this must stay well.

Writes results/kv_bookkeeping.md, .json and .png (time per manager call by operation; the decode-step
bookkeeping's distribution over steps, both ways, against 1 ms).

Usage: python experiments/kv_bookkeeping.py                 (100k requests, about 15 s)
       python experiments/kv_bookkeeping.py --num-requests 2000
       python experiments/kv_bookkeeping.py --quick         (smoke run into build/results-quick/)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common import results_dir, write_report  # noqa: E402
from llmjax.cli_types import non_negative_int, parse_quick, positive_int  # noqa: E402
from llmjax.kv import KVCacheManager  # noqa: E402

VOCAB = 32000


def build_stream(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """Prompts (a shared prefix, a unique token, a random suffix) and output lengths."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(args.prefix_len // 2, args.prefix_len))]
                for _ in range(args.num_prefixes)]
    pool = [rng.randrange(VOCAB) for _ in range(1 << 16)]
    weights = [1 / (k + 1) for k in range(args.num_prefixes)]  # Zipf-like popularity
    chosen = rng.choices(range(args.num_prefixes), weights, k=args.num_requests)
    prompts, outputs = [], []
    for i, k in enumerate(chosen):
        n, off = rng.randint(1, args.suffix_len), rng.randrange(len(pool) - args.suffix_len)
        prompts.append(prefixes[k] + [VOCAB + i] + pool[off : off + n])
        outputs.append(rng.randint(1, 2 * args.output_len))
    return prompts, outputs


def run_stream(m: KVCacheManager, prompts: list[list[int]], outputs: list[int], num_running: int) -> dict[str, list]:
    """Serve every request to completion; returns [calls, seconds] per operation."""
    cost = {op: [0, 0.0] for op in ("allocate", "refused allocate", "grow", "free", "preempt")}

    def record(op: str, start: float) -> None:
        cost[op][0] += 1
        cost[op][1] += time.perf_counter() - start

    def timed(op: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        record(op, start)
        return out

    waiting: deque[int] = deque(range(len(prompts)))
    tokens: dict[int, list[int]] = {}  # admitted request -> its tokens so far, all with KV slots
    running: dict[int, None] = {}
    preempted: set[int] = set()
    with tqdm(total=len(prompts), unit="req", desc="stream") as bar:
        while waiting or running:
            while waiting and len(running) < num_running:
                r = waiting[0]
                seq = tokens.setdefault(r, list(prompts[r]))
                count_query = r not in preempted  # a re-admission is not another query (as in the scheduler)
                start = time.perf_counter()
                admitted = m.allocate(r, seq, len(seq), None, count_query) is not None  # whole prefill
                record("allocate" if admitted else "refused allocate", start)
                if not admitted:
                    break
                running[waiting.popleft()] = None
            for r in list(running):  # one decode step: a slot for each request's next token
                seq = tokens[r]
                if not timed("grow", m.grow, r, len(seq) + 1):
                    timed("preempt", m.free, r, seq)  # recompute later, with hits on its cached pages
                    preempted.add(r)
                    del running[r]
                    waiting.appendleft(r)
                    continue
                seq.append(len(seq) % VOCAB)
                if len(seq) - len(prompts[r]) >= outputs[r]:
                    timed("free", m.free, r, seq)
                    del running[r], tokens[r]
                    bar.update()
    return cost


def decode_step_cost(args: argparse.Namespace, prompts: list[list[int]], batched: bool) -> list[float]:
    """Seconds per decode step's bookkeeping: grow each of num_running requests by one token, by one
    `grow` call each or (`batched`) one `grow_each` call given the same tuple every step."""
    batch = prompts[: args.num_running]
    m = KVCacheManager(1 + sum(-(-(len(p) + args.decode_steps) // args.block_size) for p in batch), args.block_size)
    lengths = {}
    for r, prompt in enumerate(batch):
        m.allocate(r, prompt, len(prompt))
        lengths[r] = len(prompt)
    keys, totals = tuple(lengths), np.array(list(lengths.values()))
    times = []
    for _ in tqdm(range(args.decode_steps), unit="step", desc="decode, grow_each" if batched else "decode, grow"):
        t = time.perf_counter()
        if batched:
            totals = totals + 1
            m.grow_each(keys, totals)
        else:
            for r, n in lengths.items():
                m.grow(r, n + 1)
                lengths[r] = n + 1
        times.append(time.perf_counter() - t)
    if batched:
        lengths = dict(zip(keys, totals.tolist()))
    assert all(m.num_tokens(r) == n for r, n in lengths.items()), "a grow failed: the pool is sized for the whole run"
    m.check_invariants()
    return times


def plot(cost: dict[str, list], step_times: dict[str, list[float]], num_running: int, path) -> None:
    """Left: mean µs per manager call by operation (log scale). Right: each way's decode-step
    bookkeeping time over steps as a CDF, with 1 ms (the shortest GPU decode step assumed) marked."""
    fig, (ops, steps) = plt.subplots(1, 2, figsize=(11, 4))
    names = [op for op, (n, _) in cost.items() if n]
    ops.bar(names, [1e6 * cost[op][1] / cost[op][0] for op in names], color="tab:blue")
    ops.set_yscale("log")
    ops.set_ylabel("mean µs per call")
    ops.set_title("KV manager calls in the request stream")
    for label, times in step_times.items():
        us = 1e6 * np.sort(times)
        steps.plot(us, np.arange(1, len(us) + 1) / len(us), label=label)
    steps.axvline(1000, color="gray", linestyle="--", label="1 ms")
    steps.set_xscale("log")
    steps.set_xlabel(f"µs per decode step ({num_running} requests grow by one token)")
    steps.set_ylabel("fraction of steps")
    steps.set_title("decode-step bookkeeping")
    steps.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=positive_int, default=100_000)
    p.add_argument("--num-running", type=positive_int, default=256)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--num-blocks", type=positive_int, default=2048, help="small enough to evict and preempt")
    p.add_argument("--num-prefixes", type=positive_int, default=32)
    p.add_argument("--prefix-len", type=positive_int, default=512, help="longest shared prefix (tokens)")
    p.add_argument("--suffix-len", type=positive_int, default=128, help="longest per-request suffix (tokens)")
    p.add_argument("--output-len", type=positive_int, default=24, help="mean output length (tokens)")
    p.add_argument("--decode-steps", type=positive_int, default=2000)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 2000 requests, 200 decode steps, "
                   "written to build/results-quick/")
    args = parse_quick(p, dict(num_requests=2000, decode_steps=200))

    prompts, outputs = build_stream(args)
    longest = max(len(prompt) + out for prompt, out in zip(prompts, outputs))
    if -(-longest // args.block_size) > args.num_blocks - 1:  # one block is the null block
        p.error(f"--num-blocks {args.num_blocks}: the longest request, {longest} tokens, needs "
                f"{-(-longest // args.block_size)} blocks of {args.block_size} tokens, plus the null block")
    m = KVCacheManager(args.num_blocks, args.block_size)
    t0 = time.perf_counter()
    cost = run_stream(m, prompts, outputs, args.num_running)
    wall = time.perf_counter() - t0
    m.check_invariants()
    stats = m.stats()

    calls = sum(c for c, _ in cost.values())
    busy = sum(s for _, s in cost.values())
    lines = [f"{args.num_requests} requests, {args.num_blocks} blocks of {args.block_size} tokens, "
             f"<= {args.num_running} running, {args.num_prefixes} shared prefixes; "
             f"prefix hit rate {stats.hit_rate:.1%} ({stats.hit_tokens} of {stats.queried_tokens} prompt tokens at first "
             "admission; a re-admission after preemption is not counted), "
             f"{stats.cached_blocks} blocks cached at the end.", "",
             "| operation | calls | mean µs/call | calls/s |", "| --- | ---: | ---: | ---: |"]
    for op, (n, s) in cost.items():
        if n:
            lines.append(f"| {op} | {n} | {1e6 * s / n:.2f} | {n / s:,.0f} |")
    lines.append(f"| all | {calls} | {1e6 * busy / calls:.2f} | {calls / busy:,.0f} |")
    lines.append(f"\nStream wall time {wall:.1f} s ({calls / wall:,.0f} manager calls/s including the driver loop).")

    step_us, step_times = {}, {}
    for batched, how in ((False, "one `grow` call per request"), (True, "one `grow_each` call, the same tuple every step")):
        times = sorted(decode_step_cost(args, prompts, batched))
        median, mean, p99 = times[len(times) // 2], statistics.fmean(times), times[int(0.99 * len(times))]
        verdict = "under" if mean < 1e-3 else "over"
        lines.append(f"\nDecode-step bookkeeping for {args.num_running} requests (grow each by one token: {how}), "
                     f"{args.decode_steps} steps: median {1e6 * median:.0f} µs, mean {1e6 * mean:.0f} µs, "
                     f"p99 {1e6 * p99:.0f} µs (tails include OS scheduling on a shared host); the mean is "
                     f"{mean / 1e-3:.1%} of 1 ms, {verdict} it (1 ms: the shortest GPU decode step assumed here, "
                     "not measured).")
        step_us["grow_each" if batched else "grow"] = {"median": 1e6 * median, "mean": 1e6 * mean, "p99": 1e6 * p99}
        step_times["one grow_each call" if batched else "one grow call a request"] = times
    out = results_dir(args.quick)
    out.mkdir(parents=True, exist_ok=True)
    lines.append("\n![KV bookkeeping](kv_bookkeeping.png)")
    plot(cost, step_times, args.num_running, out / "kv_bookkeeping.png")
    write_report("kv_bookkeeping", "KV cache bookkeeping speed", "\n".join(lines), {
        "operations": {op: {"calls": n, "seconds": s} for op, (n, s) in cost.items()},
        "hit_rate": stats.hit_rate, "stream_wall_s": wall,
        "decode_step_us": step_us["grow"], "decode_step_grow_each_us": step_us["grow_each"],
        "args": vars(args)}, out)


if __name__ == "__main__":
    main()
