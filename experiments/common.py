"""Shared helpers of the ablation experiments: traces, replaying them through the real engine (wall clock)
or the simulator (virtual clock), latency statistics, step logs, timeline plots and report writing.

Both replays return the same things, so every experiment measures the two worlds with one code path:
- `Timing` per finished request: arrival, token times (first = TTFT), prompt/output length;
- a `StepLog`: per step, its start and end times and `(request_id, new_tokens)` of each scheduled request.

Wall-clock replay (`replay_engine`) adds each request when `time.monotonic()` passes its arrival,
then steps. JIT compilation would stall the clock, so (1) `warm_engine` compiles the step buckets
the trace needs first (found by replaying it in the simulator, as `paper_repro/radix_hit_rate.py`
does), and (2) any step that still compiles is cut out of the clock: its duration is subtracted from
every timestamp after its end and every later arrival, and a timestamp inside it (its own tokens')
is its start (`Replay.compiles` counts them; normally 0).

For the experiments that load a server in a subprocess (`stream_interval.py`, `bench_client.py`,
`router_overhead.py`, `load.py`, `routing.py`): `free_port`, `server_process` (start it, wait for
its `/health`, stop it), `add_stream_args` / `stream_server_args` (a streamed workload's flags and
the server's, sized for it), `alternating` (the order of the runs over the rounds), `cpu_seconds`
(a process's or thread's CPU time from /proc), and `medians_by` / `plot_bars` (medians per setting, drawn as bars with every run's value).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python experiments/x.py` finds llmjax and paper_repro

from llmjax.cli_types import non_negative_int, positive_int  # noqa: E402
from llmjax.config import PRESETS, EngineConfig  # noqa: E402
from llmjax.kv.manager import KVCacheManager  # noqa: E402
from llmjax.kv.sizing import num_blocks_from_budget  # noqa: E402
from llmjax.provenance import results_dir, write_results  # noqa: E402
from llmjax.sampling_params import SamplingParams  # noqa: E402
from llmjax.sim import A100_40GB_OPT_13B, CostModel, Simulator, TraceRequest  # noqa: E402

RESULTS = results_dir()  # `--quick` runs write to results_dir(quick=True) instead

# GPU-scale setting of the simulated runs: OPT-13B on an A100-40GB, 12 GiB of KV (PagedAttention §6).
SIM_COST = A100_40GB_OPT_13B
SIM_KV_BYTES = 12 << 30


# --- results of a replay ----------------------------------------------------------------------------
@dataclass
class Timing:
    """One finished request, times relative to the replay's start (seconds)."""

    request_id: str
    arrival: float
    token_times: list[float]
    prompt_len: int

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> np.ndarray:
        return np.diff(self.token_times)

    @property
    def tpot(self) -> float:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else float("nan")


StepLog = list[tuple[float, float, list[tuple[str, int]]]]  # (step start, step end, [(request id, new tokens)])


@dataclass
class Replay:
    timings: list[Timing]
    steps: StepLog
    duration: float
    slots: int  # batch slots per step (batch_size or max_num_seqs), for the idle-slot share
    compiles: int = 0
    extra: dict = field(default_factory=dict)

    def stats(self) -> dict[str, float]:
        """Throughput and latency percentiles (ms), and the share of batch slots idle while work is queued
        or running (over steps: 1 - scheduled requests / slots)."""
        ttft = np.array([t.ttft for t in self.timings])
        itl = np.concatenate([t.itls for t in self.timings] or [np.zeros(0)])
        tpot = np.array([t.tpot for t in self.timings if len(t.token_times) > 1])
        tokens = sum(len(t.token_times) for t in self.timings)
        used = np.array([len(s) for *_, s in self.steps])
        pct = lambda a, q: float(np.percentile(a, q) * 1e3) if len(a) else float("nan")  # noqa: E731
        return {
            "requests": len(self.timings), "tokens_per_s": tokens / self.duration,
            "requests_per_s": len(self.timings) / self.duration, "duration_s": self.duration,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "ttft_mean_ms": float(ttft.mean() * 1e3),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "itl_max_ms": pct(itl, 100),
            "idle_slots": float(1 - used.mean() / self.slots) if len(used) else float("nan"),
            "steps": len(self.steps),
        }


def slots_of(config: EngineConfig) -> int:
    return config.max_num_seqs if config.scheduling_policy == "continuous" else config.batch_size


# --- simulator ----------------------------------------------------------------------------------------
def replay_sim(config: EngineConfig, requests: list[TraceRequest], cost: CostModel = SIM_COST,
               kv_bytes: int = SIM_KV_BYTES, progress: str | None = None) -> Replay:
    """Replay in `llmjax.sim` (the real scheduler and KV manager, `cost`'s step times, virtual clock)."""
    num_blocks = num_blocks_from_budget(kv_bytes, config.block_size, cost.kv_bytes_per_token)
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    steps: StepLog = []
    log = lambda sim, out, dt: steps.append((sim.now - dt, sim.now, [(r.request_id, int(n))  # noqa: E731
                                                                  for r, n in zip(out.requests, out.num_new_tokens)]))
    result = Simulator(config, kv, cost, [log]).run(requests, progress=progress)
    timings = [Timing(r.request_id, r.arrival_time, list(r.token_times), len(r.prompt_token_ids))
               for r in result.finished]
    return Replay(timings, steps, result.duration, slots_of(config), extra={"preemptions": result.num_preemptions})


# --- the real engine -----------------------------------------------------------------------------------
# The experiments compare techniques at one precision, float32 (what the reference tests check
# exactly), whatever the engine's CPU default; a config's `dtype` (synergy's bfloat16 rung) overrides it.
EXPERIMENT_DTYPE = "float32"
_LOADED: dict = {}


def make_engine(model: str | None, config: EngineConfig):
    """An `LLMEngine` for `model` (None: the embedded SmolLM2; or a preset) in `config.dtype` (default
    `EXPERIMENT_DTYPE`, float32, not the engine's CPU default); weights load
    once per (model, dtype) and process, compiled step buckets are shared by the engines of one process and
    cached on disk across runs."""
    import jax.numpy as jnp

    from llmjax.engine import LLMEngine
    from llmjax.models.loader import load_model
    from llmjax.runner import enable_compilation_cache
    from llmjax.tokenizer import load_tokenizer

    key = (model, jnp.dtype(config.dtype or EXPERIMENT_DTYPE))
    if key not in _LOADED:
        enable_compilation_cache()  # JAX's persistent cache: a rerun compiles (almost) nothing
        loaded = load_model(model, dtype=key[1])
        _LOADED[key] = (loaded, load_tokenizer(loaded.source, loaded.config.eos_token_ids))
    loaded, tokenizer = _LOADED[key]
    return LLMEngine(loaded, tokenizer, config)


def all_at_once(requests: list[TraceRequest]) -> list[TraceRequest]:
    """The same requests, all arriving at t=0 (an offline batch: what a policy serves at capacity)."""
    return [replace(r, arrival=0.0) for r in requests]


def warm_engine(engine, requests: list[TraceRequest], full_pass: bool = True) -> None:
    """Compile the (T, S, B, decode_only) buckets serving `requests` will use: the trace is replayed in the
    simulator with its arrivals and all at t=0 (the wall-clock schedule lies between the two); with
    `full_pass` the trace is then served once, untimed, to compile whatever else it touches (sampling)."""
    runner, config = engine.runner, engine.config
    shapes: set = set()

    def observe(sim, out, dt):
        shapes.add((*out.bucket, out.decode_only))

    for reqs in (requests, all_at_once(requests)):
        kv = KVCacheManager(engine.num_blocks, config.block_size, config.enable_prefix_caching)
        Simulator(config, kv, SIM_COST, [observe]).run(reqs)
    runner.warmup(sorted(shapes))
    if full_pass:
        replay_engine(engine, [TraceRequest("warm-" + r.request_id, r.arrival, r.prompt, r.output_len)
                               for r in requests], progress="warm-up pass")
    engine.kv.reset_prefix_cache()


def replay_engine(engine, requests: list[TraceRequest], progress: str | None = None) -> Replay:
    """Serve `requests` on the real engine against the wall clock (greedy, ignore_eos, each request's
    drawn output length); see the module docstring for how compile stalls are removed."""
    from tqdm import tqdm

    if any(r.after is not None for r in requests):
        raise ValueError("replay_engine replays fixed arrival times; a request that follows another's finish "
                         "(TraceRequest.after) needs the simulator")
    pending = sorted(requests, key=lambda r: r.arrival)
    sched = engine.scheduler
    preempted_before = sched.num_preemptions
    steps: StepLog = []
    shifts: list[tuple[float, float]] = []  # (monotonic time a compiling step started, its duration)
    outputs = []
    origin, stalled, i = time.monotonic(), 0.0, 0
    bar = tqdm(total=len(requests), desc=progress, unit="req", disable=progress is None, leave=False)
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - origin - stalled
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            engine.add_request(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
                               request_id=r.request_id, arrival_time=origin + stalled + r.arrival)
            i += 1
        sched.input_closed = i == len(pending)
        if not engine.has_unfinished_requests():
            time.sleep(min(0.002, max(0.0, pending[i].arrival - now)))
            continue
        compiles, t0 = engine.runner.num_compiles, time.monotonic()
        scheduled = []
        real_schedule = sched.schedule
        def schedule():  # noqa: E306 - record what this step runs
            out = real_schedule()
            scheduled.extend((r.request_id, int(n)) for r, n in zip(out.requests, out.num_new_tokens))
            return out
        sched.schedule = schedule
        try:
            step_outputs = engine.step()
        finally:
            sched.schedule = real_schedule
        t1 = time.monotonic()
        start = t0 - origin - stalled
        if engine.runner.num_compiles != compiles:
            shifts.append((t0, t1 - t0))
            stalled += t1 - t0
        if scheduled:  # a step that compiled has its stall taken off the clock: it spans no time
            steps.append((start, t1 - origin - stalled, scheduled))
        for out in step_outputs:
            if out.finished:
                outputs.append(out)
                bar.update(1)
    bar.close()
    sched.input_closed = False

    def rel(t: float) -> float:
        """Time on the replay's clock: without the compiling steps' stalls; a time stamped inside one
        (its tokens') is its start, since such a step spans no time."""
        shift = 0.0
        for start, d in shifts:
            shift += d if start + d <= t else max(0.0, t - start)
        return t - origin - shift

    timings = [Timing(o.request_id, rel(o.metrics.arrival_time), [rel(t) for t in o.metrics.token_times],
                      len(o.prompt_token_ids))
               for o in outputs]
    duration = max(t.token_times[-1] for t in timings)
    return Replay(timings, steps, duration, slots_of(engine.config), compiles=len(shifts),
                  extra={"preemptions": sched.num_preemptions - preempted_before})


# --- plots and reports -----------------------------------------------------------------------------------
def plot_timeline(ax, replay: Replay, request_ids: list[str], title: str, t_max: float | None = None) -> None:
    """Which of `request_ids` runs in which step: waiting (grey), prefill (orange), decode (blue) per step,
    each step drawn from its start to its end (the time between steps, a batch filling or no work, stays
    grey)."""
    arrival = {t.request_id: t.arrival for t in replay.timings}
    spans: dict[str, list] = {r: [] for r in request_ids}
    for start, end, sched in replay.steps:
        for rid, n in sched:
            if rid in spans:
                spans[rid].append((start, end - start, n))
    for y, rid in enumerate(request_ids):
        runs = spans[rid]
        done = max((s + w for s, w, _ in runs), default=arrival.get(rid, 0.0))
        ax.barh(y, done - arrival.get(rid, 0.0), left=arrival.get(rid, 0.0), color="0.88", height=0.8)
        for kind, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
            sel = [(s, w) for s, w, n in runs if (n > 1) == (kind == "prefill")]
            ax.broken_barh(sel, (y - 0.4, 0.8), color=color, label=kind if y == 0 else None)
    ax.set_yticks(range(len(request_ids)), request_ids, fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    if t_max:
        ax.set_xlim(0, t_max)


def medians_by(runs: list[dict], group: str, values: tuple, keys: tuple[str, ...]) -> list[dict]:
    """A row per value of `group` (in the order of `values`): the median of each of `keys` over the
    runs with that value, and how many runs there were (`runs`)."""
    rows = []
    for value in values:
        mine = [r for r in runs if r[group] == value]
        rows.append({k: statistics.median(r[k] for r in mine) for k in keys} | {group: value, "runs": len(mine)})
    return rows


def plot_bars(path: Path, rows: list[dict], runs: list[dict], group: str, panels: list[tuple[str, str]]) -> None:
    """A PNG with a panel per (key, title) of `panels`: a bar per row (its median, labelled by its `group`
    field) and a dot per run of that group, so the spread over the runs shows next to the median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=["tab:gray", "tab:blue", "tab:orange"][: len(rows)],
               alpha=0.7, label="median")
        for i, row in enumerate(rows):
            mine = [r[key] for r in runs if r[group] == row[group]]
            ax.plot([i] * len(mine), mine, "k.", label="runs" if i == 0 else None)
        ax.set_xticks(range(len(rows)), [str(r[group]) for r in rows])
        ax.set(title=title, ylim=(0, None))
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown table; columns: (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(columns))) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(format(row[k], f) if f else str(row[k]) for k, _, f in columns) + " |")
    return "\n".join(lines)


# --- servers in subprocesses --------------------------------------------------------------------------
STREAM_BLOCK_SIZE = 16
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process `pid`, or of its thread `tid` (from /proc)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14 and 15 of stat(5)


def stream_server_args(args: argparse.Namespace) -> list[str]:
    """Flags of `llmjax serve` (or `cluster`) for `add_stream_args`' workload: a slot and room in the KV
    pool for every stream (`--kv-cache-memory` only for a preset, whose bytes per token are known here,
    counted in float32 so that any KV dtype fits; another model gets the server's default pool)."""
    max_len = max(args.input_len + args.output_len, 2 * args.output_len)  # the bench caps outputs at half of it
    flags = ["--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", str(max(512, 2 * args.concurrency)),
             "--max-model-len", str(max_len), "--block-size", str(STREAM_BLOCK_SIZE), "--uvicorn-log-level", "warning"]
    if args.model in PRESETS:
        blocks = args.concurrency * -(-max_len // STREAM_BLOCK_SIZE) + 1  # + the null block
        flags += ["--kv-cache-memory", str(blocks * STREAM_BLOCK_SIZE * PRESETS[args.model].kv_bytes_per_token(4))]
    return flags


def add_stream_args(ap: argparse.ArgumentParser, num_prompts: int, quick_help: str) -> None:
    """The flags of a streamed-serving experiment: a model served by a fresh server, rounds of
    `--num-prompts` streamed completions of `--input-len` + `--output-len` tokens, `--concurrency`
    in flight (`stream_server_args` sizes the server for them), and `--quick` (`llmjax.cli_types.parse_quick`)."""
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {quick_help}; written to build/results-quick/")
    ap.add_argument("--model", default="tiny-gqa")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--num-prompts", type=positive_int, default=num_prompts)
    ap.add_argument("--concurrency", type=positive_int, default=256)
    ap.add_argument("--input-len", type=positive_int, default=16)
    ap.add_argument("--output-len", type=positive_int, default=128)
    ap.add_argument("--seed", type=non_negative_int, default=0)


def best_time(call, repeats: int, warm_up: bool = False) -> float:
    """The shortest of `repeats` timed calls of `call` (seconds; after one untimed call if `warm_up`)."""
    if warm_up:
        call()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def alternating(items: list | tuple, rounds: int) -> Iterator[tuple[int, object]]:
    """(round, item) for every item of every round: in order in even rounds, reversed in odd ones, so
    that a drift of the shared machine falls on every item alike."""
    for round_ in range(rounds):
        for item in items if round_ % 2 == 0 else items[::-1]:
            yield round_, item


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that were free a moment ago (the OS's
    choice, its neighbours checked by binding them): a router's and its replicas' ports."""
    while True:
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            try:
                for port in range(base + 1, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except (OSError, OverflowError):  # a neighbour is taken, or past 65535: another base
                continue
            return base


@contextlib.contextmanager
def server_process(cmd: list[str], url: str, log, timeout: float = 900.0) -> Iterator[subprocess.Popen]:
    """Run `cmd` (a server: `llmjax serve`, `llmjax cluster`) with its output to the file `log`;
    yields the process once `url`/health answers 200 (SystemExit if it exits first or `timeout`
    passes). On leaving: SIGTERM, then SIGKILL after 60 s."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited during startup; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not start in {timeout:.0f} s; see {log.name}")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_report(name: str, title: str, body: str, data: dict, out: Path = RESULTS) -> None:
    """Print `body`, write `out`/<name>.md (with links to its PNGs) and <name>.json, both stamped with the
    commit, command, date, machine and package versions (`llmjax.provenance`)."""
    print(body)
    write_results(out, name, f"# {title}\n\n{body}\n", data)


def change(what: str, before: float, after: float, unit: str, digits: int = 0, tolerance: float = 0.02) -> str:
    """A finding's verb computed from the numbers: "cuts <what> X -> Y <unit>", "raises ...", or "leaves
    <what> about unchanged (X -> Y <unit>)" when the two differ by at most `tolerance` (relative)."""
    span = f"{before:.{digits}f} -> {after:.{digits}f} {unit}".rstrip()
    if abs(after - before) <= tolerance * max(abs(before), abs(after)):
        return f"leaves {what} about unchanged ({span})"
    return f"{'cuts' if after < before else 'raises'} {what} {span}"
