"""Smoke tests of the ablation experiments' shared helpers, most on the simulator (no compilation)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import attention_variants  # noqa: E402
import batching  # noqa: E402
import chunked_prefill  # noqa: E402
import synergy  # noqa: E402
from common import replay_sim  # noqa: E402
from llmjax.config import PRESETS  # noqa: E402
from paper_repro.traces import length_trace  # noqa: E402


@pytest.mark.parametrize("policy", batching.POLICIES)
def test_replay_sim_every_policy_finishes_with_sane_stats(policy):
    reqs = length_trace(batching.CPU_DIST, 40, 5.0, seed=0, vocab=50000, max_model_len=256, max_prompt_len=192,
                        name="r")
    replay = replay_sim(batching.configs(8, 256, 64, 0.1)[policy], reqs)
    stats = replay.stats()
    assert stats["requests"] == 40
    assert all(len(t.token_times) == r.output_len for t, r in zip(sorted(replay.timings, key=lambda t: int(t.request_id[1:])), reqs))
    assert 0 <= stats["idle_slots"] < 1 and stats["ttft_p50_ms"] > 0
    assert all(len(s) <= 8 and start <= end for start, end, s in replay.steps)


def test_chunking_lowers_itl_and_raises_ttft_in_the_simulator():
    reqs = chunked_prefill.workload(0, 50000, decodes=16, decode_out=200, longs=6, long_len=1800, rate=1.0, start=1.0)
    rows = chunked_prefill.sweep([256], 2048, 32, lambda cfg, label: replay_sim(cfg, reqs))
    chunked, whole = rows
    assert chunked["itl_p99_ms"] < whole["itl_p99_ms"]
    assert chunked["ttft_mean_ms"] > whole["ttft_mean_ms"]


def test_chunking_sweep_says_so_when_no_decode_token_falls_while_long_prompts_are_served():
    # The decodes (4 tokens) end long before the long prompts arrive at 5 s: no ITL to measure.
    reqs = chunked_prefill.workload(0, 50000, decodes=4, decode_out=4, longs=2, long_len=256, rate=1.0, start=5.0)
    with pytest.raises(RuntimeError, match="no decode token fell"):
        chunked_prefill.sweep([256], 2048, 32, lambda cfg, label: replay_sim(cfg, reqs))


def test_kv_formula_matches_config_and_capacity_scales():
    for preset in attention_variants.VARIANTS.values():
        cfg = PRESETS[preset]
        assert attention_variants.formula(cfg)[1] * 4 == cfg.kv_bytes_per_token(4)
    assert attention_variants.capacity(65, 16, 256) == 4  # 64 usable blocks of 16 tokens, 16 blocks a request
    assert np.isfinite(attention_variants.windows(np.arange(1000), np.random.default_rng(0), 2, 8)).all()


def test_decode_rates_are_told_apart_only_where_their_ranges_do_not_overlap():
    rates = {"MHA": [1113, 1948], "GQA": [1710, 2743], "MQA": [3000, 3900], "MLA": [1900, 3100]}
    # MQA's lowest pass is above MHA's and GQA's highest; MLA's range overlaps MQA's, MHA's and GQA's
    assert attention_variants.separated(rates) == "MQA > MHA, MQA > GQA (4 of 6 pairs overlap)"
    assert attention_variants.separated({"A": [1, 2], "B": [2, 3]}) == "no pair apart (1 of 1 pairs overlap)"


@pytest.mark.parametrize("gpu", [False, True])
def test_synergy_ladder_adds_one_optimization_per_rung(gpu):
    from dataclasses import asdict

    ladder = list(synergy.rungs(slots=4, paged_batch=12, chunk=256, kv_tokens=2256, gpu=gpu).values())
    changed = [{k for k, v in asdict(cur).items() if asdict(prev)[k] != v} for prev, cur in zip(ladder, ladder[1:])]
    expected = [{"batch_size", "max_num_seqs"}, {"scheduling_policy", "batch_size"},  # continuous reads no batch
                {"enable_chunked_prefill", "max_num_batched_tokens"}, {"enable_prefix_caching"}]
    # bfloat16 halves a token's KV bytes: its byte budget halves so the pool keeps the same tokens
    assert changed == expected + ([{"attention_backend"}] if gpu else
                                  [{"attention_backend"}, {"dtype", "kv_cache_memory_bytes"}])
    assert ladder[0].attention_backend == "xla" and ladder[0].scheduling_policy == "static"
    for rung in ladder:  # SmolLM2-135M: K and V of 3 KV heads x 64 in each of 30 layers
        assert rung.kv_cache_memory_bytes == 2256 * 2 * 3 * 64 * 30 * (2 if rung.dtype == "bfloat16" else 4)


def test_paired_interval_is_the_t_interval_of_the_per_seed_differences():
    a, b = [1.00, 1.02, 0.99, 1.03, 1.01], [0.98, 0.99, 0.99, 1.00, 0.97]
    d = np.subtract(a, b)
    half = 2.7764451051977987 * d.std(ddof=1) / np.sqrt(5)  # t quantile 0.975, 4 degrees of freedom
    ci = attention_variants.paired_interval(a, b)
    assert ci["mean"] == pytest.approx(d.mean()) and ci["lo"] == pytest.approx(d.mean() - half)
    assert ci["hi"] == pytest.approx(d.mean() + half)


def test_quality_verdict_reads_each_claim_from_its_interval():
    diffs = {"GQA - MHA": {"mean": 0.001, "lo": -0.005, "hi": 0.007},   # inside +-0.02: close
             "MQA - MHA": {"mean": 0.05, "lo": 0.03, "hi": 0.07},
             "MLA - MHA": {"mean": 0.01, "lo": -0.01, "hi": 0.03},    # straddles 0
             "MQA - GQA": {"mean": 0.049, "lo": 0.02, "hi": 0.08}}    # above 0: MQA worse
    verdict = attention_variants.quality_verdict(diffs)
    assert "GQA - MHA +0.001 [-0.005, +0.007]" in verdict
    assert "GQA close to MHA (interval within +-0.02): yes" in verdict
    assert "MQA worse than GQA (interval of MQA - GQA above 0): yes" in verdict
    assert "at or below 0): not resolved" in verdict
    diffs["MQA - GQA"] = {"mean": -0.05, "lo": -0.07, "hi": -0.03}
    diffs["GQA - MHA"] = {"mean": 0.05, "lo": 0.03, "hi": 0.07}
    verdict = attention_variants.quality_verdict(diffs)
    assert "MQA - GQA above 0): no" in verdict and "within +-0.02): no" in verdict


def test_variant_parameter_counts_are_matched():
    counts = {v: attention_variants.param_count(c) for v, c in attention_variants.matched_configs().items()}
    assert max(counts.values()) / min(counts.values()) - 1 <= 0.02 * 1.03
    mha = PRESETS["tiny-mha"]  # an independent count of MHA: embedding and LM head, 4 layers of attention + MLP + norms, final norm
    h, w, layers = mha.hidden_size, mha.intermediate_size, mha.num_layers
    per_layer = 4 * h * h + 3 * h * w + 2 * h
    assert counts["MHA"] == 2 * mha.vocab_size * h + layers * per_layer + h  # untied LM head


def test_results_files_are_stamped_with_commit_command_and_machine(tmp_path):
    import json
    import os
    import subprocess

    from llmjax.provenance import write_results

    write_results(tmp_path, "x", "# X\n\nbody\n", {"value": 1.5})
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    data = json.loads((tmp_path / "x.json").read_text())
    prov = data["provenance"]
    assert data["value"] == 1.5 and prov["commit"] == head
    assert prov["machine"]["cores"] == len(os.sched_getaffinity(0))
    assert prov["versions"]["numpy"] == np.__version__
    text = (tmp_path / "x.md").read_text()
    assert text.startswith("# X\n\nbody\n") and f"commit: {head[:12]}" in text and "## Provenance" in text


def test_provenance_counts_code_changes_as_dirty_but_not_experiment_outputs(monkeypatch):
    from llmjax import provenance

    def status(lines):
        return lambda *args: ("\n".join(lines) if args[0] == "status" else "0" * 40)

    monkeypatch.setattr(provenance, "_git", status([" M results/batching.md", " M README.md"]))
    state = provenance._code_state()
    assert state["dirty"] is False and state["dirty_paths"] == []
    monkeypatch.setattr(provenance, "_git", status([" M results/batching.json", " M llmjax/engine.py",
                                                    " M docs/architecture.md"]))
    monkeypatch.setattr(provenance, "CODE_AT_START", provenance._code_state())
    monkeypatch.setattr(provenance, "_git", lambda *args: "llmjax/engine.py\ndocs/architecture.md" if args[0] == "diff"
                        else status([" M llmjax/engine.py", " M docs/architecture.md"])(*args))
    prov = provenance.provenance()
    assert prov["dirty"] is True and prov["dirty_paths"] == ["llmjax/engine.py", "docs/architecture.md"]
    assert "with uncommitted changes to llmjax/engine.py, docs/architecture.md" in provenance.provenance_markdown(prov)
    assert prov["code_changed_during_run"] is False
    assert "changed while it ran" not in provenance.provenance_markdown(prov)


def test_provenance_names_the_code_the_run_started_with(monkeypatch):
    """A commit made while an experiment runs does not become its stamp: the stamp is the code at
    the start, and the report says the tree changed and what it was when written."""
    from llmjax import provenance

    def git(since_start):  # a clean tree at commit b..., whose diff from a... is `since_start`
        return lambda *args: {"status": "", "rev-parse": "b" * 40, "diff": "\n".join(since_start)}[args[0]]

    started = {"commit": "a" * 40, "dirty": False, "dirty_paths": []}
    monkeypatch.setattr(provenance, "CODE_AT_START", started)
    monkeypatch.setattr(provenance, "_git", git(["llmjax/engine.py", "results/x.json"]))
    prov = provenance.provenance()
    assert prov["commit"] == "a" * 40 and prov["commit_at_write"] == "b" * 40 and prov["code_changed_during_run"]
    text = provenance.provenance_markdown(prov)
    assert "commit: aaaaaaaaaaaa (the tree changed while it ran: bbbbbbbbbbbb when it was written)" in text
    monkeypatch.setattr(provenance, "_git", git(["results/x.json", "README.md"]))  # only outputs committed
    prov = provenance.provenance()
    assert prov["commit"] == "a" * 40 and prov["code_changed_during_run"] is False
    assert "changed while it ran" not in provenance.provenance_markdown(prov)


def test_routing_simulation_routes_every_request_and_cache_aware_hits_more():
    import argparse

    import routing

    args = argparse.Namespace(sim_replicas=[2], per_group=4, sim_prefix_len=256, sim_suffix_len=16,
                              sim_output_len=4, sim_rate=3.0, seed=0)
    by_policy = routing.sim_part(args)[2]
    n = 4 * 2 * args.per_group  # sim_trace: 4 prefix groups per replica
    for summary in by_policy.values():
        assert sum(summary["requests_per_replica"]) == n and 0.0 <= summary["hit_rate"] <= 1.0
    assert by_policy["cache_aware"]["hit_rate"] > by_policy["round_robin"]["hit_rate"]


def test_kv_bookkeeping_serves_every_request_and_plots(tmp_path):
    """kv_bookkeeping.py's stream frees each request once (a pool small enough to preempt), its decode
    step grows every request by one token both ways, and its plot is written."""
    import argparse

    import kv_bookkeeping
    from llmjax.kv import KVCacheManager

    args = argparse.Namespace(num_requests=300, num_running=32, block_size=16, num_blocks=128, num_prefixes=4,
                              prefix_len=64, suffix_len=16, output_len=8, decode_steps=20, seed=0)
    prompts, outputs = kv_bookkeeping.build_stream(args)
    m = KVCacheManager(args.num_blocks, args.block_size)
    cost = kv_bookkeeping.run_stream(m, prompts, outputs, args.num_running)
    m.check_invariants()
    assert cost["free"][0] == args.num_requests and cost["preempt"][0] > 0
    # admitted allocations, counted apart from refused ones: each request's first, then one per preemption
    assert cost["allocate"][0] == args.num_requests + cost["preempt"][0] and cost["refused allocate"][0] > 0
    assert m.usage().used == 0
    steps = {batched: kv_bookkeeping.decode_step_cost(args, prompts, batched) for batched in (False, True)}
    assert all(len(times) == args.decode_steps for times in steps.values())
    kv_bookkeeping.plot(cost, {"grow": steps[False], "grow_each": steps[True]}, args.num_running, tmp_path / "kv.png")
    assert (tmp_path / "kv.png").stat().st_size > 0


@pytest.mark.parametrize("output_kind", ["delta", "final"])
def test_host_overhead_phases_and_cache_effect_run_on_a_tiny_engine(output_kind):
    """host_overhead.py's two measurements on 8 decodes: every phase of both modes is timed (the
    engines keep all 8 requests decoding), and the cache-effect pass applies, dispatches and fetches
    the runner's steps as the engine does."""
    import host_overhead

    result = host_overhead.measure(8, output_kind, blocks=2, steps=2)
    for mode in ("sync", "async"):
        assert all(result[mode][phase] >= 0 for phase in host_overhead.PHASES) and result[mode]["wall"] > 0
    assert len(result["hidden_pairs"]) == 2
    effect = host_overhead.cache_effect(8, output_kind, steps=2, context=32)
    assert effect["hot_total"] > 0 and effect["streamed_total"] > 0 and effect["fetch_hot"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_host_overhead_emulated_device_feeds_tokens_and_takes_its_time(async_scheduling):
    """The emulated accelerator's step samples (last token + 1) mod vocab for every request, so
    each request's outputs count up by one from its last prompt-phase token whether the token it
    feeds comes from the host or (asynchronous scheduling) from the previous step on the device;
    and its step lasts at least the requested time (nanosleep never wakes early). The kernel records
    each of the 6 waits on the host's clock, inside the timed stretch; the device's waiting for the
    host is part of each idle gap between them (synchronous: some of every gap)."""
    import time

    import host_overhead

    engine = host_overhead.decoding_engine(4, async_scheduling, "final", idle_device_ms=3.0)
    vocab = engine.model_config.vocab_size
    engine.wait_in_flight()
    host_overhead.device_spans()  # forget the settling steps' waits
    dispatched = host_overhead.record_dispatches(engine)
    start = {r.request_id: len(r.output_token_ids) for r in engine.scheduler.running}
    t0 = time.perf_counter()
    for _ in range(6):
        engine.step()
    engine.wait_in_flight()
    elapsed = time.perf_counter() - t0
    spans = host_overhead.device_spans()
    assert spans.shape == (6, 2) and len(dispatched) == 6
    assert t0 < spans[0, 0] and spans[-1, 1] <= t0 + elapsed
    assert (spans[:, 1] - spans[:, 0] >= 3e-3).all()
    gaps = host_overhead.idle_gaps(spans)
    assert (gaps >= 0).all()
    waiting = host_overhead.waiting_for_host(spans, np.array(dispatched))
    assert ((waiting >= 0) & (waiting <= gaps)).all()
    if not async_scheduling:  # the host fetches a step, applies it and only then calls the next
        assert (waiting > 0).all()
    engine.step()  # applies the step left in flight
    for request in engine.scheduler.running:
        out = request.output_token_ids
        first = start[request.request_id]
        emulated = out[first:]
        assert len(emulated) >= 6
        assert emulated == [(out[first - 1] + 1 + i) % vocab for i in range(len(emulated))]
    assert elapsed >= 6 * 3e-3


@pytest.mark.parametrize("module, flags, message", [
    ("memory_waste", ["--seeds", "0"], "argument --seeds: expected a positive integer"),
    ("memory_waste", ["--requests", "50", "--seeds", "1"], "never ran out of KV memory"),
    ("block_size", ["--model", "None"], "--model: model 'None' is neither a preset"),
    ("radix_hit_rate", ["--skip-engine", "--pool-tokens", "1000"], "--pool-tokens: the longest simulated request"),
    ("sharing", ["--seed", "-1"], "argument --seed: expected an integer >= 0"),
])
def test_paper_repro_scripts_refuse_bad_flags_with_an_error_line(tmp_path, module, flags, message):
    """Bad input ends a paper reproduction with `error: ...` and status 2, no traceback and no result file."""
    import subprocess

    run = subprocess.run([sys.executable, "-m", f"paper_repro.{module}", *flags, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 2 and f"{module}.py: error: " in run.stderr and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not list(tmp_path.iterdir())
