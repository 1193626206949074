"""Offline throughput: llmjax against HF transformers `generate` (and llama.cpp when installed), one run.

Workloads (random token ids, fixed seed, greedy, ignore_eos):
  default  128 requests, prompts uniform in [16, 512] tokens, outputs uniform in [16, 256];
  equal    32 requests, prompts of 256 tokens, outputs of 64 (no padding waste for HF).
Systems, each timed after a warm-up (no compilation in the timed pass; the count is printed):
  1. llmjax at its default settings (`LLM()`), and at its best (`--llmjax-best`, default the
     mixed-precision path: bfloat16 weights and KV cache, float32 accumulation);
  2. HF transformers `generate` with static batches, swept over dtype x batch size x request order
     (arrival order, or sorted by prompt length: HF's best practice against padding), torch threads
     set to the cores, each configuration warmed up by a short generation of one of its batches;
     the best configuration is HF's baseline;
  3. llama.cpp through llama-cpp-python on the shipped GGUF, one request at a time (its Python API
     decodes one sequence), when the package is installed.
llmjax's configurations run `--repeats` times; HF's grid is screened with one pass per configuration,
then the fastest configuration of each dtype runs `--repeats` times in all (`--no-hf-screen`: every
configuration `--repeats` times). The table gives the median and the range of output tokens/s. Then
llmjax's best and HF's best run `--pairs` more times each, alternately (ABBA order, so a drift in the
machine's speed during the run weighs on both alike); the headline ratio is the median of the pairs'
ratios, each pair timed within a minute or two, not the ratio of two medians taken far apart. The roofline: each dtype's matmul peak measured on the model's own matmul shapes (best of
several runs, XLA for llmjax and torch for HF), the achieved model FLOP/s of every system against
its own precision's peak, and a steady 64-request decode step of llmjax against its peak and against
its floor on this machine: the KV cache it reads at the measured memory bandwidth, then its linear
layers at the peak (or their weights at the bandwidth, if slower).

On a shared CPU absolute numbers move with the load; only ratios measured in the same run mean
anything. The full grid on the default workload takes hours (HF alone: 2 dtypes x 5 batches x 2
orders, screened): pick a subset with the flags, watch the progress bar's ETA.

    python experiments/offline_throughput.py [--workload default|equal] [--num-requests N]
        [--hf-dtypes float32,bfloat16] [--hf-batch-sizes 8,16,32,64,128] [--hf-orders arrival,sorted]
        [--repeats 3] [--pairs 3] [--systems llmjax-default,llmjax-best,hf,llama.cpp] [--out-name NAME]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmjax.cpu_flags import apply_cpu_flags  # noqa: E402

apply_cpu_flags()  # before anything starts JAX's backend

from llmjax.provenance import results_dir, write_results  # noqa: E402

VOCAB = 49152
DEFAULT_BEST = "dtype=bfloat16,max_num_seqs=128,max_num_batched_tokens=512"


# --- workload and work ----------------------------------------------------------------------------------
def workload(kind: str, n: int | None, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    if kind == "equal":
        n = n or 32
        prompt_lens, output_lens = np.full(n, 256), np.full(n, 64)
    else:
        n = n or 128
        prompt_lens, output_lens = rng.integers(16, 513, size=n), rng.integers(16, 257, size=n)
    prompts = [rng.integers(100, VOCAB, size=int(p)).tolist() for p in prompt_lens]
    return prompts, [int(o) for o in output_lens]


def model_flops(cfg, prompts: list[list[int]], outputs: list[int]) -> float:
    """The work any engine must do: 2 x (the layers' matmul parameters) per processed token, the LM head
    (2 x vocab x hidden) once per output token, and attention (QK^T and PV: 4 x layers x heads x head_dim
    per causal query-key pair). The embedding lookup is a gather, not a matmul."""
    tokens = sum(len(p) for p in prompts) + sum(outputs)
    h, d, q, kv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    layer = h * q * d * 2 + h * kv * d * 2 + 3 * h * cfg.intermediate_size  # q, o, k, v, gate, up, down
    attn = sum((len(p) + o) * (len(p) + o + 1) // 2 for p, o in zip(prompts, outputs))
    return (2 * cfg.num_layers * layer * tokens + 2 * cfg.vocab_size * h * sum(outputs)
            + 4 * cfg.num_layers * q * d * attn)


def matmul_shapes(cfg) -> list[tuple[int, int, int]]:
    """(in, out, count per token) of the model's matmuls: one layer's projections times layers, LM head."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    return [(h, cfg.num_heads * d, 2 * layers), (h, cfg.num_kv_heads * d, 2 * layers),
            (h, cfg.intermediate_size, 2 * layers), (cfg.intermediate_size, h, layers), (h, cfg.vocab_size, 1)]


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(cfg, library: str, dtype: str, rows: int, repeats: int = 7) -> float:
    """FLOP/s of the model's matmul mix at `rows` tokens (FLOP-weighted: total FLOPs / total best time).

    XLA ("xla"): float32 x float32, or bfloat16 x bfloat16 accumulated in float32 (llmjax's paths);
    AMX ("amx", bfloat16 only): `llmjax.ops.amx_matmul` on pre-packed weights (llmjax's bfloat16
    path on a CPU with AMX); torch ("torch"): its matmul in `dtype` (HF's)."""
    flops = seconds = 0.0
    for k, n, count in matmul_shapes(cfg):
        if library in ("xla", "amx"):
            import jax
            import jax.numpy as jnp

            dt = jnp.dtype(dtype)
            a, b = jnp.ones((rows, k), dt), jnp.full((k, n), 0.01, dt)
            f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
            if library == "amx":
                from llmjax.ops.amx_matmul import amx_matmul, pack_weight

                b = jnp.asarray(pack_weight(np.asarray(b)))
                f = jax.jit(lambda x, y, n=n: amx_matmul(x, y, n))
            best = _best_time(lambda: f(a, b).block_until_ready(), repeats)
        else:
            import torch

            dt = getattr(torch, dtype)
            a, b = torch.ones(rows, k, dtype=dt), torch.full((k, n), 0.01, dtype=dt)
            best = _best_time(lambda: a @ b, repeats)
        flops += 2 * rows * k * n * count
        seconds += best * count
    return flops / seconds


def memory_bandwidth(repeats: int = 7) -> float:
    """Bytes/s this machine reads from memory: torch (all cores) summing a 1 GiB float32 array, best of
    `repeats` (the array is 1 GiB so caches do not hold it)."""
    import torch

    x = torch.ones(1 << 28, dtype=torch.float32)
    return x.numel() * x.element_size() / _best_time(lambda: float(x.sum()), repeats)


def decode_floor(step: dict, bandwidth: float, peak: float) -> float:
    """Seconds a steady decode step needs at least on this machine with attention and the matmuls one
    after the other (as a layer runs them): the KV cache read at the memory bandwidth (attention
    does ~2 FLOPs per byte it reads), then the linear layers at the larger of their weights'
    read time and their FLOPs at the matmul peak."""
    return step["kv_bytes"] / bandwidth + max(step["weight_bytes"] / bandwidth, step["matmul_flops"] / peak)


# --- the systems --------------------------------------------------------------------------------------
def parse_settings(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        out[key] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value.lower(), value)
    return out


class LLMJaxRun:
    """One llmjax configuration: built once, warmed up on the workload, then timed `repeats` times."""

    def __init__(self, settings: dict):
        from llmjax.llm import LLM

        self.settings = settings
        self.llm = LLM(None, **settings)
        self.engine = self.llm.engine

    def generate(self, prompts, outputs):
        from llmjax.sampling_params import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]
        results = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        self.engine.kv.reset_prefix_cache()  # the next pass must not reuse these prompts' blocks
        return [r.outputs[0].token_ids for r in results]

    def timed(self, prompts, outputs):
        compiles = self.engine.runner.num_compiles
        t = time.perf_counter()
        tokens = self.generate(prompts, outputs)
        return time.perf_counter() - t, tokens, self.engine.runner.num_compiles - compiles

    def decode_step(self, repeats: int = 7) -> dict:
        """One steady decode step: 64 requests with contexts 380-420. Its seconds (best of runs), its
        FLOP/s, the linear layers' FLOPs and weight bytes, and the bytes of KV cache it reads."""
        import jax

        from experiments.step_profile import make_step
        from llmjax.step_input import HostInputs
        from llmjax.attention.cache_dtype import value_dtype

        runner, cfg = self.engine.runner, self.engine.model_config
        rng = np.random.default_rng(0)
        contexts = rng.integers(380, 421, 64)
        bs = runner.block_size
        t, s, b = runner.buckets.shape(64, 64, -(-int(contexts.max()) // bs))
        step = make_step([1] * 64, contexts, t, s, b, bs, self.engine.num_blocks, rng)
        inputs = HostInputs.pack(step, runner.padding_inputs(t, s, b).sampling_input())  # greedy

        def run():
            jax.block_until_ready(runner.run(inputs, True))

        seconds = _best_time(run, repeats)
        prompts = [[0] * (int(c) - 1) for c in contexts]  # the step's work: one new token at each context
        work = model_flops(cfg, prompts, [1] * 64) - model_flops(cfg, prompts, [0] * 64)
        weights = sum(k * n * count for k, n, count in matmul_shapes(cfg))
        item = np.dtype(jax.tree.leaves(runner.params)[0].dtype).itemsize
        kv_item = np.dtype(value_dtype(runner.cache[0].dtype)).itemsize
        return dict(seconds=seconds, flops=work / seconds, matmul_flops=2 * 64 * weights,
                    weight_bytes=weights * item, kv_bytes=int(contexts.sum()) * cfg.kv_bytes_per_token(kv_item))


class HFModels:
    """HF transformers models on the shipped GGUF, one per dtype, loaded on first use."""

    def __init__(self):
        import torch

        torch.set_num_threads(os.cpu_count())
        self.threads = torch.get_num_threads()
        self.models = {}

    def get(self, dtype: str):
        if dtype not in self.models:
            import torch
            from transformers import AutoModelForCausalLM

            from llmjax.models.loader import embedded_model_path

            path = embedded_model_path()
            self.models[dtype] = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
        return self.models[dtype]

    def generate(self, dtype: str, batch_size: int, order: str, prompts, outputs) -> list[list[int]]:
        """Static batches of `batch_size` (left padding, KV cache on), in arrival order or sorted by prompt
        length; returns each request's tokens in the original order."""
        import torch

        model = self.get(dtype)
        index = list(range(len(prompts)))
        if order == "sorted":
            index.sort(key=lambda i: len(prompts[i]))
        tokens: dict[int, list[int]] = {}
        for start in range(0, len(index), batch_size):
            batch = index[start : start + batch_size]
            width = max(len(prompts[i]) for i in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            new = max(outputs[i] for i in batch)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
            for row, i in enumerate(batch):
                tokens[i] = out[row, width : width + outputs[i]].tolist()
        return [tokens[i] for i in range(len(prompts))]


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the shipped GGUF, greedy, one request at a time."""

    def __init__(self, max_len: int):
        from llama_cpp import Llama

        from llmjax.models.loader import embedded_model_path

        self.llm = Llama(model_path=str(embedded_model_path()), n_ctx=max_len, n_batch=512,
                         n_threads=os.cpu_count(), verbose=False)

    def generate(self, prompts, outputs) -> list[list[int]]:
        results = []
        for prompt, n in zip(prompts, outputs):
            self.llm.reset()
            tokens = []
            for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                tokens.append(int(token))
                if len(tokens) == n:
                    break
            results.append(tokens)
        return results


# --- the run ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("default", "equal"), default="default")
    parser.add_argument("--num-requests", type=int, default=None, help="default: 128 (default), 32 (equal)")
    parser.add_argument("--systems", default="llmjax-default,llmjax-best,hf,llama.cpp")
    parser.add_argument("--hf-dtypes", default="float32,bfloat16")
    parser.add_argument("--hf-batch-sizes", default="8,16,32,64,128")
    parser.add_argument("--hf-orders", default="arrival,sorted", help="arrival and/or sorted (by prompt length)")
    parser.add_argument("--llmjax-best", default=DEFAULT_BEST, help="EngineConfig fields of llmjax's best setting")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3,
                        help="passes of llmjax's best and HF's best, alternately, for the paired ratio (0: none)")
    parser.add_argument("--hf-screen", action=argparse.BooleanOptionalAction, default=True,
                        help="one pass per HF configuration, then --repeats passes of each dtype's fastest")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="llmjax's KV pool in both settings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-name", default=None, help="results/<name>.md|json (default: offline_throughput, "
                                                         "offline_throughput_equal for --workload equal)")
    args = parser.parse_args()

    prompts, outputs = workload(args.workload, args.num_requests, args.seed)
    n_req, total_out = len(prompts), sum(outputs)
    systems = args.systems.split(",")
    kv = dict(kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), max_model_len=1024)
    llmjax_settings = {"llmjax-default": kv, "llmjax-best": {**kv, **parse_settings(args.llmjax_best)}}
    hf_grid = [(d, int(b), o) for d in args.hf_dtypes.split(",") for b in args.hf_batch_sizes.split(",")
               for o in args.hf_orders.split(",")] if "hf" in systems else []
    if "llama.cpp" in systems:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama.cpp: llama-cpp-python is not installed; skipped")
            systems.remove("llama.cpp")
    plan = [(s, None) for s in systems if s.startswith("llmjax")] + [("hf", c) for c in hf_grid]
    plan += [("llama.cpp", None)] if "llama.cpp" in systems else []
    hf_passes = (len(hf_grid) + (args.repeats - 1) * len({d for d, _, _ in hf_grid})) if args.hf_screen \
        else len(hf_grid) * args.repeats
    pairs = args.pairs if hf_grid and any(s.startswith("llmjax") for s in systems) else 0
    total_passes = (len(plan) - len(hf_grid)) * args.repeats + hf_passes + 2 * pairs
    print(f"{n_req} requests, {total_out} output tokens; {len(plan)} configurations, {total_passes} timed passes")

    import jax

    from llmjax.attention.cache_dtype import value_dtype
    from llmjax.models.loader import load_model

    cfg = load_model(None).config
    flops = model_flops(cfg, prompts, outputs)
    runs: dict[str, dict] = {}
    hf_models = HFModels() if hf_grid else None
    reference_tokens: dict[str, list[list[int]]] = {}
    engines: dict[str, LLMJaxRun] = {}  # kept for the paired passes
    bar = tqdm(total=total_passes, desc="timed passes", unit="pass")

    def hf_passes_of(name, dtype, batch, order, count):
        if count and not runs[name]["times"]:  # warm-up: torch's first calls at this batch shape
            bar.set_postfix_str(f"{name}: warm-up")
            hf_models.generate(dtype, batch, order, prompts[:batch], [2] * len(prompts[:batch]))
        for _ in range(count):
            bar.set_postfix_str(name)
            t = time.perf_counter()
            tokens = hf_models.generate(dtype, batch, order, prompts, outputs)
            runs[name]["times"].append(time.perf_counter() - t)
            bar.update()
        if count:
            reference_tokens.setdefault(dtype, tokens)

    for system, conf in plan:
        if system.startswith("llmjax"):
            run = LLMJaxRun(llmjax_settings[system])
            bar.set_postfix_str(f"{system}: warm-up")
            run.generate(prompts, outputs)  # compiles the step buckets this workload uses
            times, compiles = [], 0
            for _ in range(args.repeats):
                bar.set_postfix_str(system)
                seconds, tokens, c = run.timed(prompts, outputs)
                times.append(seconds)
                compiles += c
                bar.update()
            dtype = str(value_dtype(jax.tree.leaves(run.engine.runner.params)[0].dtype))
            step = run.decode_step()
            runs[system] = dict(times=times, tokens=tokens, compiles=compiles, dtype=dtype,
                                settings={k: v for k, v in run.settings.items()},
                                decode_step_flops=step["flops"], decode_step_s=step["seconds"], decode_step=step)
            engines[system] = run
        elif system == "hf":
            dtype, batch, order = conf
            name = f"hf {dtype} batch {batch} {order}"
            runs[name] = dict(times=[], dtype=dtype, batch=batch, order=order)
            hf_passes_of(name, dtype, batch, order, 1 if args.hf_screen else args.repeats)
        else:
            engine = LlamaCpp(max_len=1024)
            engine.generate(prompts[:2], [2, 2])  # warm-up
            times = []
            for _ in range(args.repeats):
                bar.set_postfix_str("llama.cpp")
                t = time.perf_counter()
                tokens = engine.generate(prompts, outputs)
                times.append(time.perf_counter() - t)
                bar.update()
            runs["llama.cpp"] = dict(times=times, tokens=tokens, dtype="gguf (Q4_1/Q8_0)")
    if args.hf_screen:  # the fastest configuration of each dtype: the rest of its passes
        for dtype in {d for d, _, _ in hf_grid}:
            name = min((k for k in runs if k.startswith(f"hf {dtype} ")), key=lambda k: runs[k]["times"][0])
            r = runs[name]
            hf_passes_of(name, dtype, r["batch"], r["order"], args.repeats - 1)
    paired = paired_passes(runs, engines, hf_models, pairs, prompts, outputs, bar) if pairs else None
    engines.clear()
    bar.close()

    print("measuring matmul peaks on the model's shapes")
    from llmjax.ops import amx_matmul

    peaks = {}  # every library's peak on every dtype of the run: a dtype's peak is the best of them
    for dtype in sorted({r["dtype"] for r in runs.values() if r["dtype"] in ("float32", "bfloat16")}):
        libs = ("xla", "torch") + (("amx",) if dtype == "bfloat16" and amx_matmul.enabled(dtype) else ())
        for lib in libs:
            for rows in (64, 512):
                peaks[f"{lib} {dtype} {rows}"] = matmul_peak(cfg, lib, dtype, rows)

    print("measuring the memory bandwidth")
    bandwidth = memory_bandwidth()

    report, data = summarize(args, runs, peaks, bandwidth, flops, total_out, n_req, hf_models, reference_tokens,
                             paired)
    name = args.out_name or ("offline_throughput_equal" if args.workload == "equal" else "offline_throughput")
    write_results(results_dir(), name, "# Offline throughput\n\n" + report, data)
    plot(runs, total_out, results_dir() / f"{name}.png")
    print(report)


def paired_passes(runs, engines, hf_models, pairs, prompts, outputs, bar) -> dict:
    """`pairs` passes each of llmjax's best and HF's best configuration (by median so far), alternately
    in ABBA order; {"llmjax", "hf": the configurations, "llmjax_s", "hf_s": their seconds by pair,
    "ratios": HF's seconds over llmjax's, pair by pair, "compiles": llmjax's compilations}."""
    def best_of(prefix):
        return min((k for k in runs if k.startswith(prefix)), key=lambda k: statistics.median(runs[k]["times"]))

    ours, hf = best_of("llmjax"), best_of("hf ")
    run, conf = engines[ours], runs[hf]
    result = dict(llmjax=ours, hf=hf, llmjax_s=[], hf_s=[], compiles=0)

    def pass_of(system):
        bar.set_postfix_str(f"paired: {system}")
        if system == "llmjax":
            seconds, _, compiles = run.timed(prompts, outputs)
            result["compiles"] += compiles
        else:
            t = time.perf_counter()
            hf_models.generate(conf["dtype"], conf["batch"], conf["order"], prompts, outputs)
            seconds = time.perf_counter() - t
        result[f"{system}_s"].append(seconds)
        bar.update()

    for i in range(pairs):
        for system in (("llmjax", "hf") if i % 2 == 0 else ("hf", "llmjax")):
            pass_of(system)
    result["ratios"] = [h / o for h, o in zip(result["hf_s"], result["llmjax_s"])]
    result["ratio_median"] = statistics.median(result["ratios"])
    return result


def summarize(args, runs, peaks, bandwidth, flops, total_out, n_req, hf_models, reference_tokens, paired=None):
    def med(r):
        return statistics.median(r["times"])

    def toks(seconds):
        return total_out / seconds

    def best_peak(dtype, rows):
        """The machine's best FLOP/s for `dtype` at `rows` (any library) and the library."""
        found = [(v, k.split()[0]) for k, v in peaks.items() if k.endswith(f" {dtype} {rows}")]
        return max(found) if found else (None, None)

    def peak_of(name, r):
        return best_peak(r["dtype"], 512)[0]

    groups = {"llmjax": [k for k in runs if k.startswith("llmjax")], "hf": [k for k in runs if k.startswith("hf")],
              "llama.cpp": [k for k in runs if k == "llama.cpp"]}
    best = {g: min(ks, key=lambda k: med(runs[k])) for g, ks in groups.items() if ks}
    peers = [g for g in ("hf", "llama.cpp") if g in best]
    head = "| system | dtype | passes | output tok/s (median, range) | " + " | ".join(f"vs {p}'s best" for p in peers)
    head += " | model GFLOP/s | % of its precision's peak |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, r in sorted(runs.items(), key=lambda kv: med(kv[1])):
        speeds = sorted(toks(t) for t in r["times"])
        ratios = " | ".join(f"{med(runs[best[p]]) / med(r):.2f}x" for p in peers)
        achieved = flops / med(r)
        peak = peak_of(name, r)
        pct = f"{100 * achieved / peak:.0f}%" if peak else "n/a"
        mark = " **best**" if name in best.values() else ""
        lines.append(f"| {name}{mark} | {r['dtype']} | {len(r['times'])} | "
                     f"{toks(med(r)):.1f} ({speeds[0]:.1f}-{speeds[-1]:.1f}) | "
                     f"{ratios} | {achieved / 1e9:.1f} | {pct} |")
    notes = [
        "",
        f"Workload `{args.workload}`: {n_req} requests, {total_out} output tokens, greedy, ignore_eos; SmolLM2-135M "
        f"(embedded GGUF, dequantized). {args.repeats} timed passes per configuration after a warm-up.",
        "The CPU is shared with other jobs: absolute numbers move with the load; compare ratios from one run.",
    ]
    if hf_models:
        notes.append(f"HF: torch {hf_models.threads} threads (= cores, `torch.set_num_threads`).")
    for g in ("llmjax",):
        for name in groups[g]:
            r = runs[name]
            ref = reference_tokens.get(r["dtype"])
            same = f"; greedy outputs equal to HF {r['dtype']}: {sum(a == b for a, b in zip(r['tokens'], ref))} of " \
                   f"{n_req}" if ref else ""
            decode_peak, decode_lib = best_peak(r["dtype"], 64)
            notes.append(f"{name} ({r['settings']}): {r['compiles']} compilations in the timed passes{same}; steady "
                         f"64-request decode step {r['decode_step_s'] * 1e3:.0f} ms = "
                         f"{r['decode_step_flops'] / 1e9:.0f} GFLOP/s = "
                         f"{100 * r['decode_step_flops'] / decode_peak:.0f}% of the machine's "
                         f"{r['dtype']} matmul peak at 64 rows ({decode_lib}).")
            step = r["decode_step"]
            floor = decode_floor(step, bandwidth, decode_peak)
            notes.append(f"Its floor here: {step['kv_bytes'] / 1e6:.0f} MB of KV cache at the memory bandwidth "
                         f"({step['kv_bytes'] / bandwidth * 1e3:.1f} ms), then the linear layers "
                         f"({step['matmul_flops'] / 1e9:.1f} GFLOP at the 64-row peak "
                         f"{step['matmul_flops'] / decode_peak * 1e3:.1f} ms; their {step['weight_bytes'] / 1e6:.0f} MB "
                         f"of weights {step['weight_bytes'] / bandwidth * 1e3:.1f} ms): {floor * 1e3:.1f} ms, at most "
                         f"{100 * r['decode_step_flops'] * r['decode_step_s'] / floor / decode_peak:.0f}% of the peak "
                         f"with attention and the matmuls one after the other; the step took "
                         f"{r['decode_step_s'] / floor:.1f}x its floor.")
    notes.append(f"Memory bandwidth: {bandwidth / 1e9:.1f} GB/s (torch summing 1 GiB of float32 on all cores, best of 7).")
    notes.append("Matmul peaks on the model's shapes (FLOP-weighted mix of its projections and LM head, best of 7 "
                 "runs each; XLA's dot, llmjax's AMX kernel, torch; a precision's peak is the best of them): " + "; ".join(f"{k} rows {v / 1e9:.0f} GFLOP/s" for k, v in sorted(peaks.items())) + ".")
    if "hf" in best and "llmjax" in best:
        hf_s, ours = med(runs[best["hf"]]), runs[best["llmjax"]]
        peak = peak_of(best["llmjax"], ours)
        notes.append(f"Ceiling: at 100% of the machine's {ours['dtype']} peak ({best_peak(ours['dtype'], 512)[1]}, "
                     f"512 rows) this workload takes "
                     f"{flops / peak:.1f} s, so no engine on these matmuls can exceed {hf_s / (flops / peak):.1f}x "
                     f"HF's best here; llmjax's best reached {hf_s / med(ours):.2f}x.")
    if paired:
        r = paired["ratios"]
        notes.append(f"Paired passes ({len(r)} pairs, ABBA order): {paired['llmjax']} against {paired['hf']}, "
                     f"output tok/s {' / '.join(f'{total_out / s:.1f}' for s in paired['llmjax_s'])} against "
                     f"{' / '.join(f'{total_out / s:.1f}' for s in paired['hf_s'])}; ratio by pair "
                     f"{' / '.join(f'{x:.2f}' for x in r)}x, median **{paired['ratio_median']:.2f}x** "
                     f"({paired['compiles']} compilations in llmjax's passes).")
    data = {
        "workload": args.workload, "num_requests": n_req, "output_tokens": total_out, "model_flops": flops,
        "repeats": args.repeats, "peaks_flops": peaks, "memory_bandwidth": bandwidth,
        "runs": {k: {kk: vv for kk, vv in r.items() if kk != "tokens"} for k, r in runs.items()},
        "hf_screen": args.hf_screen,
        "best": best,
        "paired": paired,
    }
    if "hf" in best and "llmjax" in best:  # the headline keys read by experiments/results_table.py
        ours = runs[best["llmjax"]]
        hf_by_batch = {}
        for k in groups["hf"]:
            b = str(runs[k]["batch"])
            hf_by_batch[b] = min(hf_by_batch.get(b, float("inf")), med(runs[k]))
        ref = reference_tokens.get(ours["dtype"])
        peak = peak_of(best["llmjax"], ours)
        hf_best = runs[best["hf"]]
        data.update(llmjax_s=med(ours), llmjax_dtype=ours["dtype"], hf_s=hf_by_batch,
                    hf_best={k: hf_best[k] for k in ("dtype", "batch", "order")},
                    achieved_flops=flops / med(ours), peak_flops=peak,
                    decode_step_flops=ours["decode_step_flops"], decode_peak_flops=best_peak(ours["dtype"], 64)[0],
                    decode_floor_flops=ours["decode_step_flops"] * ours["decode_step_s"] /
                    decode_floor(ours["decode_step"], bandwidth, best_peak(ours["dtype"], 64)[0]),
                    ratio_ceiling=med(runs[best["hf"]]) / (flops / peak),
                    identical=sum(a == b for a, b in zip(ours["tokens"], ref)) if ref else None)
    return "\n".join(lines + notes) + "\n", data


def plot(runs, total_out, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(runs, key=lambda k: statistics.median(runs[k]["times"]))
    speeds = [[total_out / t for t in runs[k]["times"]] for k in names]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    ax.barh(names, [statistics.median(s) for s in speeds],
            xerr=[[statistics.median(s) - min(s) for s in speeds], [max(s) - statistics.median(s) for s in speeds]])
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s (median, range)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
