"""`EngineConfig` and `ModelConfig` refuse what they document as invalid, naming the field."""

from __future__ import annotations

import pytest

from llmjax.config import DEFAULT_BATCH_SIZE, DEFAULT_MAX_DELAY, PRESETS, ConfigError, EngineConfig

ENGINE_ERRORS = [
    (dict(max_num_seqs=0), "max_num_seqs must be positive"),
    (dict(max_num_batched_tokens=-1), "max_num_batched_tokens must be positive"),
    (dict(stream_interval=0), "stream_interval must be positive"),
    (dict(block_size=24), "block_size must be a power of two"),
    # a value of the wrong kind is named (it raised a TypeError from deep inside, or passed as 1)
    (dict(max_num_seqs=2.5), "max_num_seqs must be an integer, got 2.5"),
    (dict(max_model_len="64"), "max_model_len must be an integer, got '64'"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens must be an integer, got True"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching must be True or False, got 1"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a number"),
    (dict(scheduling_policy=None), "scheduling_policy must be a string, got None"),
    (dict(seed=None), "seed must be an integer, got None"),
    (dict(scheduling_policy="round-robin"), "unknown scheduling_policy"),
    (dict(queue_order="lifo"), "unknown queue_order"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=1024), "without chunked prefill"),
    # vLLM refuses max_num_batched_tokens < max_num_seqs: a step could not decode every running sequence
    (dict(max_num_batched_tokens=32, max_num_seqs=64), r"max_num_batched_tokens \(32\) < max_num_seqs \(64\)"),
    (dict(max_num_batched_tokens=32), r"max_num_batched_tokens \(32\) < max_num_seqs \(64\)"),  # the default seqs
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_num_seqs=128, max_model_len=64),
     r"max_num_batched_tokens \(64\) < max_num_seqs \(128\)"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=0.5, kv_cache_memory_bytes=1 << 30), "both size the KV cache: give one"),
    (dict(scheduling_policy="static", batch_size=8, max_num_seqs=4), r"batch_size \(8\) > max_num_seqs \(4\)"),
    (dict(scheduling_policy="dynamic", batch_size=8, max_num_seqs=4), r"batch_size \(8\) > max_num_seqs \(4\)"),
    (dict(scheduling_policy="dynamic", max_delay=-0.1), "max_delay"),
    (dict(scheduling_policy="dynamic", max_delay=float("inf")), "max_delay must be a finite number"),
    (dict(scheduling_policy="dynamic", max_delay=float("nan")), "max_delay must be a finite number"),
    (dict(scheduling_policy="static", batch_size=0), "batch_size must be positive"),
    # a field its policy does not read would have no effect
    (dict(batch_size=4), "batch_size applies to scheduling_policy static or dynamic only, not 'continuous'"),
    (dict(max_delay=0.1), "max_delay applies to scheduling_policy dynamic only, not 'continuous'"),
    (dict(scheduling_policy="static", max_delay=0.1), "max_delay applies to scheduling_policy dynamic only"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(queue_order="lpm", enable_prefix_caching=False), "queue_order 'lpm' .* needs enable_prefix_caching"),
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes must be positive"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype must be one of"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(attention_backend=""), "attention_backend must not be empty"),  # not the platform's default
    (dict(compilation_cache_dir=""), "compilation_cache_dir must not be empty"),  # not the default folder
    (dict(coordinator_address=" "), "coordinator_address must not be empty"),
    (dict(num_processes=2, process_id=0), "coordinator_address"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2), "process_id"),
]


@pytest.mark.parametrize("fields, message", ENGINE_ERRORS)
def test_engine_config_refuses(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


def test_auto_dtypes_are_the_defaults_as_in_vllm():
    assert EngineConfig(dtype="auto", kv_cache_dtype="auto") == EngineConfig()
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype="auto").kv_cache_dtype is None  # the weights' dtype


def test_without_chunked_prefill_the_default_budget_covers_max_model_len():
    """As in vLLM: the default token budget is raised to max_model_len (a whole prompt fits a step),
    also when the config is copied with chunked prefill turned off; one set by hand is checked against
    a max_model_len set by hand (a default one once the engine has fitted it to the model)."""
    assert EngineConfig(enable_chunked_prefill=False).max_num_batched_tokens == 2048
    assert EngineConfig(enable_chunked_prefill=False, max_model_len=256).max_num_batched_tokens == 512
    assert EngineConfig().replace(enable_chunked_prefill=False, max_model_len=4096).max_num_batched_tokens == 4096
    assert EngineConfig(enable_chunked_prefill=False).replace(enable_chunked_prefill=True).max_num_batched_tokens == 512
    with pytest.raises(ConfigError, match="without chunked prefill"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024)
    deferred = EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=512)
    with pytest.raises(ConfigError, match="without chunked prefill"):
        deferred.check_prompts_fit_a_step()


def test_engine_config_accepts_its_edges():
    EngineConfig(block_size=1, gpu_memory_utilization=1.0, scheduling_policy="dynamic", max_delay=0.0)
    EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=2048, max_model_len=2048)
    EngineConfig(max_num_batched_tokens=64, max_num_seqs=64)
    EngineConfig(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1)
    EngineConfig(queue_order="lpm", enable_prefix_caching=True, dtype="float16", seed=0)


GQA, MLA = PRESETS["tiny-gqa"], PRESETS["tiny-mla"]
MODEL_ERRORS = [
    (GQA, dict(vocab_size=0), "vocab_size must be positive"),
    (GQA, dict(num_heads=6, num_kv_heads=4), r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    (GQA, dict(head_dim=15), "head_dim must be even"),
    (GQA, dict(attention="linear"), "attention must be"),
    (GQA, dict(rope_scaling=(("factor", 2.0), ("rope_type", "dynamic"))), "unsupported rope_type 'dynamic'"),
    (MLA, dict(kv_lora_rank=0), "MLA needs a positive kv_lora_rank"),
    (MLA, dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
]


@pytest.mark.parametrize("base, fields, message", MODEL_ERRORS)
def test_model_config_refuses(base, fields, message):
    with pytest.raises(ConfigError, match=message):
        base.replace(**fields)


def test_batching_defaults_follow_the_policy_and_replace_carries_them_where_read():
    assert (EngineConfig().batch_size, EngineConfig().max_delay) == (None, None)
    static = EngineConfig(scheduling_policy="static", max_num_seqs=4)
    assert (static.batch_size, static.max_delay) == (4, None)  # the default batch, capped at the seats
    dynamic = static.replace(scheduling_policy="dynamic")
    assert (dynamic.batch_size, dynamic.max_delay) == (4, DEFAULT_MAX_DELAY)
    assert dynamic.replace(scheduling_policy="continuous").batch_size is None
    assert EngineConfig(scheduling_policy="static").batch_size == DEFAULT_BATCH_SIZE
