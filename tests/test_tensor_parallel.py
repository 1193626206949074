"""Tensor parallelism: greedy outputs on 2 or 4 CPU devices equal a dense one-device reference, the weights and cache really are sharded, the step is partitioned, and bad sizes fail clearly.

The multi-device runs happen in subprocesses (`tests/tp_check.py`) started with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`, because this process's JAX has one CPU device.
The multi-host check is `experiments/multihost_check.py` (two processes, slower).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmjax import parallel
from llmjax.cli import add_engine_args, engine_config_from_args
from llmjax.config import PRESETS, ConfigError, EngineConfig
from llmjax.models.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
# tiny-gqa has 2 KV heads: TP 4 replicates them (TP 2, one KV head a device, is tiny-mla's size); each
# size is a compilation of every step shape in its subprocess, which is most of this module's time, so
# one size each, against the dense reference computed on one device
SIZES = {"tiny-gqa": (4,), "tiny-mla": (2,)}


@pytest.fixture(scope="module")
def runs():
    """{preset: {tp: result of tp_check.check}}, both presets' subprocesses running side by side."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    procs = {
        preset: subprocess.Popen([sys.executable, str(ROOT / "tests" / "tp_check.py"), preset, *map(str, sizes)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for preset, sizes in SIZES.items()
    }
    results = {}
    for preset, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"tp_check.py {preset} failed:\n{err[-4000:]}"
        results[preset] = {int(tp): r for tp, r in json.loads(out).items()}
    return results


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_greedy_outputs_equal_the_one_device_dense_reference(runs, preset):
    for tp, r in runs[preset].items():
        assert r["devices"] == 4
        assert r["mismatch"] is None, f"TP {tp}: {r['mismatch']}"
        assert r["second_run_equal"] and r["second_run_compiles"] == 0, f"TP {tp} recompiled on a rerun"
        assert r["cache_donated"], f"TP {tp}: the cache was copied, not donated"
        assert r["prompt_logprob_error"] < 2e-5, f"TP {tp}: prompt logprobs off by {r['prompt_logprob_error']}"


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_weights_and_cache_are_sharded(runs, preset):
    cfg = PRESETS[preset]
    for tp in SIZES[preset]:
        r = runs[preset][tp]
        params = r["params"]
        assert params["embed_tokens/embedding"] == "P('tp', None)"
        assert params["lm_head/kernel"] == "P(None, 'tp')"
        assert params["layers/self_attn/q_proj/kernel"] == "P(None, None, 'tp')"
        assert params["layers/self_attn/o_proj/kernel"] == "P(None, 'tp', None)"
        assert params["layers/mlp/up_proj/kernel"] == "P(None, None, 'tp')"
        assert params["layers/mlp/down_proj/kernel"] == "P(None, 'tp', None)"
        assert params["layers/input_layernorm/weight"] == "P()"
        if cfg.attention == "mla":
            assert params["layers/self_attn/kv_b_proj/kernel"] == "P(None, None, 'tp')"
            assert params["layers/self_attn/kv_a_proj_with_mqa/kernel"] == "P()"
            assert r["cache"] == ["P()"]  # the latent cache is replicated
        else:
            assert params["layers/self_attn/k_proj/kernel"] == "P(None, None, 'tp')"
            assert r["cache"] == ["P(None, None, None, 'tp', None)"] * 2
            kv_heads = max(cfg.num_kv_heads, tp)  # replicated up to one KV head per device
            assert r["cache_shard_shape"][3] == kv_heads // tp
        # Megatron: per layer one all-reduce after o_proj and one after down_proj (in the scan body)
        assert r["collectives"]["all-reduce"] >= 2


def test_pallas_fresh_prefill_attention_runs_per_device(runs):
    """The flash path (a fresh prefill's attention on the new tokens' K and V) is under `shard_map`
    like the paged kernels: no collective, the unsharded call's values."""
    for tp in SIZES["tiny-gqa"]:
        r = runs["tiny-gqa"][tp]["flash_prefill"]
        assert sum(r["collectives"].values()) == 0, r["collectives"]
        assert r["error"] < 1e-6


@pytest.mark.parametrize("preset, changes, tp, message", [
    ("tiny-gqa", {}, 3, "num_heads"),
    ("tiny-mla", {}, 16, "num_heads"),
    ("tiny-mla", {"intermediate_size": 770}, 4, "intermediate_size"),
    ("tiny-mha", {"vocab_size": 510}, 4, "vocab_size"),
    ("tiny-gqa", {"num_heads": 12, "num_kv_heads": 3}, 2, "num_kv_heads"),
])
def test_indivisible_sizes_are_refused(preset, changes, tp, message):
    with pytest.raises(ConfigError, match=message):
        parallel.validate(PRESETS[preset].replace(**changes), tp)


@pytest.mark.parametrize("changes, tp", [
    ({"num_heads": 12, "num_kv_heads": 3, "vocab_size": 768}, 6),  # each KV head twice
    ({}, 8),  # tiny-mqa's one KV head eight times
], ids=["gqa-3-heads-tp-6", "mqa-tp-8"])
def test_fewer_kv_heads_than_devices_are_replicated(changes, tp):
    """`prepare_model` accepts a TP size that is a multiple of the KV heads and gives a model with `tp`
    KV heads, each original head's K/V projection columns repeated tp // num_kv_heads times (query
    head h still reads original head h // (num_heads // num_kv_heads)); the model's logits are the
    unreplicated model's. (Runs on one device: only the weights are rewritten.)"""
    from llmjax.models.loader import LoadedModel, ModelSource, random_params

    cfg = PRESETS["tiny-mqa" if not changes else "tiny-gqa"].replace(num_layers=1, **changes)
    model = LoadedModel(cfg, *random_params(cfg, jnp.float32, seed=1), ModelSource("preset", "custom"))
    wide = parallel.prepare_model(model, tp)
    assert (wide.config.num_kv_heads, model.config.num_kv_heads) == (tp, cfg.num_kv_heads)
    assert wide.config.replace(num_kv_heads=cfg.num_kv_heads) == cfg  # nothing else changed
    repeat, d = tp // cfg.num_kv_heads, cfg.head_dim
    for name in ("k_proj", "v_proj"):
        before = np.asarray(model.params["layers"]["self_attn"][name]["kernel"].get_value())
        after = np.asarray(wide.params["layers"]["self_attn"][name]["kernel"].get_value())
        assert after.shape == (*before.shape[:-1], tp * d)
        for head in range(tp):
            original = head // repeat
            np.testing.assert_array_equal(after[..., head * d : (head + 1) * d],
                                          before[..., original * d : (original + 1) * d])
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 12)), jnp.int32)
    np.testing.assert_allclose(np.asarray(wide.module()(tokens)), np.asarray(model.module()(tokens)),
                               atol=1e-5, rtol=1e-5)


def test_too_few_devices_is_refused():
    with pytest.raises(ConfigError, match="devices"):
        parallel.make_mesh(jax.device_count() + 1)


def test_engine_config_validation():
    with pytest.raises(ConfigError):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="coordinator"):
        EngineConfig(num_processes=2, process_id=0)
    with pytest.raises(ConfigError, match="process_id"):
        EngineConfig(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2)


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["tiny-gqa", "--tensor-parallel-size", "2", "--coordinator-address", "10.0.0.1:1234",
                              "--num-processes", "2", "--process-id", "1"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.coordinator_address, config.num_processes, config.process_id) == (
        2, "10.0.0.1:1234", 2, 1)


def test_replicated_kv_heads_compute_the_same_model():
    model = load_model("tiny-gqa")
    wide = parallel.replicate_kv_heads(model, 4)
    assert (wide.config.num_kv_heads, model.config.num_kv_heads) == (4, 2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 500, size=(2, 24)), jnp.int32)
    np.testing.assert_allclose(wide.module()(tokens), model.module()(tokens), atol=1e-5, rtol=1e-5)
    assert parallel.replicate_kv_heads(model, 2) is model


def test_kv_budget_is_per_device():
    gqa, mla = PRESETS["tiny-gqa"], PRESETS["tiny-mla"]
    assert parallel.kv_bytes_per_token_per_device(gqa, 4, 2) == gqa.kv_bytes_per_token(4) // 2
    assert parallel.kv_bytes_per_token_per_device(mla, 4, 4) == mla.kv_bytes_per_token(4)
