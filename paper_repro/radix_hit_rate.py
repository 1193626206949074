"""RadixAttention (Zheng et al., SGLang, 2024): prefix-cache hit rates on prefix-sharing workloads.

Two parts, one run:

1. The real engine on CPU (the embedded SmolLM2-135M, xla attention): four small workloads in the
   spirit of the paper's benchmarks (5-shot questions sharing their examples, multi-turn chat,
   tree-of-thought branching, questions over one long document), each served three ways: prefix
   caching off, on with FCFS admission, on with longest-prefix-match-first (LPM, SGLang's policy).
   Reported: hit rate (cached prompt tokens / prompt tokens, as the KV manager counts them),
   throughput and mean time to first token. Every step shape is compiled before timing (a dry run
   of the same schedule through the simulator lists them), so the timings hold no compilation.
2. The simulator at GPU scale (OPT-13B / A100 cost model, thousands of requests): hit rate and
   throughput against the KV pool size, FCFS vs LPM, to show eviction under memory pressure.

The paper reports 50-99% hit rates on its benchmarks, and up to 6.4x the throughput of state-of-the-art
inference systems for SGLang as a whole (RadixAttention with its other optimizations, such as compressed
finite-state machines for constrained decoding). Writes results/radix_hit_rate.{md,json,png}.

Usage: python -m paper_repro.radix_hit_rate              (about 15 minutes on 2 busy cores)
       python -m paper_repro.radix_hit_rate --skip-engine   (the simulator part only)
       python -m paper_repro.radix_hit_rate --quick         (smoke run into build/results-quick/)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from llmjax.cli_types import non_negative_int, parse_quick, positive_int
from llmjax.config import EngineConfig
from llmjax.engine import LLMEngine
from llmjax.outputs import OutputAccumulator, RequestOutput
from llmjax.kv import KVCacheManager
from llmjax.provenance import results_dir, write_results
from llmjax.sampling_params import SamplingParams
from llmjax.sim import A100_40GB_OPT_13B, DUMMY_TOKEN, Simulator, TraceRequest
from llmjax.workloads import lognormal_lengths
from paper_repro import traces

MODES = {"off": dict(enable_prefix_caching=False), "fcfs": dict(queue_order="fcfs"), "lpm": dict(queue_order="lpm")}
MODE_LABELS = {"off": "caching off", "fcfs": "caching on, FCFS", "lpm": "caching on, LPM"}
PAPER_HIT_RANGE = (0.50, 0.99)
PAPER_HIT_RATES = f"{PAPER_HIT_RANGE[0]:.0%}-{PAPER_HIT_RANGE[1]:.0%}"
PAPER_SPEEDUP = 6.4


# --- workloads that may depend on earlier replies (multi-turn chat) ----------------------------------
@dataclass(frozen=True)
class Workload:
    """`next_round(replies)`: the prompts of the next round given the replies of the earlier rounds
    (replies[k][i]: the output of prompt i of round k), or None when the workload is done."""

    name: str
    next_round: Callable[[list[list[list[int]]]], list[list[int]] | None]


def single_round(name: str, prompts: list[list[int]]) -> Workload:
    return Workload(name, lambda replies: None if replies else prompts)


def chat_rounds(name: str, chats: traces.Chats, turns: int) -> Workload:
    def next_round(replies: list[list[list[int]]]) -> list[list[int]] | None:
        k = len(replies)
        if k == turns:
            return None
        return [chats.prompt(c, k, [replies[j][c] for j in range(k)]) for c in range(len(chats.users))]

    return Workload(name, next_round)


def engine_workloads(vocab: int, seed: int) -> list[Workload]:
    """Small enough for the embedded model on two cores: 10-24 requests, ~1.6-2.5k prompt tokens each."""
    rng = np.random.default_rng(seed)
    return [
        single_round("few-shot (5-shot, 3 tasks)", traces.few_shot(rng, vocab, groups=3, per_group=6, example_len=24)),
        chat_rounds("multi-turn chat (6 x 3 turns)", traces.Chats.draw(rng, vocab, conversations=6, turns=3,
                                                                      system_len=32, user_len=24), turns=3),
        single_round("tree of thought (2 trees, 3^2)", traces.tree_of_thought(rng, vocab, trees=2, stem_len=64)),
        single_round("long-document QA (2 docs)", traces.long_document(rng, vocab, docs=2, per_doc=5, doc_len=224)),
    ]


# --- the real engine --------------------------------------------------------------------------------
def serve(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """Submit all prompts at once and step until every one finishes; outputs in prompt order."""
    ids = [engine.add_request(p, params) for p in prompts]
    engine.scheduler.input_closed = True
    done = OutputAccumulator()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            done.add(delta)
    return [done.outputs[i] for i in ids]


def step_shapes(engine: LLMEngine, workload: Workload, max_tokens: int) -> set[tuple[int, int, int, bool]]:
    """The (T, S, B, decode_only) buckets serving `workload` on `engine` will run: the same scheduler and
    a fresh KV manager of the same size replay it in the simulator, replies being dummy tokens of the
    same lengths (which schedules exactly as the real replies do)."""
    config = engine.config
    kv = KVCacheManager(engine.num_blocks, config.block_size, config.enable_prefix_caching)
    shapes: set[tuple[int, int, int, bool]] = set()

    def observe(sim: Simulator, out, dt: float) -> None:
        shapes.add((*out.bucket, out.decode_only))

    replies: list[list[list[int]]] = []
    while (prompts := workload.next_round(replies)) is not None:
        trace = [TraceRequest(f"w{len(replies)}-{i}", 0.0, p, max_tokens) for i, p in enumerate(prompts)]
        Simulator(config, kv, A100_40GB_OPT_13B, [observe]).run(trace)
        replies.append([[DUMMY_TOKEN] * max_tokens for _ in prompts])
    return shapes


_WARMED: set[tuple] = set()  # (model, block size, bucket): compiled steps are shared by a process's engines


TIMED = ("throughput", "cpu_throughput", "ttft")  # `measure`'s timings; its other entries are counts


def hit_ceiling(outputs: Sequence[RequestOutput], block_size: int) -> float:
    """The most a prefix cache of `block_size`-token pages could hit on these requests (in order): each
    served alone, after the ones before it, nothing evicted. A request finds the longest run of whole
    pages that an earlier request's computed tokens (its prompt and output, less the last output token,
    which is never fed) began with, leaving its last prompt token to compute. Hit tokens / prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for output in outputs:
        prompt = list(output.prompt_token_ids)
        pages = 0
        while pages < (len(prompt) - 1) // block_size and tuple(prompt[: (pages + 1) * block_size]) in seen:
            pages += 1
        hit, total = hit + pages * block_size, total + len(prompt)
        computed = prompt + list(output.outputs[0].token_ids[:-1])
        seen.update(tuple(computed[: (j + 1) * block_size]) for j in range(len(computed) // block_size))
    return hit / total


def measure(engine: LLMEngine, workload: Workload, max_tokens: int) -> dict[str, float]:
    """Serve the workload round by round: hit rate, requests per wall second (`throughput`) and per CPU
    second of this process (`cpu_throughput`: the work done, less sensitive to other processes sharing
    the cores), mean TTFT (s), preemptions."""
    key = (engine.model_config, engine.config.block_size)
    new = sorted(s for s in step_shapes(engine, workload, max_tokens) if (*key, s) not in _WARMED)
    engine.runner.warmup(new)
    _WARMED.update((*key, s) for s in new)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    replies: list[list[list[int]]] = []
    outputs: list[RequestOutput] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    while (prompts := workload.next_round(replies)) is not None:
        round_outputs = serve(engine, prompts, params)
        replies.append([o.outputs[0].token_ids for o in round_outputs])
        outputs += round_outputs
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return dict(hit_rate=engine.kv.stats().hit_rate, throughput=len(outputs) / elapsed,
                cpu_throughput=len(outputs) / cpu,
                ttft=float(np.mean([o.metrics.first_token_time - o.metrics.arrival_time for o in outputs])),
                prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs), requests=len(outputs),
                hit_ceiling=hit_ceiling(outputs, engine.config.block_size),
                preemptions=sum(o.metrics.num_preemptions for o in outputs),
                kv_tokens=(engine.num_blocks - 1) * engine.config.block_size)


def check_model(parser: argparse.ArgumentParser, model_name: str | None) -> None:
    """Refuse (`parser.error`) a `--model` that names no model, before any work."""
    from llmjax.models.loader import WeightLoadError, resolve_source

    try:
        resolve_source(model_name)
    except (FileNotFoundError, WeightLoadError) as exc:
        parser.error(f"--model: {exc}")


def load(model_name: str | None):
    """(model, tokenizer), loaded once for all the engines of a script; the compilation cache on."""
    import jax.numpy as jnp

    from llmjax.models.loader import load_model
    from llmjax.runner import enable_compilation_cache
    from llmjax.tokenizer import load_tokenizer

    enable_compilation_cache()
    model = load_model(model_name, dtype=jnp.float32)  # the experiments' precision (experiments/common.py)
    return model, load_tokenizer(model.source, model.config.eos_token_ids)


def engine_part(args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    """Per workload and mode: `args.repeats` runs, each on a fresh engine (an empty cache), the three
    modes of a repeat back to back in a rotating order. A mode's entry holds the median of its runs'
    measures (hit rate and preemptions are the same in every run: the schedule does not depend on
    time), the runs' requests per CPU second (`cpu_throughput_runs`), and for the caching modes the
    speedup over caching off paired by repeat (`cpu_speedup_runs`: this run's requests per CPU second
    over the same repeat's run with caching off) and their median (`cpu_speedup`)."""
    model, tokenizer = load(args.model)
    base = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8, block_size=16, max_model_len=1024,
                        kv_cache_memory_bytes=args.engine_kv_mib << 20)
    workloads = engine_workloads(model.config.vocab_size, args.seed)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {w.name: {m: [] for m in MODES} for w in workloads}
    modes = list(MODES)
    with tqdm(total=args.repeats * len(workloads) * len(MODES), desc="engine runs", unit="run") as bar:
        for repeat in range(args.repeats):
            for workload in workloads:
                for mode in modes[repeat % len(modes):] + modes[: repeat % len(modes)]:
                    engine = LLMEngine(model, tokenizer, base.replace(**MODES[mode]))
                    runs[workload.name][mode].append(measure(engine, workload, args.max_tokens))
                    bar.update(1)
    results: dict[str, dict[str, dict]] = {}
    for name, by_mode in runs.items():
        results[name] = {}
        for mode, measured in by_mode.items():
            counts = [{k: v for k, v in m.items() if k not in TIMED} for m in measured]
            if any(c != counts[0] for c in counts):
                raise RuntimeError(f"{name}, {mode}: runs scheduled differently: {measured}")
            entry = counts[0] | {key: float(np.median([m[key] for m in measured])) for key in TIMED}
            entry.update(cpu_throughput_runs=[m["cpu_throughput"] for m in measured])
            if mode != "off":
                entry["cpu_speedup_runs"] = [m["cpu_throughput"] / o["cpu_throughput"]
                                             for m, o in zip(measured, by_mode["off"])]
                entry["cpu_speedup"] = float(np.median(entry["cpu_speedup_runs"]))
            results[name][mode] = entry
    return results


# --- the simulator at scale -------------------------------------------------------------------------
class PrefixHits:
    """Simulator observer: the cached prompt tokens of each request at its first admission (a request
    re-admitted after preemption finds its own blocks cached; those hits are not counted)."""

    def __init__(self) -> None:
        self.first: dict[str, tuple[int, int]] = {}  # request id -> (cached tokens, prompt tokens)

    def __call__(self, sim: Simulator, out, dt: float) -> None:
        for request, start in zip(out.requests, out.num_computed):
            self.first.setdefault(request.request_id, (int(start), len(request.prompt_token_ids)))

    @property
    def hit_rate(self) -> float:
        cached, total = np.sum(list(self.first.values()), axis=0)
        return float(cached / total)


OPT_VOCAB = 50272


def few_shot_at_scale(seed: int) -> list[TraceRequest]:
    """80 tasks x 20 questions, 5 examples of 64 tokens, questions of 32; outputs log-normal, mean 32; 30 req/s."""
    rng = np.random.default_rng(seed)
    prompts = traces.few_shot(rng, OPT_VOCAB, groups=80, per_group=20, example_len=64, question_len=32)
    outputs = lognormal_lengths(rng, len(prompts), 32, 0.8, 256)
    return traces.to_trace(prompts, outputs, rate=30.0, seed=seed, name="fs")


def chat_at_scale(seed: int) -> list[TraceRequest]:
    """300 conversations x 5 turns, 128-token system prompt, 48-token user turns, replies log-normal with mean
    80; conversations start at 4/s, a turn an exponential think time (mean 60 s) after the previous one
    finished."""
    rng = np.random.default_rng(seed)
    conversations, turns = 300, 5
    chats = traces.Chats.draw(rng, OPT_VOCAB, conversations, turns, system_len=128, user_len=48)
    replies = lognormal_lengths(rng, conversations * turns, 80, 0.8, 256).reshape(conversations, turns)
    return traces.chat_trace(chats, replies, rate=4.0, think_time=60.0, seed=seed)


def scale_traces(seed: int) -> dict[str, list[TraceRequest]]:
    return {"few-shot, 80 tasks x 20 questions": few_shot_at_scale(seed),
            "multi-turn chat, 300 x 5 turns": chat_at_scale(seed)}


SCALE_CONFIG = EngineConfig(max_num_batched_tokens=2048, max_num_seqs=256, block_size=16, max_model_len=2048)


def simulate(trace: list[TraceRequest], config: EngineConfig, slots: int) -> dict[str, float]:
    """One simulated run on a pool of `slots` tokens: first-admission hit rate, req/s, mean TTFT, preemptions."""
    hits = PrefixHits()
    kv = KVCacheManager(slots // config.block_size + 1, config.block_size, config.enable_prefix_caching)
    res = Simulator(config, kv, A100_40GB_OPT_13B, [hits]).run(trace)
    return dict(slots=slots, hit_rate=hits.hit_rate, throughput=res.throughput, ttft=res.mean_ttft,
                preemptions=res.num_preemptions)


def scale_part(workloads: dict[str, list[TraceRequest]], pool_tokens: list[int]) -> dict[str, dict[str, list[dict]]]:
    """Per workload and mode (caching off / FCFS / LPM), one row per KV pool size."""
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tqdm(total=len(workloads) * len(MODES) * len(pool_tokens), desc="simulated runs", unit="run") as bar:
        for name, trace in workloads.items():
            results[name] = {mode: [] for mode in MODES}
            for mode, overrides in MODES.items():
                for slots in pool_tokens:
                    results[name][mode].append(simulate(trace, SCALE_CONFIG.replace(**overrides), slots))
                    bar.update(1)
    return results


# --- report -----------------------------------------------------------------------------------------
def ceiling(modes: dict[str, dict]) -> str:
    """A workload's hit-rate ceiling: one number when its modes served the same requests (multi-turn
    chat builds each round from the mode's own replies, which could differ), else one per mode."""
    ceilings = [f"{100 * modes[m]['hit_ceiling']:.0f}%" for m in MODES]
    return ceilings[0] if len(set(ceilings)) == 1 else " / ".join(ceilings)


def engine_table(results: dict[str, dict[str, dict]]) -> list[str]:
    lines = ["| workload | requests | prompt tokens | hit rate off / FCFS / LPM | its ceiling | req/s off / FCFS / LPM "
             "| speedup per CPU second, FCFS / LPM (range over repeats) | mean TTFT (s) off / FCFS / LPM "
             "| preemptions |", "| --- |" + " --- |" * 8]
    for name, r in results.items():
        off = r["off"]
        lines.append(
            f"| {name} | {off['requests']:.0f} | {off['prompt_tokens']:.0f} | "
            + " / ".join(f"{100 * r[m]['hit_rate']:.0f}%" for m in MODES) + f" | {ceiling(r)} | "
            + " / ".join(f"{r[m]['throughput']:.2f}" for m in MODES) + " | "
            + " / ".join(f"{r[m]['cpu_speedup']:.2f}x ({min(r[m]['cpu_speedup_runs']):.2f}-"
                         f"{max(r[m]['cpu_speedup_runs']):.2f})" for m in ("fcfs", "lpm")) + " | "
            + " / ".join(f"{r[m]['ttft']:.1f}" for m in MODES) + f" | {sum(r[m]['preemptions'] for m in MODES)} |")
    return lines


def scale_table(results: dict[str, dict[str, list[dict[str, float]]]]) -> list[str]:
    lines = ["| workload | KV pool (tokens) | hit rate FCFS / LPM | req/s off / FCFS / LPM "
             "| mean TTFT (s) off / FCFS / LPM | preemptions off / FCFS / LPM |", "| --- |" + " --- |" * 5]
    for name, r in results.items():
        for o, f, l in zip(r["off"], r["fcfs"], r["lpm"]):
            lines.append(f"| {name} | {f['slots']} | {100 * f['hit_rate']:.1f}% / {100 * l['hit_rate']:.1f}% | "
                         f"{o['throughput']:.2f} / {f['throughput']:.2f} / {l['throughput']:.2f} | "
                         f"{o['ttft']:.2f} / {f['ttft']:.2f} / {l['ttft']:.2f} | "
                         f"{o['preemptions']} / {f['preemptions']} / {l['preemptions']} |")
    return lines


def plot(engine: dict | None, scale: dict, path: Path) -> None:
    panels = (1 if engine else 0) + len(scale)
    fig, axes = plt.subplots(1, panels, figsize=(5.4 * panels, 5.0), squeeze=False)
    axes = list(axes[0])
    colors = {"off": "#999999", "fcfs": "#1b6ca8", "lpm": "#e07b39"}
    if engine:
        ax = axes.pop(0)
        x = np.arange(len(engine))
        for i, mode in enumerate(MODES):
            hits = [100 * engine[w][mode]["hit_rate"] for w in engine]
            ax.bar(x + (i - 1) * 0.27, hits, 0.27, color=colors[mode], label=MODE_LABELS[mode])
            for xi, w in zip(x, engine):
                if mode != "off":
                    ax.text(xi + (i - 1) * 0.27, 100 * engine[w][mode]["hit_rate"] + 1.5,
                            f"{engine[w][mode]['cpu_speedup']:.1f}x", ha="center", fontsize=7)
        ax.hlines([100 * engine[w]["off"]["hit_ceiling"] for w in engine], x - 0.42, x + 0.42, colors="black",
                  linestyles="dashed", linewidth=1, label="ceiling (in order, each alone, nothing evicted)")
        ax.set_xticks(x, [w.split(" (")[0].replace(" ", "\n", 1) for w in engine], fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_ylabel("prefix-cache hit rate (%)")
        ax.set_title("Real engine on CPU (SmolLM2-135M)\nlabels: requests per CPU second vs caching off (median)",
                     fontsize=10)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    for ax, (name, r) in zip(axes, scale.items()):
        slots = [row["slots"] for row in r["fcfs"]]
        for order in ("fcfs", "lpm"):
            ax.plot(slots, [100 * row["hit_rate"] for row in r[order]], "o-", color=colors[order],
                    label=f"hit rate, {MODE_LABELS[order]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV pool size (tokens)")
        ax.set_ylabel("prefix-cache hit rate (%, solid)")
        ax.set_ylim(0, 100)
        ax.set_title(f"Simulated A100 / OPT-13B\n{name}", fontsize=10)
        tx = ax.twinx()
        for mode in MODES:
            tx.plot(slots, [row["ttft"] for row in r[mode]], "s--", color=colors[mode], alpha=0.6, markersize=4,
                    label=f"mean TTFT, {MODE_LABELS[mode]}")
        tx.set_yscale("log")
        tx.set_ylabel("mean time to first token (s, dashed)")
        handles = [h for a in (ax, tx) for h in a.get_legend_handles_labels()[0]]
        ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper center",
                  bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def engine_findings(engine: dict) -> str:
    """The engine part's findings, computed: hit rates against each workload's ceiling, CPU-time speedups,
    how far FCFS and LPM differ, preemptions."""
    lpm = {w: r["lpm"]["hit_rate"] for w, r in engine.items()}
    ceilings = [r["lpm"]["hit_ceiling"] for r in engine.values()]
    cpu = [r[m]["cpu_speedup"] for r in engine.values() for m in ("fcfs", "lpm")]
    runs = [x for r in engine.values() for m in ("fcfs", "lpm") for x in r[m]["cpu_speedup_runs"]]
    repeats = len(runs) // len(cpu)
    gap = max(abs(r["lpm"]["hit_rate"] - r["fcfs"]["hit_rate"]) for r in engine.values())
    preempted = sum(r[m]["preemptions"] for r in engine.values() for m in MODES)
    return (f"LPM's hit rate is {', '.join(f'{100 * h:.0f}%' for h in lpm.values())} on the four workloads, "
            f"whose ceilings are {', '.join(f'{100 * c:.0f}%' for c in ceilings)} (the most whole-page hits on "
            "their requests in submission order, each alone, nothing evicted). The ceilings are set by how the "
            "workloads are built (prefix and question lengths), so the hit rates show the cache reaching what "
            f"each workload shares, not a reproduction of the paper's {PAPER_HIT_RATES}. A request misses its "
            "ceiling when it runs alongside the request that computes its prefix, finds that prefix evicted, or "
            "(LPM) is admitted before a request whose prompt is its prefix. Caching cuts the CPU time per request "
            f"by {min(cpu):.2f}-{max(cpu):.2f}x (requests per CPU second over caching off, the median of "
            f"{repeats} repeats paired with caching off; single runs {min(runs):.2f}-{max(runs):.2f}x). FCFS and LPM "
            f"differ by at most {100 * gap:.0f} points of hit rate here. {preempted} preemptions over a repeat's runs "
            "(the hit rates count each request once, at its first admission).")


def scale_findings(scale: dict) -> str:
    """Per simulated workload: hit rates at the smallest and largest pool, and LPM over FCFS in throughput
    at the smallest."""
    out = []
    for name, r in scale.items():
        f0, l0, o0 = r["fcfs"][0], r["lpm"][0], r["off"][0]
        f1, l1, o1 = r["fcfs"][-1], r["lpm"][-1], r["off"][-1]
        lpm_hits = [row["hit_rate"] for row in r["lpm"]]
        out.append(f"{name}: at the largest pool ({f1['slots']} tokens) FCFS and LPM hit {100 * f1['hit_rate']:.1f}% / "
                   f"{100 * l1['hit_rate']:.1f}% (caching off serves {o1['throughput']:.1f} req/s, caching on "
                   f"{l1['throughput']:.1f}); at the smallest ({f0['slots']}) FCFS hits {100 * f0['hit_rate']:.1f}% "
                   f"and LPM {100 * l0['hit_rate']:.1f}% (over all pools LPM ranges "
                   f"{100 * min(lpm_hits):.0f}-{100 * max(lpm_hits):.0f}%) and serves {l0['throughput'] / f0['throughput']:.2f}x "
                   f"FCFS's requests/s ({o0['throughput']:.2f} with caching off); there the requests queue (mean TTFT "
                   f"FCFS / LPM {f0['ttft']:.2f} / {l0['ttft']:.2f} s, against {f1['ttft']:.2f} / {l1['ttft']:.2f} s at "
                   "the largest pool), so the hit rates also depend on how deep the queue grows.")
    return " ".join(out)


def summary(scale: dict) -> dict:
    """The README's simulator numbers: few-shot at the smallest pool, and LPM's hit rate at every pool."""
    r = next(iter(scale.values()))
    return {"pool_tokens": r["fcfs"][0]["slots"], "fcfs_hit_rate": r["fcfs"][0]["hit_rate"],
            "lpm_hit_rate": r["lpm"][0]["hit_rate"], "fcfs_ttft": r["fcfs"][0]["ttft"],
            "lpm_ttft": r["lpm"][0]["ttft"], "lpm_hit_rates": [row["hit_rate"] for row in r["lpm"]]}


def engine_setup(engine: dict, args: argparse.Namespace) -> str:
    """How the engine part ran (only for a run that had one)."""
    kv_tokens = int(next(iter(next(iter(engine.values())).values()))["kv_tokens"])
    return f"""SmolLM2-135M (embedded model), xla attention, float32, {args.engine_kv_mib} MiB of KV cache ({kv_tokens}
tokens, cached and in use together), block size 16, at most 256 tokens and 8 requests per step, greedy,
{args.max_tokens} output tokens per request, all requests of a round submitted at once (multi-turn chat:
a round per turn, each prompt carrying the model's real earlier replies). Prompts are random token ids
in the model's vocabulary. Hit rate = cached prompt tokens / prompt tokens, each request counted at its
first admission (a request re-admitted after a preemption finds its own blocks cached, which is not a
prefix hit); throughput = requests per wall second; the speedup per CPU second of the process (the
work saved: steadier than wall time on these two shared cores); TTFT includes queueing behind the other
requests of the round. Each workload and mode runs {args.repeats} times on fresh engines, the three modes
of a repeat back to back in a rotating order; req/s and TTFT are medians over the repeats, a speedup is
the median of the repeats' ratios to the same repeat's run with caching off (the range in brackets).

{chr(10).join(engine_table(engine))}"""


def report(engine: dict | None, scale: dict, args: argparse.Namespace) -> str:
    engine_section = engine_setup(engine, args) if engine else "(skipped: --skip-engine)"
    skipped = 1 - 1 / PAPER_SPEEDUP
    return f"""The paper (Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", 2024)
reports cache hit rates of {PAPER_HIT_RATES} on its benchmarks (few-shot, multi-turn chat, tree of
thought, long-document QA, agents), and up to {PAPER_SPEEDUP}x the throughput of state-of-the-art inference
systems for SGLang as a whole (RadixAttention with its other optimizations, such as compressed finite-state
machines for constrained decoding), on GPUs and 7B-70B models.

![hit rates](radix_hit_rate.png)

## 1. The real engine on CPU

{engine_section}

{engine_findings(engine) if engine else ""}

How to read it: the first request of each task, document or tree finds nothing; the question and any
partial last page of a shared prefix are always computed (matches are whole 16-token pages and leave one
prompt token to compute). On CPU a step's cost is nearly all prefill compute, so the speedup follows the
share of prompt tokens that need none; were prefill the whole cost and the paper's {PAPER_SPEEDUP}x all prefix
reuse, it would need {skipped:.0%} of prefill skipped. The runs last seconds on a shared machine, so wall-clock differences of a few
tens of percent are noise; CPU time moves too when the machine's load changes between runs.

## 2. The simulator at scale

OPT-13B on an A100-40GB (cost model `llmjax.sim.A100_40GB_OPT_13B`), our scheduler (2048 tokens,
256 requests per step) and KV manager with prefix caching, block size 16, pool size swept. Few-shot:
80 tasks whose 5 examples make a 320-token prefix, 20 questions of 32 tokens each, interleaved,
Poisson at 30 req/s, outputs log-normal with mean 32. Chat: 300 conversations of 5 turns sharing a
128-token system prompt, conversations starting at 4/s, each turn an exponential think time (mean 60 s)
after the previous turn finished (its prompt holds that turn's reply), replies log-normal with mean 80 tokens (the replies in the prompts are the
simulator's dummy tokens). Seed {args.seed}. Hit rate counts each request's first admission only.

{chr(10).join(scale_table(scale))}

{scale_findings(scale)}

How to read it: below the working set (every task's examples; every live conversation's history), LRU
eviction drops prefixes before their reuse; LPM admits the queued requests that share a cached prefix
together, before it is evicted. That helps few-shot, where many queued questions share one task's
examples. A conversation has at most one turn queued at a time (the next waits for its reply and the
user's think time), so no queued requests share its history and LPM's order finds nothing to group:
in chat its hit rate and time to first token stay close to FCFS's.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="engine model: a preset, smollm2, a .gguf file or an HF folder "
                        "(default: the embedded SmolLM2-135M)")
    parser.add_argument("--engine-kv-mib", type=positive_int, default=48)
    parser.add_argument("--max-tokens", type=positive_int, default=8)
    parser.add_argument("--pool-tokens", type=positive_int, nargs="+",
                        default=[4096, 8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of each engine workload and mode (fresh "
                        "engines, modes in a rotating order); the speedups are medians of runs paired by repeat")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: the simulator at two pool sizes, no "
                        "engine; written to build/results-quick/")
    parser.add_argument("--out", type=Path, default=None, help="default: results/ (quick: build/results-quick/)")
    args = parse_quick(parser, dict(skip_engine=True, pool_tokens=[4096, 65536]))
    if not args.skip_engine:
        check_model(parser, args.model)
    workloads = scale_traces(args.seed)
    block = SCALE_CONFIG.block_size
    longest = max(len(t.prompt) + t.output_len for trace in workloads.values() for t in trace)
    if min(args.pool_tokens) // block < -(-longest // block):
        parser.error(f"--pool-tokens: the longest simulated request ({longest} tokens) needs "
                     f"{-(-longest // block) * block} tokens of pool in blocks of {block}")
    out = args.out or results_dir(args.quick)
    engine = None if args.skip_engine else engine_part(args)
    scale = scale_part(workloads, args.pool_tokens)
    if engine:
        print("\n" + "\n".join(engine_table(engine)))
    print("\n" + "\n".join(scale_table(scale)))
    out.mkdir(parents=True, exist_ok=True)
    plot(engine, scale, out / "radix_hit_rate.png")
    command = "python -m paper_repro.radix_hit_rate" + (" --skip-engine" if args.skip_engine else "")
    write_results(out, "radix_hit_rate", f"# Prefix-cache hit rates: RadixAttention (SGLang) on our engine\n\n"
                  f"`{command}`\n\n" + report(engine, scale, args),
                  {"engine": engine, "scale": {**scale, "summary": summary(scale)},
                   "paper": {"hit_rate_min": PAPER_HIT_RANGE[0], "hit_rate_max": PAPER_HIT_RANGE[1],
                             "speedup": PAPER_SPEEDUP},
                   "args": {k: v for k, v in vars(args).items() if k != "out"}})
    print(f"wrote {out / 'radix_hit_rate.md'}, .json and .png")


if __name__ == "__main__":
    main()
