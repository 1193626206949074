"""Offline throughput: our engine against HF transformers `generate` with static batching, one workload.

The workload (default 128 requests; prompt lengths uniform in [16, 512], output lengths uniform in
[16, 256], random token ids, fixed seed, greedy, ignore_eos) runs through
  1. llmjax: continuous batching + chunked prefill + prefix caching (one warm-up pass first, so
     compilation is not timed; the compile count of the timed pass is printed and should be 0),
  2. HF transformers `generate` on the same GGUF weights, static batches of each size in
     `--hf-batch-sizes` (left padding, KV cache on); the best batch size is the baseline.
Prints output tokens/s of each and the ratio, checks greedy outputs are identical, reports the
achieved FLOP/s against this machine's measured float32 matmul peak (and the ratio over HF that the
peak allows at all), and where a step's time goes.

    python experiments/offline_throughput.py [--num-requests 128] [--hf-batch-sizes 8,16,32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent.parent / "results"


def workload(n: int, seed: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(16, 513, size=n)
    output_lens = rng.integers(16, 257, size=n)
    prompts = [rng.integers(100, vocab, size=int(p)).tolist() for p in prompt_lens]
    return prompts, [int(o) for o in output_lens]


def matmul_peak_flops(size: int = 2048, repeats: int = 10) -> float:
    """Measured float32 matmul FLOP/s of this machine through XLA (the roofline for our engine)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def model_flops(num_params: int, prompts: list[list[int]], outputs: list[int], cfg) -> float:
    """The work any engine must do: 2·(non-embedding params) per processed token, the LM head
    (2·vocab·hidden) once per output token, and attention (QK^T and PV: 4·layers·heads·head_dim per
    causal query-key pair). The embedding lookup is a gather, not a matmul."""
    tokens = sum(len(p) for p in prompts) + sum(outputs)
    head = cfg.vocab_size * cfg.hidden_size
    body = num_params - head * (1 if cfg.tie_word_embeddings else 2)
    attn = 0
    for p, o in zip(prompts, outputs):
        total = len(p) + o
        attn += total * (total + 1) // 2  # causal query-key pairs
    return 2 * body * tokens + 2 * head * sum(outputs) + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attn


def run_llmjax(prompts, outputs, args):
    from llmjax.llm import LLM
    from llmjax.sampling_params import SamplingParams

    llm = LLM(None, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=1024, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), enable_prefix_caching=True)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]
    engine = llm.engine
    print("llmjax: warm-up pass (compiles the step buckets this workload uses)")
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    engine.kv.reset_prefix_cache()  # the timed pass must not reuse the warm-up's prompts
    compiles = engine.runner.num_compiles
    engine.time_schedule = engine.time_update = engine.runner.time_prepare = engine.runner.time_device = 0.0
    steps0 = engine.num_steps
    print("llmjax: timed pass")
    t = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t
    breakdown = {
        "scheduling (Python)": engine.time_schedule,
        "input building": engine.runner.time_prepare,
        "device (jitted step)": engine.runner.time_device,
        "output processing": engine.time_update,
    }
    return dict(elapsed=elapsed, tokens=[r.outputs[0].token_ids for r in results], steps=engine.num_steps - steps0,
                compiles=engine.runner.num_compiles - compiles, breakdown=breakdown,
                num_params=sum(x.size for x in __import__("jax").tree.leaves(engine.runner.params)),
                config=engine.model_config)


def run_hf(prompts, outputs, batch_size: int):
    import torch
    from transformers import AutoModelForCausalLM
    from tqdm import tqdm

    from llmjax.models.loader import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokens: list[list[int]] = []
    t = time.perf_counter()
    for start in tqdm(range(0, len(prompts), batch_size), desc=f"HF generate, batch {batch_size}", unit="batch"):
        batch, outs = prompts[start : start + batch_size], outputs[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):  # left padding, as HF recommends for decoder-only generation
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        tokens.extend(out[i, width : width + o].tolist() for i, o in enumerate(outs))
    return dict(elapsed=time.perf_counter() - t, tokens=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--hf-batch-sizes", default="8,16,32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=128, help="our largest batch")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="our KV pool (SmolLM2 float32: 45 KiB a token)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    prompts, outputs = workload(args.num_requests, args.seed, vocab=49152)
    total_out = sum(outputs)
    ours = run_llmjax(prompts, outputs, args)
    hf_runs = {b: run_hf(prompts, outputs, b) for b in map(int, args.hf_batch_sizes.split(","))}
    best_b = min(hf_runs, key=lambda b: hf_runs[b]["elapsed"])
    hf = hf_runs[best_b]
    peak = matmul_peak_flops()
    flops = model_flops(ours["num_params"], prompts, outputs, ours["config"])
    identical = sum(a == b for a, b in zip(ours["tokens"], hf["tokens"]))

    rows = [("llmjax (continuous + chunked prefill + prefix caching)", ours["elapsed"])]
    rows += [(f"HF generate, static batch {b}", r["elapsed"]) for b, r in sorted(hf_runs.items())]
    lines = [
        f"Workload: {args.num_requests} requests, prompts 16-512 tokens, outputs 16-256 tokens "
        f"({total_out} output tokens), greedy, ignore_eos; SmolLM2-135M float32 on this CPU. llmjax: "
        f"max_num_seqs {args.max_num_seqs}, token budget {args.max_num_batched_tokens}, {args.kv_cache_gib:g} GiB "
        f"of KV. Command: `python experiments/offline_throughput.py {' '.join(sys.argv[1:])}`.",
        "",
        "| system | time (s) | output tok/s | vs best HF |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, elapsed in rows:
        lines.append(f"| {name} | {elapsed:.1f} | {total_out / elapsed:.1f} | {hf['elapsed'] / elapsed:.2f}x |")
    achieved = flops / ours["elapsed"]
    ceiling = hf["elapsed"] / (flops / peak)  # our ratio if every FLOP ran at the measured peak
    lines += [
        "",
        f"Greedy outputs identical to HF (batch {best_b}): {identical} of {args.num_requests} requests.",
        f"llmjax: {ours['steps']} steps, {ours['compiles']} compilations in the timed pass.",
        f"Roofline: model work {flops / 1e12:.2f} TFLOP; achieved {achieved / 1e9:.1f} GFLOP/s = "
        f"{100 * achieved / peak:.0f}% of the measured float32 matmul peak ({peak / 1e9:.1f} GFLOP/s); "
        f"HF batch {best_b} did the same useful work at {flops / hf['elapsed'] / 1e9:.1f} GFLOP/s. At 100% of the "
        f"peak this workload would take {flops / peak:.1f} s: the most any engine whose matmuls run at that "
        f"peak can reach is {ceiling:.1f}x the best HF run here.",
        "",
        "| where llmjax's time goes | seconds | share |",
        "| --- | ---: | ---: |",
    ]
    for name, seconds in ours["breakdown"].items():
        lines.append(f"| {name} | {seconds:.2f} | {100 * seconds / ours['elapsed']:.0f}% |")
    report = "\n".join(lines)
    print(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offline_throughput.md").write_text("# Offline throughput\n\n" + report + "\n")
    (RESULTS / "offline_throughput.json").write_text(json.dumps({
        "llmjax_s": ours["elapsed"], "hf_s": {str(b): r["elapsed"] for b, r in hf_runs.items()},
        "output_tokens": total_out, "identical": identical, "achieved_flops": achieved, "peak_flops": peak,
        "model_flops": flops, "ratio_ceiling": ceiling,
        "breakdown_s": ours["breakdown"],
    }, indent=2))


if __name__ == "__main__":
    main()
