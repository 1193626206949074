"""PagedAttention (Kwon et al., SOSP 2023) §6.3: KV memory saved by sharing blocks in parallel sampling
and beam search.

The paper's metric (Figure 15): blocks saved by sharing / blocks without sharing, on OPT-13B with the
Alpaca and ShareGPT traces: parallel sampling saves 6.1-9.8% (Alpaca) and 16.2-30.5% (ShareGPT),
beam search 37.6-55.2% and 44.3-66.3%, over 2, 4 and 6 sequences per request.

Here each request of a length trace (`llmjax.workloads`, the paper's mean lengths) is decoded on our
`BlockPool` (reference-counted blocks of 16 tokens), token by token, two ways: every sequence with its
own blocks, and with sharing:
- parallel sampling, n sequences: the prompt's blocks are allocated once and referenced by all n; the
  first token a sequence writes into a shared, partly filled block copies it (copy on write); each
  sequence then grows its own blocks to the request's output length (all n decode it, as the paper's
  benchmark runs them: `ignore_eos` with `max_tokens` the output length);
- beam search, width k: every step each beam is replaced by a child of a beam drawn uniformly at random
  (our assumption: the paper does not describe its beams' ancestry); a child references its parent's
  blocks (incref), a beam that leaves no child releases its own (decref), and a write into a block shared
  with another beam copies it first. All beams decode the request's output length.
The blocks in use are summed over every decoding step of every request (the time integral of the memory,
one step a time unit), with and without sharing; saving = 1 - with / without. The scheduler plays no part
(the paper's runs also batch requests, which does not change a request's own sharing).

The real engine's parallel sampling (`SamplingParams.n`, on the `tiny-gqa` preset): each request of an
Alpaca-length trace runs alone with n samples of its drawn output length (temperature 1, ignore_eos), and
the engine's KV manager is read after every step (blocks held by requests). With prefix caching on, the
samples after the first find the prompt's full pages in the radix tree (each recomputes the prompt's
partial last page: the engine has no copy-on-write); with it off, every sample holds its own prompt.
Its saving is set beside the simulator's count for the same lengths (equal outputs, copy-on-write).

    python -m paper_repro.sharing [--requests 300] [--engine-requests 40] [--quick]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from llmjax.kv.block_pool import BlockPool  # noqa: E402
from llmjax.cli_types import non_negative_int, parse_quick, positive_int  # noqa: E402
from llmjax.provenance import results_dir, write_results  # noqa: E402
from llmjax.workloads import ALPACA, SHAREGPT, LengthDist, lognormal_lengths  # noqa: E402

BLOCK = 16
WIDTHS = (2, 4, 6)
MAX_LEN = 2048
# Figure 15 and §6.3's text: (min, max) saving over widths 2, 4, 6.
PAPER = {"Alpaca": {"parallel sampling": (0.061, 0.098), "beam search": (0.376, 0.552)},
         "ShareGPT": {"parallel sampling": (0.162, 0.305), "beam search": (0.443, 0.663)}}


class Sequence:
    """One sequence's block table over a shared `BlockPool` and its length in tokens."""

    def __init__(self, pool: BlockPool, blocks: list[int], length: int) -> None:
        self.pool, self.blocks, self.length = pool, blocks, length

    def fork(self) -> Sequence:
        """A child that references every block of this sequence."""
        self.pool.incref(self.blocks)
        return Sequence(self.pool, list(self.blocks), self.length)

    def append(self) -> None:
        """Write one token: a new block at a block boundary; copy on write into a shared last block."""
        if self.length % BLOCK == 0:
            self.blocks += self.pool.allocate(1)
        elif self.pool.ref_count(self.blocks[-1]) > 1:
            copy = self.pool.allocate(1)[0]
            self.pool.decref([self.blocks[-1]])
            self.blocks[-1] = copy
        self.length += 1

    def release(self) -> None:
        self.pool.decref(self.blocks)
        self.blocks = []


def unshared(prompt: int, outputs: list[int]) -> int:
    """Block-steps of independent sequences: each holds ceil(tokens / BLOCK) blocks at every step."""
    steps = max(outputs)
    return sum(math.ceil((prompt + min(t, out)) / BLOCK) for out in outputs for t in range(1, steps + 1)
               if t <= out)


def parallel_sampling(prompt: int, outputs: list[int]) -> tuple[int, int]:
    """(block-steps with sharing, without) for one request whose n sequences produce `outputs` tokens."""
    pool = BlockPool(len(outputs) * math.ceil((prompt + max(outputs)) / BLOCK) + 2)
    root = Sequence(pool, pool.allocate(math.ceil(prompt / BLOCK)), prompt)
    seqs = [root.fork() for _ in outputs]
    root.release()
    shared = 0
    for t in range(1, max(outputs) + 1):
        for seq, out in zip(seqs, outputs):
            if t == out + 1:
                seq.release()
            elif t <= out:
                seq.append()
        shared += pool.num_in_use
    for seq in seqs:
        seq.release()
    assert pool.num_in_use == 0
    return shared, unshared(prompt, outputs)


def beam_search(prompt: int, output: int, width: int, rng: np.random.Generator) -> tuple[int, int]:
    """(block-steps with sharing, without) for one request decoded by `width` beams for `output` tokens."""
    pool = BlockPool(2 * width * math.ceil((prompt + output) / BLOCK) + 2)
    root = Sequence(pool, pool.allocate(math.ceil(prompt / BLOCK)), prompt)
    beams = [root.fork() for _ in range(width)]
    root.release()
    shared = 0
    for _ in range(output):
        parents = rng.integers(0, width, width)
        children = [beams[p].fork() for p in parents]
        for beam in beams:
            beam.release()
        beams = children
        for beam in beams:
            beam.append()
        shared += pool.num_in_use
    for beam in beams:
        beam.release()
    assert pool.num_in_use == 0
    return shared, unshared(prompt, [output] * width)


def beam_bound(prompt: int, output: int, width: int) -> tuple[int, int]:
    """(block-steps with the most sharing `width` distinct beams allow, without sharing): beams that
    differ only in their newest token share every block but the one holding it."""
    shared = sum(math.ceil((prompt + t) / BLOCK) - 1 + width for t in range(1, output + 1))
    return shared, unshared(prompt, [output] * width)


def engine_block_steps(engine, prompt: list[int], output: int, n: int, seed: int) -> int:
    """Blocks held by requests, summed over the steps of one request with `n` samples run alone."""
    from llmjax.sampling_params import SamplingParams

    engine.kv.reset_prefix_cache()
    engine.add_request(prompt, SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=output, ignore_eos=True))
    total = 0
    while engine.has_unfinished_requests():
        engine.step()
        total += engine.kv.usage().used
    return total


def engine_part(requests: int, seed: int) -> dict:
    """Saving of the engine's parallel sampling per width, with the simulator's for the same lengths."""
    from llmjax.config import EngineConfig
    from llmjax.engine import LLMEngine

    rng = np.random.default_rng(seed)
    prompts = lognormal_lengths(rng, requests, ALPACA.mean_prompt, ALPACA.sigma_prompt, 256)
    outputs = lognormal_lengths(rng, requests, ALPACA.mean_output, ALPACA.sigma_output, 256)
    engines = {caching: LLMEngine.from_config("tiny-gqa", EngineConfig(
        block_size=BLOCK, max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=8 << 20,
        enable_prefix_caching=caching, dtype="float32")) for caching in (True, False)}
    out: dict[str, dict] = {"widths": list(WIDTHS), "requests": requests, "engine": [], "sim": []}
    for width in tqdm(WIDTHS, desc="engine: widths", unit="width", leave=False):
        totals, sim = np.zeros(2), np.zeros(2)
        for i, (p, o) in enumerate(zip(prompts, outputs)):
            prompt = rng.integers(3, 500, int(p)).tolist()
            totals += [engine_block_steps(engines[c], prompt, int(o), width, seed + i) for c in (True, False)]
            sim += parallel_sampling(int(p), [int(o)] * width)
        out["engine"].append(float(1 - totals[0] / totals[1]))
        out["sim"].append(float(1 - sim[0] / sim[1]))
    return out


BOUND = "beam search, most sharing possible"  # `beam_bound`: not a method, the ceiling of beam search's saving


def run(dist: LengthDist, requests: int, seed: int) -> dict[str, dict[int, float]]:
    """Saving per method and width over one trace of `requests` (prompt, output) lengths, and beam
    search's ceiling (`BOUND`)."""
    rng = np.random.default_rng(seed)
    prompts = lognormal_lengths(rng, requests, dist.mean_prompt, dist.sigma_prompt, 1024)
    outputs = lognormal_lengths(rng, requests, dist.mean_output, dist.sigma_output, MAX_LEN - prompts)
    out: dict[str, dict[int, float]] = {"parallel sampling": {}, "beam search": {}, BOUND: {}}
    for width in tqdm(WIDTHS, desc=f"{dist.name}: widths", unit="width", leave=False):
        totals = np.zeros((3, 2))
        for p, o in zip(prompts, outputs):
            totals[0] += parallel_sampling(int(p), [int(o)] * width)
            totals[1] += beam_search(int(p), int(o), width, rng)
            totals[2] += beam_bound(int(p), int(o), width)
        for method, (with_sharing, without) in zip(out, totals):
            out[method][width] = float(1 - with_sharing / without)
    return out


def plot(results: dict, path) -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4))
    for ax, (name, r) in zip(np.atleast_1d(axes), results.items()):
        for method, color in (("parallel sampling", "tab:blue"), ("beam search", "tab:orange")):
            ax.plot(WIDTHS, [100 * r[method][w] for w in WIDTHS], "o-", color=color, label=f"{method}, ours")
            lo, hi = PAPER[name][method]  # the paper's ends: at the smallest and the largest width
            ax.plot([WIDTHS[0], WIDTHS[-1]], [100 * lo, 100 * hi], "s", color=color, mfc="none", ms=8,
                    label=f"{method}, paper (at {WIDTHS[0]} and {WIDTHS[-1]})")
        ax.plot(WIDTHS, [100 * r[BOUND][w] for w in WIDTHS], "k--", lw=1,
                label="beam search's ceiling (beams differ only in their newest token)")
        ax.set_xticks(WIDTHS)
        ax.set_xlabel("sequences per request (n, beam width)")
        ax.set_ylabel("KV memory saved by sharing (%)")
        ax.set_title(f"{name} lengths, block size {BLOCK}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def verdict(results: dict) -> str:
    """For each dataset and method: our savings at the narrowest and widest width against the ends of
    the paper's range (which grows with the width: its low end is 2 sequences, its high end 6)."""
    lines = []
    for name, r in results.items():
        for method in ("parallel sampling", "beam search"):
            first, last = r[method][WIDTHS[0]], r[method][WIDTHS[-1]]
            lo, hi = PAPER[name][method]
            lines.append(f"- {name}, {method}: ours {100 * first:.1f}-{100 * last:.1f}% over widths "
                         f"{WIDTHS[0]}-{WIDTHS[-1]}, paper {100 * lo:.1f}-{100 * hi:.1f}%: "
                         f"{100 * (first - lo):+.1f} points from the paper at {WIDTHS[0]} sequences, "
                         f"{100 * (last - hi):+.1f} at {WIDTHS[-1]}")
        ceiling = [r[BOUND][w] for w in WIDTHS]
        below = [100 * (c - r["beam search"][w]) for c, w in zip(ceiling, WIDTHS)]
        lo, hi = PAPER[name]["beam search"]
        lines.append(f"- {name}, beam search's ceiling {100 * ceiling[0]:.1f}-{100 * ceiling[-1]:.1f}%: our random "
                     f"ancestry lies {min(below):.1f}-{max(below):.1f} points under it, the paper's beams "
                     f"{100 * (ceiling[0] - lo):.1f} points at {WIDTHS[0]} sequences, {100 * (ceiling[-1] - hi):.1f} "
                     f"at {WIDTHS[-1]}")
    return "\n".join(lines)


def relation(ours: list[float], theirs: list[float]) -> str:
    if all(a < b for a, b in zip(ours, theirs)):
        return "lower at every width"
    if all(a > b for a, b in zip(ours, theirs)):
        return "higher at every width"
    return "higher at some widths, lower or equal at others"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=300, help="requests per dataset")
    ap.add_argument("--seed", type=non_negative_int, default=0)
    ap.add_argument("--engine-requests", type=positive_int, default=40, help="requests of the real engine's part")
    ap.add_argument("--quick", action="store_true", help="smoke run: 30 requests (engine 4); written to "
                    "build/results-quick/")
    ap.add_argument("--out", type=Path, default=None, help="default: results/ (quick: build/results-quick/)")
    args = parse_quick(ap, dict(requests=30, engine_requests=4))
    out = args.out or results_dir(args.quick)
    results = {dist.name: run(dist, args.requests, args.seed) for dist in (ALPACA, SHAREGPT)}
    engine = engine_part(args.engine_requests, args.seed)
    rows = ["| dataset | method | " + " | ".join(f"width {w}" for w in WIDTHS) + " | paper |",
            "| --- | --- |" + " ---: |" * (len(WIDTHS) + 1)]
    for name, r in results.items():
        for method, by_width in r.items():
            paper = f"{100 * PAPER[name][method][0]:.1f}-{100 * PAPER[name][method][1]:.1f}%" if method in PAPER[name] \
                else "-"
            rows.append(f"| {name} | {method} | " + " | ".join(f"{100 * by_width[w]:.1f}%" for w in WIDTHS)
                        + f" | {paper} |")
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "sharing.png")
    engine_rows = ["| parallel sampling, Alpaca lengths | " + " | ".join(f"width {w}" for w in WIDTHS) + " |",
                   "| --- |" + " ---: |" * len(WIDTHS),
                   "| real engine (prefix-cache sharing of full pages) | "
                   + " | ".join(f"{100 * v:.1f}%" for v in engine["engine"]) + " |",
                   "| simulator, same lengths | "
                   + " | ".join(f"{100 * v:.1f}%" for v in engine["sim"]) + " |"]
    gap = max(abs(a - b) for a, b in zip(engine["engine"], engine["sim"]))
    body = "\n".join([
        "# Memory saved by sharing: PagedAttention §6.3 (parallel sampling, beam search)", "",
        f"`python -m paper_repro.sharing --requests {args.requests} --engine-requests {args.engine_requests}`", "",
        "![saving vs width](sharing.png)", "",
        f"{args.requests} requests per dataset (seed {args.seed}), lengths log-normal with the paper's means "
        f"(`llmjax.workloads`: Alpaca {ALPACA.mean_prompt}/{ALPACA.mean_output}, ShareGPT "
        f"{SHAREGPT.mean_prompt}/{SHAREGPT.mean_output} prompt/output tokens); blocks of {BLOCK} tokens on our "
        "reference-counted `BlockPool`. Saving = 1 - block-steps with sharing / block-steps without (the "
        "paper's blocks saved / blocks without sharing, summed over decoding steps). Method: the module "
        "docstring.", "",
        *rows, "",
        verdict(results), "",
        "Parallel sampling can share only a prompt's full blocks, so its saving grows with the prompt's share "
        "of a sequence; beam search also shares the beams' common history, which depends on how beams descend "
        "from each other: uniform random parents here, the paper's real beams not published. Its ceiling "
        f"(`{BOUND}`: beams that differ only in their newest token, so share every block but the one holding "
        "it) and parallel sampling's saving, which shares no history, bound what any ancestry can save. Random "
        "parents merge the beams' histories within a few steps, so our beam search sits just under the "
        "ceiling: an estimate of the most beam search can save, not a model of the paper's beams. The real "
        "engine's parallel sampling is measured below.", "",
        f"## The real engine's parallel sampling (`n` > 1), {args.engine_requests} requests", "",
        *engine_rows, "",
        f"The engine's saving is within {100 * gap:.2f} points of the simulator's count for the same lengths "
        f"at every width ({relation(engine['engine'], engine['sim'])}). The two count in two different ways, "
        "whose parts in the gap were not measured apart: after its k-th step the engine holds a sample's prompt "
        "and k - 1 output tokens (the newest token's KV is written by the next step), where the simulator counts "
        "k; a sample that finishes is freed before the engine's count; and the engine's other samples start one "
        "step after the first (they wait for its prompt's pages). The simulator's samples copy the prompt's "
        "partly filled last block at their first token, before its first count, so sharing that block plays no "
        "part in either count.",
    ])
    print(body)
    write_results(out, "sharing", body, {
        "sim": {name: {method: {"widths": list(WIDTHS), "savings": [r[method][w] for w in WIDTHS],
                                "paper_saving": list(PAPER[name][method])}
                       for method in PAPER[name]} for name, r in results.items()},
        "beam_ceiling": {name: [r[BOUND][w] for w in WIDTHS] for name, r in results.items()},
        "engine": engine, "args": {k: v for k, v in vars(args).items() if k != "out"}})


if __name__ == "__main__":
    main()
