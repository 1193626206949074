"""Configuration: `ModelConfig` (what the weights are) and `EngineConfig` (how to serve them).

Both are frozen dataclasses validated once in `__post_init__`; everything downstream trusts them.
`ModelConfig` is built from a Hugging Face `config.json`, from GGUF metadata, or from a named preset.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
# HF's rope types, and "freq_factors": llama.cpp's per-frequency divisors (a GGUF's rope_freqs.weight,
# how its converter writes Llama 3's RoPE scaling)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")
ROPE_REQUIRED_KEYS = {"default": (), "linear": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                      "yarn": ("factor", "original_max_position_embeddings"), "freq_factors": ("factors",)}
# the window HF's config class assumes when a config.json has no `sliding_window` key
DEFAULT_SLIDING_WINDOW = {"MistralForCausalLM": 4096}
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")  # HF's names (ACT2FN)
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16")  # the attention kernels read these
DTYPES = KV_CACHE_DTYPES  # the model's weights and activations: the same three
DEFAULT_GPU_MEMORY_UTILIZATION = 0.8  # share of an accelerator's memory for weights, activations and KV cache
DEFAULT_BATCH_SIZE = 8  # static/dynamic batching: sequences per batch (at most max_num_seqs; n samples count n)
DEFAULT_MAX_DELAY = 0.05  # dynamic batching: seconds a batch waits to fill
BATCHING_FIELDS = {"batch_size": ("static", "dynamic"), "max_delay": ("dynamic",)}  # field -> policies that read it


class ConfigError(ValueError):
    """A model or engine configuration that llmjax cannot serve; the message names the problem."""


class Default(int):
    """An int setting's default value, marked so that it can be told from the same value set by
    hand (as vLLM's None defaults, resolved later): `EngineConfig.max_model_len` is then capped at
    the model's context, and `max_num_batched_tokens` follows chunked prefill and `max_model_len`.
    It is an int everywhere else; `dataclasses.replace` carries the mark."""

    def __repr__(self) -> str:
        return int.__repr__(self)


DEFAULT_MAX_NUM_BATCHED_TOKENS = 512  # with chunked prefill; without it, at least max_model_len (as vLLM)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. `attention` selects the GQA family or MLA.

    GQA family: MHA when `num_kv_heads == num_heads`, MQA when 1, GQA in between.
    MLA (DeepSeek-V2/V3): `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`,
    optional `q_lora_rank`; `head_dim` is unused.
    `rope_scaling` holds HF's rope parameters as sorted (key, value) pairs, so the config stays hashable.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # GQA: q/k/v biases; MLA: q_a/kv_a/o biases (as HF's DeepSeek)
    attention_out_bias: bool = False  # GQA: an o_proj bias (HF Llama's attention_bias; not Qwen2's)
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the MLP's gate activation, one of HIDDEN_ACTS
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.attention == "gqa":
            if self.head_dim <= 0 or self.num_kv_heads <= 0:
                raise ConfigError("head_dim and num_kv_heads must be positive")
            if self.head_dim % 2:
                raise ConfigError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
            if self.num_heads % self.num_kv_heads:
                raise ConfigError(
                    f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
                )
        elif self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"MLA needs a positive {name}, got {getattr(self, name)}")
            if self.qk_rope_head_dim % 2:
                raise ConfigError("qk_rope_head_dim must be even")
        else:
            raise ConfigError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        rope_type = self.rope_params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        missing = [key for key in ROPE_REQUIRED_KEYS[rope_type] if self.rope_params.get(key) is None]
        if missing:
            raise ConfigError(f"rope_type {rope_type!r} needs {', '.join(missing)} in its rope parameters")
        if rope_type == "freq_factors" and len(self.rope_params["factors"]) != self.rope_dim // 2:
            raise ConfigError(f"{len(self.rope_params['factors'])} RoPE frequency factors for {self.rope_dim // 2} "
                              "rotated pairs")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}; supported: {HIDDEN_ACTS}")

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def rope_dim(self) -> int:
        """Dimensions rotated by RoPE per head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token costs over all layers.

        GQA family: 2 * num_kv_heads * head_dim * layers * dtype (K and V).
        MLA: (kv_lora_rank + qk_rope_head_dim) * layers * dtype (the latent and the shared RoPE key).
        """
        if self.attention == "mla":
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = 2 * self.num_kv_heads * self.head_dim
        return per_layer * self.num_layers * dtype_bytes

    def softmax_scale(self) -> float:
        """1/sqrt(qk head dim), times YaRN's mscale² for MLA models as DeepSeek defines it (whatever the
        RoPE scaling's type, as DeepSeek's code and HF's apply it)."""
        scale = self.qk_head_dim**-0.5
        params = self.rope_params
        if self.attention == "mla" and params.get("mscale_all_dim") and "factor" in params:
            m = yarn_mscale(params["factor"], params["mscale_all_dim"])
            scale *= m * m
        return scale

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_params_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """HF stores RoPE scaling as `rope_scaling` (transformers 4) or `rope_parameters` (5); given
    both, transformers reads `rope_scaling` (a model card's addition to a saved config)."""
    return dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})


def _rope_scaling_from_hf(hf: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    params = _rope_params_from_hf(hf)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("rope_theta", None)
    partial = hf.get("partial_rotary_factor", params.pop("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):  # models that rotate part of each head (Phi, StableLM) are not read
        raise ConfigError(f"partial_rotary_factor {partial} is not supported: llmjax rotates the whole head")
    params.setdefault("rope_type", "default")
    if params["rope_type"] == "default":
        params = {"rope_type": "default"}
    original = params.get("original_max_position_embeddings")
    if params["rope_type"] == "yarn" and params.get("factor") is None and original:
        # as transformers reads it: the ratio of the model's context (before any window bounds it) to the original
        params["factor"] = hf.get("max_position_embeddings", 2048) / original
    return tuple(sorted(params.items()))


def _rope_theta_from_hf(hf: dict[str, Any]) -> float:
    """The RoPE parameters' own `rope_theta` first (as transformers reads it), then the top level's."""
    return float(_rope_params_from_hf(hf).get("rope_theta", hf.get("rope_theta", 10000.0)))


def _context_from_hf(hf: dict[str, Any]) -> int:
    """The longest context llmjax serves the model at. Attention here always sees the whole
    context, which is the model's own sliding-window attention (Mistral's `sliding_window`, Qwen2's
    with `use_sliding_window`) only up to the window: such a model is served at most that long (as
    vLLM does when it runs one without its window). A Mistral config without the key has HF's default
    window; one with `sliding_window: null` has none."""
    context = hf.get("max_position_embeddings", 2048)
    default_window = DEFAULT_SLIDING_WINDOW.get((hf.get("architectures") or [None])[0])
    window = hf.get("sliding_window", default_window) if hf.get("use_sliding_window", True) else None
    return min(context, window) if window else context


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of a HF `config.json`. Unknown architectures, MoE and quantized
    checkpoints are refused."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unknown architecture {arch!r}; llmjax supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    quantization = hf.get("quantization_config")
    if quantization:  # its weights are codes and scales that llmjax would read as plain weights
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ConfigError(f"quantized checkpoints ({method}) are not supported; load the model's float16, "
                          "bfloat16 or float32 checkpoint, or its GGUF file")
    num_layers = hf["num_hidden_layers"]
    act = hf.get("hidden_act", "silu")
    common = dict(
        hidden_act="silu" if act == "swish" else act,  # HF's two names of one function
        mlp_bias=bool(hf.get("mlp_bias", False)),
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=hf["num_attention_heads"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta_from_hf(hf),
        rope_scaling=_rope_scaling_from_hf(hf),
        max_position_embeddings=_context_from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        architecture=arch,
    )
    if arch.startswith("Deepseek"):
        n_experts = hf.get("n_routed_experts")
        first_dense = hf.get("first_k_dense_replace", 0)
        if n_experts and first_dense < num_layers:
            raise ConfigError(
                f"{arch} with mixture-of-experts layers (n_routed_experts={n_experts}, "
                f"first_k_dense_replace={first_dense} < {num_layers} layers) is not supported yet: "
                "llmjax serves dense-MLP MLA models only"
            )
        return ModelConfig(
            **common,
            num_kv_heads=hf["num_attention_heads"],
            head_dim=0,
            attention_bias=bool(hf.get("attention_bias", False)),
            attention="mla",
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            # DeepSeek-V2's HF code always rotates interleaved pairs (complex multiply); V3 makes it a flag,
            # true by default
            rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(hf.get("rope_interleave", True)),
        )
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
        **common,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        # Qwen2 has q/k/v biases and no o_proj bias; Llama's (and Mistral's) attention_bias is on all four
        attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        attention_out_bias=arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias", False)),
    )


# generation_config.json's sampling settings that vLLM takes as a model's default sampling parameters,
# and the SamplingParams field each sets
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults_from_file(path: str | Path) -> dict[str, Any]:
    """The sampling defaults a model's `generation_config.json` sets (SamplingParams field -> value;
    null values are unset), as vLLM reads them; {} when there is no such file. ConfigError (naming the
    file) for one that is not a JSON object."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not a usable generation_config.json: {exc}") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"{path} is not a usable generation_config.json: not a JSON object")
    return {field: settings[key] for key, field in GENERATION_CONFIG_FIELDS.items() if settings.get(key) is not None}


def model_config_from_hf_file(path: str | Path) -> ModelConfig:
    """`model_config_from_hf` of the file; ConfigError (naming the file) for one that is not a JSON object
    or lacks a key the architecture needs."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        hf = json.loads(path.read_text())
        if not isinstance(hf, dict):
            raise ConfigError("not a JSON object")
        return model_config_from_hf(hf)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:  # invalid JSON, a missing key, a value of the wrong type
        raise ConfigError(f"{path} is not a usable config.json: {type(exc).__name__}: {exc}") from None


def model_config_from_gguf_metadata(meta: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from GGUF key/values (the llama architecture family)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"unsupported GGUF architecture {arch!r}; llmjax reads 'llama' GGUF files")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
        return value

    if meta.get(f"{arch}.expert_count"):
        raise ConfigError(f"mixture-of-experts GGUF files ({arch}.expert_count = {meta[f'{arch}.expert_count']}) "
                          "are not supported; llmjax reads dense llama models")
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ConfigError("GGUF metadata has neither llama.vocab_size nor a token list")
    # RoPE scaling as llama.cpp reads it: the type defaults to linear, the factor is rope.scaling.factor
    # or the older rope.scale_linear, and a factor of 0 or 1 scales nothing
    scaling = meta.get(f"{arch}.rope.scaling.type", "linear")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear")) or 1.0)
    if scaling not in ("linear", "none"):
        raise ConfigError(f"GGUF RoPE scaling {scaling!r} is not supported (only linear); load the model's HF "
                          "checkpoint, whose rope_scaling llmjax reads")
    if scaling == "none" and factor != 1.0:
        raise ConfigError(f"GGUF metadata says RoPE scaling 'none' but gives a scaling factor of {factor}")
    rope = (("factor", factor), ("rope_type", "linear")) if factor != 1.0 else ()
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    rotated = meta.get(f"{arch}.rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:  # llama.cpp refuses it for llama too
        raise ConfigError(f"GGUF {arch}.rope.dimension_count is {rotated}, but llmjax rotates the whole head "
                          f"({head_dim} dims)")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=True,  # the loader unties when the file has output.weight
        eos_token_ids=_eos_ids(eos),
        architecture="LlamaForCausalLM",
    )


def _tiny(attention: str, num_kv_heads: int) -> ModelConfig:
    """Tiny models for experiments: equal hidden size (256) and depth (4) across attention variants."""
    base = dict(
        vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
        max_position_embeddings=2048, rope_theta=10000.0, eos_token_ids=(2,),
    )
    if attention == "mla":
        return ModelConfig(
            **base, num_kv_heads=8, head_dim=0, attention="mla", architecture="DeepseekV3ForCausalLM",
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        )
    return ModelConfig(**base, num_kv_heads=num_kv_heads, head_dim=32)


PRESETS: dict[str, ModelConfig] = {
    "tiny-mha": _tiny("gqa", 8),
    "tiny-gqa": _tiny("gqa", 2),
    "tiny-mqa": _tiny("gqa", 1),
    "tiny-mla": _tiny("mla", 8),
}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine serves: batching policy, token budget, KV memory. Flag names follow vLLM's.

    `kv_cache_memory_bytes` sizes the KV pool (num_blocks = budget / (block_size * bytes per token));
    when None, `gpu_memory_utilization` (default `DEFAULT_GPU_MEMORY_UTILIZATION`) of the device's
    memory is used on an accelerator and a 1 GiB budget on CPU. The two are alternatives: setting
    both is refused, and so is `gpu_memory_utilization` on a platform with no device memory report
    (CPU), where it could only be ignored. The budget is per device: with `tensor_parallel_size` N the GQA cache is
    split by KV head over N devices (the MLA latent cache is replicated); see `llmjax/parallel.py`.
    `coordinator_address`, `num_processes`, `process_id` join a multi-host run (`jax.distributed`).
    `async_scheduling` (vLLM's flag; SGLang's overlap scheduler) dispatches each step before the
    previous one's tokens reach the host, hiding the host's work under the device's.
    `stream_interval` (SGLang's flag): a streamed (DELTA or CUMULATIVE) request with one sample gets
    an output for its first token, then once `stream_interval` tokens are not yet returned, and when
    it finishes; between them a step only records its tokens, so larger values cut the host's work
    per token (and the server's events) at the price of coarser streaming. Requests with n > 1 get
    an output every step.
    `queue_order` "lpm" (SGLang's longest prefix match) orders the waiting requests by their cached
    prefix, so it needs `enable_prefix_caching` (SGLang falls back to FCFS without its radix cache;
    here the combination is refused). `dtype` is one of `DTYPES` (None, or vLLM's "auto":
    `loader.default_dtype()`); `kv_cache_dtype` too (None or "auto": `dtype`).
    `max_num_batched_tokens` is at least `max_num_seqs`, as vLLM requires (every running sequence
    gets its next token each step), and without chunked prefill at least `max_model_len` (a whole
    prompt runs in one step); its default is `DEFAULT_MAX_NUM_BATCHED_TOKENS`, without chunked
    prefill raised to `max_model_len`. `max_model_len`'s default (2048) is capped at the model's
    context by the engine; a larger value set by hand is refused there (see `Default`), and an
    explicit `max_num_batched_tokens` without chunked prefill is checked against the capped value. Static and
    dynamic batches run all their members at once: `batch_size`, the sequences a batch holds (a
    request with n samples counts n), is at most `max_num_seqs` (default `DEFAULT_BATCH_SIZE`, or
    `max_num_seqs` when smaller); `max_delay` (dynamic only) defaults to
    `DEFAULT_MAX_DELAY`. Each is None under a policy that does not read it, and giving it one is
    refused (it would have no effect).
    `attention_backend`, `compilation_cache_dir` and `coordinator_address` are None for their
    default, never empty. `generation_config` (vLLM's flag): "auto" takes a model folder's
    `generation_config.json` sampling settings as the default sampling parameters
    (`LLMEngine.generation_defaults`), "vllm" ignores them.
    """

    max_num_batched_tokens: int = Default(DEFAULT_MAX_NUM_BATCHED_TOKENS)
    max_num_seqs: int = 64
    block_size: int = 16
    max_model_len: int = Default(2048)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None  # None: DEFAULT_GPU_MEMORY_UTILIZATION
    scheduling_policy: Literal["continuous", "static", "dynamic"] = "continuous"
    queue_order: Literal["fcfs", "lpm"] = "fcfs"
    batch_size: int | None = None  # static/dynamic only
    max_delay: float | None = None  # dynamic only
    attention_backend: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    seed: int = 0
    async_scheduling: bool = False
    stream_interval: int = 1
    compilation_cache_dir: str | None = field(default=None)
    tensor_parallel_size: int = 1
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    generation_config: Literal["auto", "vllm"] = "auto"

    def __post_init__(self) -> None:
        self._check_types()
        positive = ("max_num_batched_tokens", "max_num_seqs", "block_size", "max_model_len", "stream_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("attention_backend", "compilation_cache_dir", "coordinator_address"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"{name} must not be empty: leave it unset (None) for its default")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) == "auto":  # vLLM's name for the default
                object.__setattr__(self, name, None)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.scheduling_policy not in ("continuous", "static", "dynamic"):
            raise ConfigError(f"unknown scheduling_policy {self.scheduling_policy!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ConfigError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if self.queue_order not in ("fcfs", "lpm"):
            raise ConfigError(f"unknown queue_order {self.queue_order!r}")
        if isinstance(self.max_num_batched_tokens, Default):
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill else \
                max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
            object.__setattr__(self, "max_num_batched_tokens", Default(budget))
        self._resolve_batching()
        if self.queue_order == "lpm" and not self.enable_prefix_caching:
            raise ConfigError("queue_order 'lpm' orders the waiting requests by their cached prefix: "
                              "it needs enable_prefix_caching")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "a step must give every running sequence its next token: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_num_seqs ({self.max_num_seqs})"
            )
        if not isinstance(self.max_model_len, Default):  # a default one is checked once it is resolved
            self.check_prompts_fit_a_step()
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ConfigError("gpu_memory_utilization must be in (0, 1]")
            if self.kv_cache_memory_bytes is not None:
                raise ConfigError("kv_cache_memory_bytes and gpu_memory_utilization both size the KV cache: give one")
        if self.batch_size is not None and self.batch_size > self.max_num_seqs:
            raise ConfigError(  # else members past max_num_seqs would join mid-batch: continuous batching
                f"a {self.scheduling_policy} batch runs all its requests at once: "
                f"batch_size ({self.batch_size}) > max_num_seqs ({self.max_num_seqs})")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.coordinator_address is None and (self.num_processes, self.process_id) != (None, None):
            raise ConfigError("num_processes and process_id need a coordinator_address")
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"coordinator_address must be host:port, got {self.coordinator_address!r}")
        if self.num_processes is not None and not 0 <= (self.process_id or 0) < self.num_processes:
            raise ConfigError(f"process_id must be in [0, num_processes={self.num_processes}), got {self.process_id}")

    def check_prompts_fit_a_step(self) -> None:
        """Without chunked prefill a whole prompt runs in one step: `max_num_batched_tokens` must be at
        least `max_model_len` (ConfigError). `__post_init__` checks a `max_model_len` set by hand; a
        default one is checked by its user once resolved (the engine, after capping it at the model's
        context, as vLLM resolves the context first; the simulator as it is)."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "without chunked prefill a whole prompt must fit one step: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len ({self.max_model_len})"
            )

    def _check_types(self) -> None:
        """Each field's value is of its annotated kind (an int is no bool, a float any real number
        but a bool; None only where the annotation allows it), else a ConfigError naming it."""
        kinds = {"int": (numbers.Integral, "an integer"), "float": (numbers.Real, "a number"),
                 "bool": (bool, "True or False"), "str": (str, "a string"), "Literal": (str, "a string")}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and "None" in f.type:
                continue
            kind, what = kinds[f.type.split(" |")[0].split("[")[0]]
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ConfigError(f"{f.name} must be {what}, got {value!r}")

    def _resolve_batching(self) -> None:
        """Refuse `batch_size` / `max_delay` under a policy that does not read them; fill in their
        defaults under one that does."""
        for name, policies in BATCHING_FIELDS.items():
            if getattr(self, name) is not None and self.scheduling_policy not in policies:
                raise ConfigError(f"{name} applies to scheduling_policy {' or '.join(policies)} only, "
                                  f"not {self.scheduling_policy!r}")
        if self.scheduling_policy in BATCHING_FIELDS["batch_size"]:
            if self.batch_size is None:
                object.__setattr__(self, "batch_size", min(DEFAULT_BATCH_SIZE, self.max_num_seqs))
            if self.batch_size <= 0:
                raise ConfigError(f"batch_size must be positive, got {self.batch_size}")
        if self.scheduling_policy in BATCHING_FIELDS["max_delay"]:
            if self.max_delay is None:
                object.__setattr__(self, "max_delay", DEFAULT_MAX_DELAY)
            if not 0 <= self.max_delay < math.inf:
                raise ConfigError(f"max_delay must be a finite number of seconds >= 0, got {self.max_delay}")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes`; a batching field (`BATCHING_FIELDS`) not among them is carried to a
        policy that reads it and dropped (None) for one that does not."""
        policy = changes.get("scheduling_policy", self.scheduling_policy)
        for name, policies in BATCHING_FIELDS.items():
            if name not in changes and policy not in policies:
                changes[name] = None
        return dataclasses.replace(self, **changes)
