"""MHA, GQA, MQA and MLA at equal hidden size (256), depth (4) and parameter count: KV cache size, capacity,
speed, quality.

For each preset (`tiny-mha`, `tiny-gqa`, `tiny-mqa`, `tiny-mla`; 8 query heads of 32 dims), with its MLP
width changed so that its parameter count is within 2% of MHA's (`matched_configs`: the variants with
smaller attention get a wider MLP, so quality differences are not parameter differences):
1. KV bytes per token from the formula (fp32 here: 4 bytes an element): MHA 2·n_h·d_h·l, GQA 2·n_g·d_h·l,
   MQA 2·d_h·l, MLA (d_c + d_h^R)·l; and as actually allocated by the engine (bytes of the paged KV arrays
   over the token slots they hold).
2. Capacity: how many requests of `--request-len` tokens our `KVCacheManager` admits in one fixed KV
   budget (allocating each request's whole length, i.e. the concurrency it can sustain to the end). Each
   engine gets the budget plus one block of its own, for the null block the pool reserves, so the
   capacities follow the bytes per token alone.
3. Decode throughput on this CPU at that batch (capped at `--max-batch`): that many requests of
   `--request-len` / 2 prompt tokens prefill, then decode `--decode-tokens` tokens; output tokens/s over
   the decode-only steps, every variant on the pure-JAX attention (the native CPU kernel has no MLA
   path), after a compiling pass; the median of `--decode-rounds` passes, the variants in turn. The
   same at one equal batch for all (the smallest capacity): the variants' decode speed apart from
   how many requests their KV budget admits. Two variants' rates count as different only where their
   ranges over the passes do not overlap (`separated`).
4. Quality: each variant trained on the same byte-level corpus (the Python standard library's source,
   bytes as token ids < 512), once per seed in `--seeds` (a seed fixes the initialisation and the batch
   order, identical across variants), AdamW; validation loss and perplexity on held-out files (the
   same validation batches for every run). Each variant is compared with MHA seed by seed (paired:
   same batches, same seed): the mean difference in validation loss and its 95% t-interval over seeds;
   the verdict on each of the papers' claims is read from those intervals (`quality_verdict`).

    python experiments/attention_variants.py [--train-steps 160] [--batch 8] [--seq 64] [--seeds 0,1,2,3,4]
        [--kv-budget-mib 16]      (the defaults are results/attention_variants.md's run)
    python experiments/attention_variants.py --quick     (smoke run into build/results-quick/)
"""

from __future__ import annotations

import argparse
import dataclasses
import sysconfig
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common import EngineConfig, alternating, results_dir, table, write_report  # noqa: E402
from llmjax.cli_types import non_negative_int_list, parse_quick, positive_finite, positive_int  # noqa: E402
from llmjax.config import PRESETS, ModelConfig  # noqa: E402
from llmjax.kv.manager import KVCacheManager  # noqa: E402
from llmjax.sampling_params import SamplingParams  # noqa: E402

VARIANTS = {"MHA": "tiny-mha", "GQA": "tiny-gqa", "MQA": "tiny-mqa", "MLA": "tiny-mla"}
DTYPE_BYTES = 4  # float32 on CPU
VALIDATION_SEED = 12345  # the validation windows, the same for every variant and seed
PARAM_TOLERANCE = 0.02  # parameter counts matched to MHA's within 2%
CONFIDENCE = 0.95
GQA_MARGIN = 0.02  # nats/byte: "GQA close to MHA" means the interval of GQA - MHA lies within +-0.02


def param_count(cfg: ModelConfig) -> int:
    """Parameters of a randomly initialised model of `cfg` (shapes only, nothing computed)."""
    import jax
    from flax import nnx

    from llmjax.models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))


def matched_configs() -> dict[str, ModelConfig]:
    """Each variant's preset with its MLP width (a multiple of 8) set so its parameter count is as close as
    possible to MHA's: parameters grow by 3 x hidden x layers per unit of width (gate, up and down
    projections). ValueError if one cannot be brought within PARAM_TOLERANCE."""
    target = param_count(PRESETS[VARIANTS["MHA"]])
    out = {}
    for name, preset in VARIANTS.items():
        cfg = PRESETS[preset]
        per_unit = 3 * cfg.hidden_size * cfg.num_layers
        width = cfg.intermediate_size + round((target - param_count(cfg)) / per_unit / 8) * 8
        cfg = dataclasses.replace(cfg, intermediate_size=width)
        if abs(param_count(cfg) / target - 1) > PARAM_TOLERANCE:
            raise ValueError(f"{name}: {param_count(cfg)} parameters against MHA's {target}")
        out[name] = cfg
    return out


def build(name: str, cfg: ModelConfig, seed: int = 0):
    """A `LoadedModel` of `cfg` with random weights (float32), named after its preset."""
    import jax.numpy as jnp

    from llmjax.models.loader import LoadedModel, ModelSource, random_params

    graphdef, params = random_params(cfg, jnp.float32, seed)
    return LoadedModel(cfg, graphdef, params, ModelSource("preset", VARIANTS[name]))


def formula(cfg: ModelConfig) -> tuple[str, int]:
    """The paper formula for elements per token, written out, and its value."""
    l = cfg.num_layers  # noqa: E741
    if cfg.attention == "mla":
        return f"(d_c + d_h^R)·l = ({cfg.kv_lora_rank}+{cfg.qk_rope_head_dim})·{l}", \
            (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * l
    g = cfg.num_kv_heads
    return f"2·{g}·{cfg.head_dim}·{l}", 2 * g * cfg.head_dim * l


def capacity(num_blocks: int, block_size: int, request_len: int) -> int:
    """Requests of `request_len` tokens the KV manager admits before it refuses one."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    n = 0
    while kv.allocate(n, list(range(request_len)), request_len) is not None:
        n += 1
    return n


def decode_throughput(engine, batch: int, prompt_len: int, tokens: int) -> float:
    """Output tokens/s of the decode-only steps of one pass: `batch` requests of `prompt_len` tokens,
    `tokens` output tokens each (a first pass on an engine compiles its steps)."""
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(16, 512, prompt_len).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    engine.scheduler.input_closed = True
    elapsed, produced = 0.0, 0
    while engine.has_unfinished_requests():
        decoding = bool(engine.scheduler.running) and not engine.scheduler.waiting and all(
            r.num_computed_tokens > 0 and r.output_token_ids for r in engine.scheduler.running)
        t = time.perf_counter()
        outs = engine.step()
        if decoding:
            elapsed += time.perf_counter() - t
            produced += len(outs)
    engine.scheduler.input_closed = False
    return produced / elapsed if elapsed else float("nan")


# --- training ------------------------------------------------------------------------------------------
def corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of the standard library's top-level .py files, sorted by name; the last 10% of files validate."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = [f.read_bytes() for f in files]
    split = int(len(data) * 0.9)
    train = np.frombuffer(b"".join(data[:split])[:max_bytes], np.uint8).astype(np.int32)
    val = np.frombuffer(b"".join(data[split:])[: max_bytes // 10], np.uint8).astype(np.int32)
    return train, val


def train(name: str, cfg: ModelConfig, train_ids, val_ids, steps: int, batch: int, seq: int,
          seeds: list[int]) -> list[dict]:
    """One run per seed: AdamW (lr 1e-3, warm-up then cosine) on next-byte prediction, val loss every
    steps/10. The step is compiled once per variant and shared by its seeds."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    graphdef = build(name, cfg).graphdef
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-3, max(steps // 10, 1), steps, 1e-4)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))

    def loss_fn(p, x):
        logits = nnx.merge(graphdef, p)(x[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

    @jax.jit
    def step(p, s, x):
        loss, grads = jax.value_and_grad(loss_fn)(p, x)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    eval_loss = jax.jit(loss_fn)
    val_rng = np.random.default_rng(VALIDATION_SEED)
    val_batches = [jnp.asarray(windows(val_ids, val_rng, batch, seq)) for _ in range(8)]
    runs = []
    for seed in seeds:
        params = build(name, cfg, seed).params
        opt_state = opt.init(params)
        rng = np.random.default_rng(seed)  # the same batches for every variant
        curve, val_curve = [], []
        for i in tqdm(range(steps), desc=f"train {name}, seed {seed}", unit="step", leave=False):
            params, opt_state, loss = step(params, opt_state, jnp.asarray(windows(train_ids, rng, batch, seq)))
            curve.append(float(loss))
            if (i + 1) % max(steps // 10, 1) == 0 or i + 1 == steps:
                val_curve.append((i + 1, float(np.mean([eval_loss(params, b) for b in val_batches]))))
        runs.append({"train": curve, "val": val_curve, "val_loss": val_curve[-1][1], "tokens": steps * batch * seq})
    return runs


def paired_interval(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of the per-seed differences a - b and its CONFIDENCE t-interval over seeds."""
    from scipy import stats

    d = np.asarray(a) - np.asarray(b)
    half = stats.t.ppf((1 + CONFIDENCE) / 2, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    return {"mean": float(d.mean()), "lo": float(d.mean() - half), "hi": float(d.mean() + half)}


def quality_verdict(diffs: dict[str, dict[str, float]]) -> str:
    """The papers' claims, each read from a paired interval: "yes" when the interval lies where the claim
    needs it, "no" when it lies on the other side, "not resolved" when it straddles."""
    def ci(key: str) -> str:
        d = diffs[key]
        return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"

    def side(key: str, holds_below: float) -> str:  # claim: the difference is below `holds_below`
        d = diffs[key]
        return "yes" if d["hi"] < holds_below else "no" if d["lo"] > holds_below else "not resolved"

    g = diffs["GQA - MHA"]
    close = ("yes" if -GQA_MARGIN <= g["lo"] and g["hi"] <= GQA_MARGIN else
             "no" if g["lo"] > GQA_MARGIN or g["hi"] < -GQA_MARGIN else "not resolved")
    mqa_worse = {"yes": "no", "no": "yes"}.get(side("MQA - GQA", 0.0), "not resolved")
    mla = diffs["MLA - MHA"]
    mla_ok = "yes" if mla["hi"] <= 0 else "no" if mla["lo"] > 0 else "not resolved (the interval holds 0: as good, within the noise)"
    return (f"Paired differences in validation loss (nats/byte), mean [{CONFIDENCE:.0%} interval over seeds]: "
            + ", ".join(f"{k} {ci(k)}" for k in diffs) + ". Does ours agree with the papers? "
            f"GQA close to MHA (interval within +-{GQA_MARGIN}): {close}; MQA worse than GQA (interval of MQA - GQA "
            f"above 0): {mqa_worse}; MLA at least as good as MHA (interval of MLA - MHA at or below 0): {mla_ok}.")


def separated(rates: dict[str, list[float]]) -> str:
    """Which variants' decode rates differ beyond the noise: each pair whose ranges over the passes do
    not overlap, as "A > B", and how many pairs overlap."""
    names, apart, overlap = list(rates), [], 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if min(rates[a]) > max(rates[b]):
                apart.append(f"{a} > {b}")
            elif min(rates[b]) > max(rates[a]):
                apart.append(f"{b} > {a}")
            else:
                overlap += 1
    return (", ".join(apart) or "no pair apart") + f" ({overlap} of {len(names) * (len(names) - 1) // 2} pairs overlap)"


def windows(ids: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    starts = rng.integers(0, len(ids) - seq - 1, batch)
    return np.stack([ids[s : s + seq + 1] for s in starts])


def plot(rows: list[dict], runs: dict[str, list[dict]], path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = [r["variant"] for r in rows]
    ax = axes[0]
    ax.bar(names, [r["allocated"] / 1024 for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r["allocated"] / 1024, f"{r['allocated'] / 1024:.2f} KiB\n{r['capacity']} reqs", ha="center",
                va="bottom", fontsize=8)
    ax.set_ylabel("KV cache per token (KiB, fp32)"), ax.set_title("KV per token (label: requests a fixed budget holds)")
    ax.set_ylim(0, max(r["allocated"] for r in rows) / 1024 * 1.3)
    ax = axes[1]
    x = np.arange(len(rows))
    def pass_range(key: str) -> np.ndarray:  # error bars: from the slowest pass to the fastest
        return np.array([[r[key] - min(r[f"{key}_passes"]), max(r[f"{key}_passes"]) - r[key]] for r in rows]).T

    ax.bar(x - 0.2, [r["decode_tok_s"] for r in rows], 0.4, yerr=pass_range("decode_tok_s"), capsize=3,
           color="tab:green", label="at the batch its budget admits")
    ax.bar(x + 0.2, [r["equal_batch_tok_s"] for r in rows], 0.4, yerr=pass_range("equal_batch_tok_s"), capsize=3,
           color="tab:olive", label=f"at batch {min(r['batch'] for r in rows)}, all alike")
    for i, r in enumerate(rows):
        ax.text(i - 0.2, r["decode_tok_s"], f"batch {r['batch']}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, names), ax.legend(fontsize=8)
    ax.set_ylabel("decode tokens/s on this CPU"), ax.set_title("decode throughput (median of passes; bars: their range)")
    ax = axes[2]
    for row, (name, seed_runs) in zip(rows, runs.items()):
        run = seed_runs[0]
        train_curve = np.convolve(run["train"], np.ones(20) / 20, mode="valid")
        line, = ax.plot(np.arange(len(train_curve)) + 20, train_curve, alpha=0.5, lw=1)
        ax.plot(*zip(*run["val"]), "o-", color=line.get_color(),
                label=f"{name} val {row['val_loss']:.3f} (mean of {len(seed_runs)} seeds, "
                      f"{min(row['val_losses']):.3f}-{max(row['val_losses']):.3f})")
    ax.set_xlabel("training step"), ax.set_ylabel("loss (nats/byte)")
    ax.set_title("train (faint) and validation loss, first seed")
    ax.legend(fontsize=8)
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-budget-mib", type=positive_finite, default=16)
    ap.add_argument("--request-len", type=positive_int, default=256)
    ap.add_argument("--max-batch", type=positive_int, default=64)
    ap.add_argument("--decode-tokens", type=positive_int, default=64)
    ap.add_argument("--decode-rounds", type=positive_int, default=5,
                    help="timed decode passes of each variant, the variants in turn (the median is reported)")
    ap.add_argument("--train-steps", type=positive_int, default=160)
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--seq", type=positive_int, default=64)
    ap.add_argument("--seeds", type=non_negative_int_list, default="0,1,2,3,4",
                    help="comma-separated training seeds (at least 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 training steps, seeds 0,1, 16 decode "
                    "tokens; written to build/results-quick/")
    args = parse_quick(ap, dict(train_steps=20, seeds=[0, 1], decode_tokens=16, decode_rounds=1))
    seeds = args.seeds
    if len(seeds) < 2:
        ap.error("--seeds needs at least two seeds for an interval")
    out = results_dir(args.quick)

    from llmjax.engine import LLMEngine
    from llmjax.tokenizer import CharTokenizer

    configs = matched_configs()
    budget = int(args.kv_budget_mib * (1 << 20))
    train_ids, val_ids = corpus(4 << 20)
    rows, runs, engines = [], {}, {}
    for name, cfg in tqdm(configs.items(), desc="KV size, capacity, decode compiled", unit="variant"):
        text, elems = formula(cfg)
        # one attention implementation for all four (the native CPU kernel has no MLA path), so the
        # decode rates differ by the variants, not by kernels
        null_block = EngineConfig().block_size * cfg.kv_bytes_per_token(DTYPE_BYTES)  # the pool reserves one
        engine = LLMEngine(build(name, cfg), CharTokenizer(),
                           EngineConfig(kv_cache_memory_bytes=budget + null_block, max_model_len=args.request_len,
                                        max_num_seqs=args.max_batch, max_num_batched_tokens=2048,
                                        enable_prefix_caching=False, attention_backend="xla"))
        cache = engine.runner.cache
        allocated = sum(a.nbytes for a in (cache if isinstance(cache, (tuple, list)) else [cache])) \
            / (engine.num_blocks * engine.config.block_size)
        cap = capacity(engine.num_blocks, engine.config.block_size, args.request_len)
        batch = min(cap, args.max_batch)
        decode_throughput(engine, batch, args.request_len // 2, args.decode_tokens)  # compiles its steps
        engines[name] = engine, batch
        rows.append({"variant": name, "heads": f"{cfg.num_heads}/{cfg.num_kv_heads if cfg.attention == 'gqa' else '-'}",
                     "mlp_width": cfg.intermediate_size, "formula": text, "elements": elems,
                     "formula_bytes": elems * DTYPE_BYTES, "config_bytes": cfg.kv_bytes_per_token(DTYPE_BYTES),
                     "allocated": allocated, "capacity": cap, "batch": batch, "params_m": param_count(cfg) / 1e6})
    equal_batch = min(batch for _, batch in engines.values())
    for engine, _ in tqdm(engines.values(), desc=f"decode at batch {equal_batch} compiled", unit="variant"):
        decode_throughput(engine, equal_batch, args.request_len // 2, args.decode_tokens)
    rates = {name: [] for name in engines}
    equal_rates = {name: [] for name in engines}
    for k, name in tqdm(list(alternating(list(engines), args.decode_rounds)), desc="decode passes, in turn"):
        engine, batch = engines[name]
        rates[name].append(decode_throughput(engine, batch, args.request_len // 2, args.decode_tokens))
        equal_rates[name].append(decode_throughput(engine, equal_batch, args.request_len // 2, args.decode_tokens))
    for row in rows:
        row["decode_tok_s_passes"] = rates[row["variant"]]
        row["decode_tok_s"] = float(np.median(rates[row["variant"]]))
        row["decode_span"] = f"{min(rates[row['variant']]):.0f}-{max(rates[row['variant']]):.0f}"
        row["equal_batch_tok_s_passes"] = equal_rates[row["variant"]]
        row["equal_batch_tok_s"] = float(np.median(equal_rates[row["variant"]]))
        row["equal_batch_span"] = f"{min(equal_rates[row['variant']]):.0f}-{max(equal_rates[row['variant']]):.0f}"
    del engines
    # Training after every timing, so the decode measurements never share the CPU with it.
    for name, cfg in tqdm(configs.items(), desc="training (all seeds of a variant)", unit="variant"):
        runs[name] = train(name, cfg, train_ids, val_ids, args.train_steps, args.batch, args.seq, seeds)
    losses = {name: [run["val_loss"] for run in rs] for name, rs in runs.items()}
    for row in rows:
        row["val_losses"] = losses[row["variant"]]
        row["val_loss"] = float(np.mean(row["val_losses"]))
        row["ppl"] = float(np.exp(row["val_loss"]))
    diffs = {f"{v} - MHA": paired_interval(losses[v], losses["MHA"]) for v in ("GQA", "MQA", "MLA")}
    diffs["MQA - GQA"] = paired_interval(losses["MQA"], losses["GQA"])
    mha = rows[0]
    for r in rows:
        r["vs_mha"] = r["allocated"] / mha["allocated"]
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, runs, out / "attention_variants.png")
    columns = [("variant", "variant", ""), ("heads", "q/kv heads", ""), ("mlp_width", "MLP width", "d"),
               ("params_m", "params (M)", ".3f"), ("formula", "KV elements/token", ""),
               ("formula_bytes", "formula bytes", "d"), ("allocated", "allocated bytes", ".0f"),
               ("vs_mha", "vs MHA", ".3f"), ("capacity", f"requests in {args.kv_budget_mib:g} MiB", "d"),
               ("batch", "batch run", "d"), ("decode_tok_s", "decode tok/s (median)", ".0f"),
               ("decode_span", "over passes", ""), ("equal_batch_tok_s", f"decode tok/s at batch {equal_batch}", ".0f"),
               ("equal_batch_span", "over passes", ""),
               ("val_loss", "val loss (mean)", ".3f"), ("ppl", "val ppl", ".2f")]
    tokens = runs["MHA"][0]["tokens"]
    best = min(rows, key=lambda r: r["val_loss"])
    g, q, m = rows[1], rows[2], rows[3]
    params = [r["params_m"] for r in rows]
    seed_table = ["| seed | " + " | ".join(configs) + " |", "| ---: |" + " ---: |" * len(configs)]
    seed_table += [f"| {seed} | " + " | ".join(f"{losses[v][k]:.4f}" for v in configs) + " |"
                   for k, seed in enumerate(seeds)]
    body = "\n".join([
        "![KV size, capacity, throughput and loss curves](attention_variants.png)", "",
        f"Presets with hidden size 256, 4 layers, 8 query heads of 32 dims (MLA: d_c=64, d_h^R=16), each MLP "
        f"widened so the parameter counts match MHA's within {PARAM_TOLERANCE:.0%} (here {min(params):.3f}-"
        f"{max(params):.3f}M, {max(params) / min(params) - 1:.2%} apart). KV budget {args.kv_budget_mib:g} MiB, "
        f"requests of {args.request_len} tokens; decode throughput on this CPU at min(capacity, {args.max_batch}) "
        f"requests, and at {equal_batch} requests for all (the smallest capacity), each request {args.request_len // 2} "
        f"prompt and {args.decode_tokens} output tokens, every variant on the pure-JAX attention (`xla`: the native CPU kernel has no MLA path), the "
        f"median of {args.decode_rounds} passes taken in turn after a compiling one. Training: "
        f"{args.train_steps} AdamW steps of {args.batch}x{args.seq} bytes ({tokens / 1e6:.2f}M "
        f"tokens) of the Python standard library's source per run, seeds {','.join(map(str, seeds))} "
        "(identical batches across "
        "variants); validation on held-out files (loss in nats per byte).", "",
        table(rows, columns), "",
        f"Headline: per token GQA keeps {g['vs_mha']:.0%}, MQA {q['vs_mha']:.1%}, MLA {m['vs_mha']:.1%} of MHA's KV, so "
        f"{args.kv_budget_mib:g} MiB (plus the reserved null block) holds "
        f"{mha['capacity']} / {g['capacity']} / {q['capacity']} / {m['capacity']} requests "
        f"(MHA/GQA/MQA/MLA); mean val loss {mha['val_loss']:.3f} / {g['val_loss']:.3f} / {q['val_loss']:.3f} / "
        f"{m['val_loss']:.3f} (lowest: {best['variant']}).",
        "",
        f"Decode rates, told apart only where the ranges over passes do not overlap: at the batch each budget "
        f"admits, {separated(rates)}; at batch {equal_batch} for all, {separated(equal_rates)}.",
        "",
        quality_verdict(diffs),
        "",
        "Validation loss per seed:", "", *seed_table, "",
        f"Caveat: {min(params):.2f}M parameters and {tokens / 1e6:.2f}M training tokens per run; the papers' "
        "claims are about billion-parameter models trained on far more data.",
    ])
    write_report("attention_variants", "Attention variants: MHA, GQA, MQA, MLA", body,
                 {"rows": rows, "curves": runs, "args": vars(args),
                  "quality": {"seeds": seeds, "confidence": CONFIDENCE, "diffs": diffs}}, out)


if __name__ == "__main__":
    main()
