"""Offline throughput: llmjax against HF transformers `generate` (and llama.cpp when installed), one run.

Workloads (random token ids, fixed seed, greedy, ignore_eos):
  default  128 requests, prompts uniform in [16, 512] tokens, outputs uniform in [16, 256];
  equal    32 requests, prompts of 256 tokens, outputs of 64 (no padding waste for HF).
Systems, each timed after a warm-up (no compilation in the timed pass; the count is printed):
  1. llmjax at its default settings (`LLM()`), and at its best (`--llmjax-best`, default the
     mixed-precision path: bfloat16 weights and KV cache, float32 accumulation);
  2. HF transformers `generate` with static batches, swept over dtype x batch size (sizes above the
     number of requests count once, as that number) x request order (arrival order, or sorted by
     prompt length: HF's best practice against padding), torch threads
     set to the cores, each configuration warmed up by a short generation of one of its batches;
     the best configuration is HF's baseline;
  3. llama.cpp through llama-cpp-python's C API, when the package is installed: continuously batched (as
     llama-server's parallel slots), swept over `--llama-cpp` configurations, weights x sequences decoded
     together: the shipped GGUF's own Q4_1 weights, or those converted to bfloat16 by llama.cpp's
     quantize tool (the values llmjax and HF compute with); the best is llama.cpp's baseline.
llmjax's configurations run `--repeats` times; HF's grid and llama.cpp's are screened with one pass per
configuration, then the fastest configuration of each HF dtype and of llama.cpp runs `--repeats` times in
all (`--no-screen`: every configuration `--repeats` times). The table gives the median and the range of output tokens/s. Then
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
        [--llama-cpp q4_1:64,bf16:16,bf16:64,bf16:128] [--repeats 3] [--pairs 3] [--systems llmjax-default,llmjax-best,hf,llama.cpp]
        [--out-name NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmjax.cli_types import (choice_list, non_negative_int, parse_quick, positive_finite, positive_int,  # noqa: E402
                              positive_int_list)
from llmjax.provenance import results_dir, write_results  # noqa: E402

sys.path.insert(0, str(ROOT / "experiments"))
from common import best_time  # noqa: E402

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


def matmul_peak(cfg, library: str, dtype: str, rows: int, repeats: int = 7) -> float:
    """FLOP/s of the model's matmul mix at `rows` tokens (FLOP-weighted: total FLOPs / total best time).

    XLA ("xla"): float32 x float32, or bfloat16 x bfloat16 accumulated in float32 (llmjax's paths);
    packed ("packed", bfloat16 only): `llmjax.ops.packed_matmul`'s selected kernel on pre-packed weights
    (llmjax's bfloat16 path on a CPU with AMX or AVX512-BF16); torch ("torch"): its matmul in `dtype` (HF's)."""
    flops = seconds = 0.0
    for k, n, count in matmul_shapes(cfg):
        if library in ("xla", "packed"):
            import jax
            import jax.numpy as jnp

            dt = jnp.dtype(dtype)
            a, b = jnp.ones((rows, k), dt), jnp.full((k, n), 0.01, dt)
            f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
            if library == "packed":
                from llmjax.ops.packed_matmul import pack_weight, packed_matmul

                b = jnp.asarray(pack_weight(np.asarray(b)))
                f = jax.jit(lambda x, y, n=n: packed_matmul(x, y, n))
            best = best_time(lambda: f(a, b).block_until_ready(), repeats, warm_up=True)
        else:
            import torch

            dt = getattr(torch, dtype)
            a, b = torch.ones(rows, k, dtype=dt), torch.full((k, n), 0.01, dtype=dt)
            best = best_time(lambda: a @ b, repeats, warm_up=True)
        flops += 2 * rows * k * n * count
        seconds += best * count
    return flops / seconds


def memory_bandwidth(repeats: int = 7) -> float:
    """Bytes/s this machine reads from memory: torch (all cores) summing a 1 GiB float32 array, best of
    `repeats` (the array is 1 GiB so caches do not hold it)."""
    import torch

    x = torch.ones(1 << 28, dtype=torch.float32)
    return x.numel() * x.element_size() / best_time(lambda: float(x.sum()), repeats, warm_up=True)


def decode_floor(step: dict, bandwidth: float, peak: float) -> float:
    """Seconds a steady decode step needs at least on this machine with attention and the matmuls one
    after the other (as a layer runs them): the KV cache read at the memory bandwidth (attention
    does ~2 FLOPs per byte it reads), then the linear layers at the larger of their weights'
    read time and their FLOPs at the matmul peak."""
    return step["kv_bytes"] / bandwidth + max(step["weight_bytes"] / bandwidth, step["matmul_flops"] / peak)


# --- the systems --------------------------------------------------------------------------------------
def parse_settings(text: str) -> dict:
    """`--llmjax-best`'s type: comma-separated `FIELD=VALUE`s of `EngineConfig` -> {field: value} (a
    digit string an int, true/false a bool)."""
    from llmjax.config import EngineConfig

    fields, out = {f.name for f in dataclasses.fields(EngineConfig)}, {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise argparse.ArgumentTypeError(f"expected EngineConfig FIELD=VALUE items, got {item!r}")
        out[key] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value.lower(), value)
    return out


def parse_llama_cpp(text: str) -> list[tuple[str, int]]:
    """`--llama-cpp`'s type: comma-separated `WEIGHTS:SEQUENCES` -> [(weights, sequences)]."""
    grid = []
    for item in text.split(","):
        weights, _, sequences = item.partition(":")
        if weights not in LlamaCpp.WEIGHTS or not sequences.isdigit() or int(sequences) < 1:
            raise argparse.ArgumentTypeError(f"expected WEIGHTS:SEQUENCES items, weights one of "
                                             f"{', '.join(LlamaCpp.WEIGHTS)}, got {item!r}")
        grid.append((weights, int(sequences)))
    return grid


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

        seconds = best_time(run, repeats, warm_up=True)
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


_llama_cpp_quiet = None  # llama.cpp's log callback (see LlamaCpp)


class LlamaCpp:
    """llama.cpp (llama-cpp-python's C API) on SmolLM2, greedy, continuously batched as llama-server's
    slots are: up to `seqs` sequences each decode one token in a step's single `llama_decode`, and a
    free slot takes the next prompt, whose tokens fill the rest of the step's `budget` tokens (chunked
    prefill). Each sequence has its own `max_len` KV cells (llama.cpp's advice when sequences share no
    prefix). `weights`: "q4_1", the shipped GGUF as it is; "bf16", its weights dequantized to bfloat16
    by llama.cpp's quantize tool (the values llmjax and HF compute with), written once under build/."""

    WEIGHTS = ("q4_1", "bf16")

    def __init__(self, seqs: int, max_len: int, weights: str = "q4_1", budget: int = 512):
        import llama_cpp as lc

        global _llama_cpp_quiet
        if _llama_cpp_quiet is None:  # its log lines would bury the progress bar; kept alive for llama.cpp to call
            _llama_cpp_quiet = lc.llama_log_callback(lambda level, text, user_data: None)
            lc.llama_log_set(_llama_cpp_quiet, None)
        lc.llama_backend_init()
        self.lc, self.seqs, self.budget = lc, seqs, budget
        self.model = lc.llama_model_load_from_file(str(self.weights_file(weights)).encode(),
                                                   lc.llama_model_default_params())
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = seqs * max_len, seqs, False
        params.n_batch = params.n_ubatch = budget
        params.n_threads = params.n_threads_batch = os.cpu_count()
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.model or not self.ctx:
            raise RuntimeError("llama.cpp could not load the model or make its context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(budget, 0, 1)
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def warm_up(self, prompts: list[list[int]]) -> None:
        """Two tokens for a full set of slots, untimed: llama.cpp's first decodes touch its buffers and
        start its threads."""
        self.generate(prompts[: self.seqs], [2] * len(prompts[: self.seqs]))

    @staticmethod
    def weights_file(weights: str) -> Path:
        import llama_cpp as lc

        from llmjax.models.loader import embedded_model_path

        shipped = embedded_model_path()
        if weights == "q4_1":
            return shipped
        path = ROOT / "build" / "llama_cpp" / f"{shipped.stem}.{weights}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            params = lc.llama_model_quantize_default_params()
            params.ftype, params.allow_requantize = lc.LLAMA_FTYPE_MOSTLY_BF16, True
            tmp = path.with_suffix(".tmp")
            if lc.llama_model_quantize(str(shipped).encode(), str(tmp).encode(), params) != 0:
                raise RuntimeError(f"llama.cpp could not write {weights} weights")
            tmp.rename(path)
        return path

    def generate(self, prompts: list[list[int]], outputs: list[int]) -> list[list[int]]:
        lc, batch, ctx = self.lc, self.batch, self.ctx
        results: list[list[int]] = [[] for _ in prompts]
        waiting = list(range(len(prompts)))[::-1]
        free = list(range(self.seqs))[::-1]
        running: dict[int, list[int]] = {}  # slot -> [request, tokens in its KV cache]
        while waiting or running:
            while waiting and free:
                running[free.pop()] = [waiting.pop(), 0]
            rows: list[tuple[int, int]] = []  # (batch row, slot) of the rows whose logits give a token
            n = 0

            def put(token: int, slot: int, pos: int, logits: bool) -> None:
                nonlocal n
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0], batch.logits[n] = slot, logits
                if logits:
                    rows.append((n, slot))
                n += 1

            for slot, state in running.items():  # decodes first: one token each
                i, fed = state
                if fed == len(prompts[i]):
                    put(results[i][-1], slot, fed + len(results[i]) - 1, True)
            for slot, state in running.items():  # then prompt chunks, in the budget left
                i, fed = state
                prompt = prompts[i]
                take = min(len(prompt) - fed, self.budget - n)
                for j in range(fed, fed + take):
                    put(prompt[j], slot, j, j == len(prompt) - 1)
                state[1] = fed + take
            batch.n_tokens = n
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for row, slot in rows:
                i = running[slot][0]
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(self.vocab_size,))
                results[i].append(int(logits.argmax()))
                if len(results[i]) == outputs[i]:
                    lc.llama_memory_seq_rm(self.memory, slot, -1, -1)
                    del running[slot]
                    free.append(slot)
        return results

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


# --- the run ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("default", "equal"), default="default")
    parser.add_argument("--num-requests", type=positive_int, default=None, help="default: 128 (default), 32 (equal)")
    parser.add_argument("--systems", type=choice_list("llmjax-default", "llmjax-best", "hf", "llama.cpp"),
                        default="llmjax-default,llmjax-best,hf,llama.cpp")
    parser.add_argument("--hf-dtypes", type=choice_list("float32", "bfloat16"), default="float32,bfloat16")
    parser.add_argument("--hf-batch-sizes", type=positive_int_list, default="8,16,32,64,128")
    parser.add_argument("--hf-orders", type=choice_list("arrival", "sorted"), default="arrival,sorted",
                        help="arrival and/or sorted (by prompt length)")
    parser.add_argument("--llama-cpp", type=parse_llama_cpp, default="q4_1:64,bf16:16,bf16:64,bf16:128",
                        help="llama.cpp's configurations, WEIGHTS:SEQUENCES (weights q4_1: the GGUF's own; bf16)")
    parser.add_argument("--llmjax-best", type=parse_settings, default=DEFAULT_BEST,
                        help="EngineConfig fields of llmjax's best setting")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--pairs", type=non_negative_int, default=3,
                        help="passes of llmjax's best and each peer's best (HF, llama.cpp), alternately, for the "
                             "paired ratios (0: none)")
    parser.add_argument("--screen", action=argparse.BooleanOptionalAction, default=True,
                        help="one pass per HF and llama.cpp configuration, then --repeats passes of the fastest "
                             "(HF: of each dtype)")
    parser.add_argument("--kv-cache-gib", type=positive_finite, default=4.0, help="llmjax's KV pool in both settings")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--out-name", default=None, help="results/<name>.md|json (default: offline_throughput, "
                                                         "offline_throughput_equal for --workload equal)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 requests of the equal workload, llmjax's "
                        "best against HF bfloat16 batch 4, one pass each and one pair; written to build/results-quick/")
    args = parse_quick(parser, dict(workload="equal", num_requests=4, systems=["llmjax-best", "hf"],
                                    hf_dtypes=["bfloat16"], hf_batch_sizes=[4], hf_orders=["sorted"], repeats=1, pairs=1))

    prompts, outputs = workload(args.workload, args.num_requests, args.seed)
    n_req, total_out = len(prompts), sum(outputs)
    systems = args.systems
    kv = dict(kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), max_model_len=1024)
    llmjax_settings = {"llmjax-default": kv, "llmjax-best": {**kv, **args.llmjax_best}}
    hf_batches = sorted({min(b, n_req) for b in args.hf_batch_sizes})  # at most every request
    if len(hf_batches) < len(args.hf_batch_sizes):
        print(f"HF batch sizes above the {n_req} requests are one batch of {n_req}: sweeping {hf_batches}")
    hf_grid = [(d, b, o) for d in args.hf_dtypes for b in hf_batches
               for o in args.hf_orders] if "hf" in systems else []
    if "llama.cpp" in systems:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama.cpp: llama-cpp-python is not installed; skipped")
            systems.remove("llama.cpp")
    plan = [(s, None) for s in systems if s.startswith("llmjax")] + [("hf", c) for c in hf_grid]
    llama_cpp_grid = args.llama_cpp if "llama.cpp" in systems else []
    plan += [("llama.cpp", c) for c in llama_cpp_grid]
    screened = [len(hf_grid), len({d for d, _, _ in hf_grid})], [len(llama_cpp_grid), min(1, len(llama_cpp_grid))]
    screened_passes = sum(n + (args.repeats - 1) * best if args.screen else n * args.repeats for n, best in screened)
    peers = [p for p, grid in (("hf", hf_grid), ("llama.cpp", llama_cpp_grid)) if grid]
    pairs = args.pairs if any(s.startswith("llmjax") for s in systems) else 0
    total_passes = (len(plan) - len(hf_grid) - len(llama_cpp_grid)) * args.repeats + screened_passes + 2 * pairs * len(peers)
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

    def llama_cpp_passes(run, name, count):
        engine = LlamaCpp(run["seqs"], max_len=1024, weights=run["dtype"])
        bar.set_postfix_str(f"{name}: warm-up")
        engine.warm_up(prompts)
        for _ in range(count):
            bar.set_postfix_str(name)
            t = time.perf_counter()
            run["tokens"] = engine.generate(prompts, outputs)
            run["times"].append(time.perf_counter() - t)
            bar.update()
        engine.close()

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
            hf_passes_of(name, dtype, batch, order, 1 if args.screen else args.repeats)
        else:
            weights, seqs = conf
            name = f"llama.cpp {weights} {seqs} seqs"
            runs[name] = dict(times=[], dtype=weights, seqs=seqs)
            llama_cpp_passes(runs[name], name, 1 if args.screen else args.repeats)
    if args.screen:  # the fastest configuration of each HF dtype and of llama.cpp: the rest of its passes
        for dtype in {d for d, _, _ in hf_grid}:
            name = min((k for k in runs if k.startswith(f"hf {dtype} ")), key=lambda k: runs[k]["times"][0])
            r = runs[name]
            hf_passes_of(name, dtype, r["batch"], r["order"], args.repeats - 1)
        if llama_cpp_grid:
            name = min((k for k in runs if k.startswith("llama.cpp")), key=lambda k: runs[k]["times"][0])
            llama_cpp_passes(runs[name], name, args.repeats - 1)
    paired = {peer: paired_passes(runs, engines, hf_models, pairs, prompts, outputs, bar, peer)
              for peer in peers if pairs}
    engines.clear()
    bar.close()

    print("measuring matmul peaks on the model's shapes")
    from llmjax.ops import packed_matmul

    peaks = {}  # every library's peak on every dtype of the run: a dtype's peak is the best of them
    for dtype in sorted({r["dtype"] for r in runs.values() if r["dtype"] in ("float32", "bfloat16")}):
        libs = ("xla", "torch") + (("packed",) if dtype == "bfloat16" and packed_matmul.enabled(dtype) else ())
        for lib in libs:
            for rows in (64, 512):
                peaks[f"{lib} {dtype} {rows}"] = matmul_peak(cfg, lib, dtype, rows)

    print("measuring the memory bandwidth")
    bandwidth = memory_bandwidth()

    report, data = summarize(args, runs, peaks, bandwidth, flops, total_out, n_req, hf_models, reference_tokens,
                             paired)
    name = args.out_name or ("offline_throughput_equal" if args.workload == "equal" else "offline_throughput")
    out = results_dir(args.quick)
    write_results(out, name, "# Offline throughput\n\n" + report, data)
    plot(runs, total_out, out / f"{name}.png")
    print(report)


def paired_passes(runs, engines, hf_models, pairs, prompts, outputs, bar, peer: str) -> dict:
    """`pairs` passes each of llmjax's best and `peer`'s best configuration ("hf" or "llama.cpp", by
    median so far), alternately in ABBA order; {"llmjax", "peer": the configurations, "llmjax_s",
    "peer_s": their seconds by pair, "ratios": the peer's seconds over llmjax's, pair by pair,
    "compiles": llmjax's compilations}."""
    def best_of(prefix):
        return min((k for k in runs if k.startswith(prefix)), key=lambda k: statistics.median(runs[k]["times"]))

    ours, theirs = best_of("llmjax"), best_of("hf " if peer == "hf" else peer)
    run, conf = engines[ours], runs[theirs]
    result = dict(llmjax=ours, peer=theirs, llmjax_s=[], peer_s=[], compiles=0)
    llama_cpp = LlamaCpp(conf["seqs"], max_len=1024, weights=conf["dtype"]) if peer == "llama.cpp" else None
    if llama_cpp:
        bar.set_postfix_str(f"paired: {theirs}: warm-up")
        llama_cpp.warm_up(prompts)

    def pass_of(system):
        bar.set_postfix_str(f"paired: {ours if system == 'llmjax' else theirs}")
        if system == "llmjax":
            seconds, _, compiles = run.timed(prompts, outputs)
            result["compiles"] += compiles
        else:
            t = time.perf_counter()
            if llama_cpp:
                llama_cpp.generate(prompts, outputs)
            else:
                hf_models.generate(conf["dtype"], conf["batch"], conf["order"], prompts, outputs)
            seconds = time.perf_counter() - t
        result[f"{system}_s"].append(seconds)
        bar.update()

    for i in range(pairs):
        for system in (("llmjax", "peer") if i % 2 == 0 else ("peer", "llmjax")):
            pass_of(system)
    if llama_cpp:
        llama_cpp.close()
    result["ratios"] = [p / o for p, o in zip(result["peer_s"], result["llmjax_s"])]
    result["ratio_median"] = statistics.median(result["ratios"])
    return result


def summarize(args, runs, peaks, bandwidth, flops, total_out, n_req, hf_models, reference_tokens, paired):
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
              "llama.cpp": [k for k in runs if k.startswith("llama.cpp")]}
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
        f"(embedded GGUF, dequantized). {args.repeats} timed passes per configuration after a warm-up "
        f"(a screened configuration that was not its group's fastest: one; the passes column).",
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
    if "llama.cpp" in best:
        lc = runs[best["llama.cpp"]]
        ours = runs[best["llmjax"]]["tokens"] if "llmjax" in best else None
        agree = (f"; its greedy outputs equal llmjax's best's for {sum(a == b for a, b in zip(lc['tokens'], ours))} of "
                 f"{n_req} requests, their first tokens for {sum(a[:1] == b[:1] for a, b in zip(lc['tokens'], ours))} "
                 f"(weights of other precisions; near-ties of random-token prompts)" if ours else "")
        notes.append(f"llama.cpp (llama-cpp-python {_version('llama_cpp_python')}): {os.cpu_count()} threads, "
                     f"a {LlamaCpp.__init__.__defaults__[-1]}-token batch a step; best with {lc['dtype']} weights and "
                     f"{lc['seqs']} sequences decoded together{agree}.")
    notes.append(f"Memory bandwidth: {bandwidth / 1e9:.1f} GB/s (torch summing 1 GiB of float32 on all cores, best of 7).")
    notes.append("Matmul peaks on the model's shapes (FLOP-weighted mix of its projections and LM head, best of 7 "
                 "runs each; XLA's dot, llmjax's packed kernel, torch; a precision's peak is the best of them): " + "; ".join(f"{k} rows {v / 1e9:.0f} GFLOP/s" for k, v in sorted(peaks.items())) + ".")
    if "hf" in best and "llmjax" in best:
        hf_s, ours = med(runs[best["hf"]]), runs[best["llmjax"]]
        peak = peak_of(best["llmjax"], ours)
        notes.append(f"Ceiling: at 100% of the machine's {ours['dtype']} peak ({best_peak(ours['dtype'], 512)[1]}, "
                     f"512 rows) this workload takes "
                     f"{flops / peak:.1f} s, so no engine on these matmuls can exceed {hf_s / (flops / peak):.1f}x "
                     f"HF's best here; llmjax's best reached {hf_s / med(ours):.2f}x.")
    for p in paired.values():
        r = p["ratios"]
        notes.append(f"Paired passes ({len(r)} pairs, ABBA order): {p['llmjax']} against {p['peer']}, "
                     f"output tok/s {' / '.join(f'{total_out / s:.1f}' for s in p['llmjax_s'])} against "
                     f"{' / '.join(f'{total_out / s:.1f}' for s in p['peer_s'])}; ratio by pair "
                     f"{' / '.join(f'{x:.2f}' for x in r)}x, median **{p['ratio_median']:.2f}x** "
                     f"({p['compiles']} compilations in llmjax's passes).")
    data = {
        "workload": args.workload, "num_requests": n_req, "output_tokens": total_out, "model_flops": flops,
        "repeats": args.repeats, "peaks_flops": peaks, "memory_bandwidth": bandwidth,
        "runs": {k: {kk: vv for kk, vv in r.items() if kk != "tokens"} for k, r in runs.items()},
        "screen": args.screen,
        "best": best,
        "paired": paired.get("hf"),  # read by results_table.py
        "paired_llama_cpp": paired.get("llama.cpp"),
    }
    if "llama.cpp" in best:
        lc = runs[best["llama.cpp"]]
        data["llama_cpp_best"] = dict(weights=lc["dtype"], seqs=lc["seqs"], seconds=med(lc))
        if "llmjax" in best:
            data["llama_cpp_best"]["llmjax_s"] = med(runs[best["llmjax"]])
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


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


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
