"""Our Flax decoder against HF transformers (PyTorch) on the same random tiny weights.

Each case saves a randomly initialised HF model with `save_pretrained`, loads it through our
safetensors loader, and compares logits on random token batches (float32, max error < 1e-4).
"""

import json

import numpy as np
import pytest
import torch
import transformers

from llmjax.config import ConfigError, model_config_from_gguf_metadata, model_config_from_hf
from llmjax.models.loader import WeightLoadError, embedded_model_path, load_model

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=512)
LLAMA = dict(TINY, num_attention_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0)
DEEPSEEK = dict(
    TINY, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, first_k_dense_replace=3,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

CASES = {
    "llama-mha": ("LlamaConfig", dict(LLAMA, num_key_value_heads=8)),
    "llama-gqa": ("LlamaConfig", dict(LLAMA, num_key_value_heads=2)),
    "llama-mqa": ("LlamaConfig", dict(LLAMA, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", dict(LLAMA, num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-linear-rope": ("LlamaConfig", dict(LLAMA, num_key_value_heads=2, rope_scaling={
        "rope_type": "linear", "factor": 4.0})),
    "llama-yarn-rope": ("LlamaConfig", dict(LLAMA, num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "llama-attention-bias": ("LlamaConfig", dict(LLAMA, num_key_value_heads=2, attention_bias=True)),  # o_proj too
    "llama-mlp-bias-gelu": ("LlamaConfig", dict(LLAMA, num_key_value_heads=2, mlp_bias=True, hidden_act="gelu")),
    "qwen2-bias": ("Qwen2Config", dict(LLAMA, num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(LLAMA, num_key_value_heads=4, sliding_window=None)),
    "deepseek-v3": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=None)),
    "deepseek-v3-qlora-yarn-interleave": ("DeepseekV3Config", dict(
        DEEPSEEK, q_lora_rank=24, rope_interleave=True, rope_scaling=YARN)),
    "deepseek-v3-no-interleave": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=24, rope_interleave=False)),
    # DeepSeek's softmax scale takes mscale_all_dim whatever the RoPE scaling's type
    "deepseek-v3-linear-mscale": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=None, rope_scaling={
        "rope_type": "linear", "factor": 4.0, "mscale_all_dim": 0.707})),
    "deepseek-v2": ("DeepseekV2Config", dict(DEEPSEEK, q_lora_rank=None)),
    "deepseek-v2-mlp-bias-tanh-gelu": ("DeepseekV2Config", dict(DEEPSEEK, q_lora_rank=None, mlp_bias=True,
                                                                hidden_act="gelu_pytorch_tanh")),
}


def _save_hf(tmp_path, config_name, kwargs, seed=0):
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF zero-inits some norms/biases; randomise so every weight matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    config_name, kwargs = CASES[case]
    hf_model = _save_hf(tmp_path, config_name, kwargs)
    ours = load_model(str(tmp_path))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, kwargs["vocab_size"], size=(2, 40))
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens)).logits.numpy()
    model = ours.module()
    got = np.asarray(model(tokens))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    if ours.config.attention == "mla":
        absorbed = np.asarray(model(tokens, absorb_mla=True))
        np.testing.assert_allclose(absorbed, expected, atol=1e-4, rtol=0)


def test_deepseek_v3_rotates_interleaved_pairs_unless_its_config_says_not(tmp_path):
    """HF's DeepseekV3 default for `rope_interleave` is true: a config.json without the key means it."""
    hf_model = _save_hf(tmp_path, "DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=None, rope_interleave=True))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_interleave"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens = np.random.default_rng(0).integers(0, DEEPSEEK["vocab_size"], size=(1, 24))
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(load_model(str(tmp_path)).module()(tokens)), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "quick_gelu"}, "unsupported hidden_act 'quick_gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor, high_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
])
def test_model_settings_llmjax_cannot_honour_are_refused(change, message):
    hf = {**LLAMA, "num_key_value_heads": 2, "architectures": ["LlamaForCausalLM"], **change}
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(hf)


def test_gguf_rope_scaling_other_than_linear_and_experts_are_refused():
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 8,
            "llama.vocab_size": 320, "llama.feed_forward_length": 96, "llama.block_count": 2}
    with pytest.raises(ConfigError, match="GGUF RoPE scaling 'yarn' is not supported"):
        model_config_from_gguf_metadata({**meta, "llama.rope.scaling.type": "yarn"})
    with pytest.raises(ConfigError, match="mixture-of-experts GGUF files"):  # Mixtral as llama.cpp writes it
        model_config_from_gguf_metadata({**meta, "llama.expert_count": 8})
    # llama.cpp's reading of RoPE scaling: the type defaults to linear, the factor may be the older key,
    # 0 or 1 scales nothing, and a rotated part other than the whole head is refused
    linear4 = (("factor", 4.0), ("rope_type", "linear"))
    for keys, rope in [({"llama.rope.scaling.factor": 4.0}, linear4), ({"llama.rope.scale_linear": 4.0}, linear4),
                       ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0}, ()),
                       ({"llama.rope.scaling.factor": 0.0}, ()), ({"llama.rope.scaling.type": "none"}, ()),
                       ({"llama.rope.dimension_count": 8}, ())]:
        assert model_config_from_gguf_metadata({**meta, **keys}).rope_scaling == rope, keys
    with pytest.raises(ConfigError, match="RoPE scaling 'none' but gives a scaling factor of 4.0"):
        model_config_from_gguf_metadata({**meta, "llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ConfigError, match="rope.dimension_count is 4, but llmjax rotates the whole head"):
        model_config_from_gguf_metadata({**meta, "llama.rope.dimension_count": 4})


def test_a_gguf_with_a_rope_scaling_factor_and_no_type_is_linear_as_in_llama_cpp(tmp_path):
    """A GGUF giving only `rope.scaling.factor` (llama.cpp reads its type as linear) gives the logits
    of the HF model with linear RoPE scaling by that factor."""
    kwargs = dict(LLAMA, num_hidden_layers=2, num_key_value_heads=2,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    hf_model = _save_hf(tmp_path / "hf", "LlamaConfig", kwargs)
    _write_llama_gguf(tmp_path / "scaled.gguf", hf_model, kwargs, configure=lambda w: w.add_rope_scaling_factor(4.0))
    ours = load_model(str(tmp_path / "scaled.gguf"))
    assert ours.config.rope_params["rope_type"] == "linear"
    _assert_logits_match(ours, hf_model, kwargs["vocab_size"])


def _llama_cpp_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp's converter writes it (rope_freqs.weight): per rotated pair,
    the divisor of its frequency, from HF's `rope_scaling` (llama3) parameters."""
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    old, lo, hi, factor = (rope[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                             "high_freq_factor", "factor"))
    smooth = (old / wavelen - lo) / (hi - lo)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, 1 / ((1 - smooth) / factor + smooth)))


def _write_llama_gguf(path, hf_model, kwargs, extra_tensors=(), configure=None) -> None:
    """`hf_model` (HF Llama) as llama.cpp's converter writes it: GGUF names, q/k rows (and biases) in
    its RoPE order; then `extra_tensors` ((name, array) pairs). `configure(writer)` adds metadata."""
    import gguf

    heads, kv_heads = kwargs["num_attention_heads"], kwargs["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(kwargs["max_position_embeddings"])
    writer.add_embedding_length(kwargs["hidden_size"])
    writer.add_block_count(kwargs["num_hidden_layers"])
    writer.add_feed_forward_length(kwargs["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(kwargs["rms_norm_eps"])
    writer.add_rope_freq_base(kwargs["rope_theta"])
    writer.add_vocab_size(kwargs["vocab_size"])
    if configure is not None:
        configure(writer)
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        if name.startswith("model.layers."):
            stem, kind = name.rsplit(".", 1)  # kind: weight or bias
            _, _, layer, rest = stem.split(".", 3)
            n = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}.get(rest)
            if n:  # llama.cpp's row order for its RoPE
                w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            name = f"blk.{layer}.{per_layer[rest]}.{kind}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(name, np.ascontiguousarray(w))
    for name, w in extra_tensors:
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_logits_match(ours, hf_model, vocab_size: int) -> None:
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=(1, 48))
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours.module()(tokens)), expected, atol=1e-4, rtol=0)


def test_a_llama3_gguf_with_rope_frequency_factors_matches_transformers(tmp_path):
    """A GGUF as llama.cpp's converter writes a Llama 3 model (q/k rows permuted, the RoPE scaling as a
    rope_freqs.weight tensor, no rope.scaling keys) gives the HF model's logits."""
    config_name, kwargs = CASES["llama3-rope"]
    hf_model = _save_hf(tmp_path / "hf", config_name, kwargs)
    cfg = hf_model.config
    rope = {**(getattr(cfg, "rope_parameters", None) or cfg.rope_scaling), "rope_theta": kwargs["rope_theta"]}
    factors = _llama_cpp_rope_factors(rope, kwargs["hidden_size"] // kwargs["num_attention_heads"])
    _write_llama_gguf(tmp_path / "llama3.gguf", hf_model, kwargs, [("rope_freqs.weight", factors.astype(np.float32))])
    ours = load_model(str(tmp_path / "llama3.gguf"))
    assert ours.config.rope_params["rope_type"] == "freq_factors"
    _assert_logits_match(ours, hf_model, kwargs["vocab_size"])


def test_a_gguf_with_biases_matches_transformers_under_any_file_name(tmp_path):
    """HF Llama's `attention_bias` and `mlp_bias` as llama.cpp writes them (q/k/v/output and
    gate/up/down biases, q/k in its RoPE order) give the HF model's logits; a GGUF file is known by
    its magic bytes whatever its name (as Ollama stores them), and another file is refused."""
    kwargs = dict(LLAMA, num_hidden_layers=2, num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    hf_model = _save_hf(tmp_path / "hf", "LlamaConfig", kwargs)
    blob = tmp_path / "sha256-0123abcd"
    _write_llama_gguf(blob, hf_model, kwargs)
    ours = load_model(str(blob))
    assert ours.config.attention_bias and ours.config.attention_out_bias and ours.config.mlp_bias
    _assert_logits_match(ours, hf_model, kwargs["vocab_size"])
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(WeightLoadError, match="notes.txt is no GGUF file"):
        load_model(str(tmp_path / "notes.txt"))


def test_a_gguf_with_tensors_llmjax_does_not_use_is_refused(tmp_path):
    """A tensor the model would not read (here Qwen3-style q/k norms) would be dropped silently, giving
    wrong outputs: such a file is refused, naming the tensors."""
    kwargs = dict(LLAMA, num_hidden_layers=1, num_key_value_heads=2)
    hf_model = _save_hf(tmp_path / "hf", "LlamaConfig", kwargs)
    norm = np.ones(8, np.float32)
    _write_llama_gguf(tmp_path / "qk_norm.gguf", hf_model, kwargs,
                      [("blk.0.attn_q_norm.weight", norm), ("blk.0.attn_k_norm.weight", norm)])
    with pytest.raises(WeightLoadError, match="does not use: blk.0.attn_k_norm.weight, blk.0.attn_q_norm.weight"):
        load_model(str(tmp_path / "qk_norm.gguf"))


def test_a_broken_checkpoint_is_a_clear_error(tmp_path):
    _save_hf(tmp_path, "LlamaConfig", dict(LLAMA, num_key_value_heads=2))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(WeightLoadError, match="model.safetensors is not a readable safetensors file"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not a usable config.json: JSONDecodeError"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("edit", [
    # a model card's `rope_scaling` added to a config saved with `rope_parameters`: transformers reads it
    lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    # both thetas: transformers reads the RoPE parameters' own
    lambda c: c.update(rope_theta=500.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # transformers 4's form, with its theta inside the scaling
    lambda c: (c.pop("rope_parameters", None), c.pop("rope_theta", None),
               c.update(rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})),
])
def test_rope_settings_are_read_as_transformers_reads_them(edit, tmp_path):
    """config.json edited by hand after `save_pretrained`: both load the same folder; same logits."""
    _save_hf(tmp_path, "LlamaConfig", dict(LLAMA, num_key_value_heads=2))
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, LLAMA["vocab_size"], size=(1, 100))
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(load_model(str(tmp_path)).module()(tokens)), expected, atol=1e-4, rtol=0)


def test_a_tied_models_stored_head_must_be_the_embeddings_copy(tmp_path):
    """transformers uses a stored lm_head.weight even when tied; llmjax reads the embedding, so a
    head that differs is refused, never dropped."""
    from safetensors.numpy import load_file, save_file

    _save_hf(tmp_path, "LlamaConfig", dict(LLAMA, num_key_value_heads=2, tie_word_embeddings=True))
    tensors = load_file(tmp_path / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embedding.copy()}, tmp_path / "model.safetensors")
    load_model(str(tmp_path))  # the embedding's copy: fine
    save_file({**tensors, "lm_head.weight": embedding * 2}, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("config_name,extra,context", [
    ("MistralConfig", {"sliding_window": 32}, 32),
    ("MistralConfig", {"sliding_window": None}, 512),
    # a config.json without the key: the window transformers' config class assumes
    ("MistralConfig", {"drop_sliding_window": True, "max_position_embeddings": 32768},
     transformers.MistralConfig().sliding_window),
    ("Qwen2Config", {"sliding_window": 32, "use_sliding_window": True}, 32),
    ("Qwen2Config", {"sliding_window": 32, "use_sliding_window": False}, 512),
])
def test_a_sliding_window_bounds_the_context(config_name, extra, context):
    """Attention here sees the whole context, as the model's sliding window does only within the window."""
    extra = dict(extra)
    drop_window = extra.pop("drop_sliding_window", False)
    hf = getattr(transformers, config_name)(**dict(LLAMA, num_key_value_heads=2, **extra)).to_dict()
    if drop_window:
        del hf["sliding_window"]
    hf["architectures"] = [config_name.replace("Config", "ForCausalLM")]
    assert model_config_from_hf(hf).max_position_embeddings == context


def test_yarn_without_a_factor_takes_the_context_before_the_window_bounds_it(tmp_path):
    """transformers' YaRN factor when the config gives none: max_position_embeddings / original, on
    the model's own context even when a sliding window bounds what llmjax serves."""
    _save_hf(tmp_path, "MistralConfig", dict(LLAMA, num_key_value_heads=2, sliding_window=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}))
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["factor"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, LLAMA["vocab_size"], size=(1, 60))  # inside the window
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(load_model(str(tmp_path)).module()(tokens)), expected, atol=1e-4, rtol=0)


def test_moe_config_is_refused():
    hf = dict(DEEPSEEK, architectures=["DeepseekV3ForCausalLM"], n_routed_experts=8, first_k_dense_replace=1)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        model_config_from_hf(hf)


def test_unknown_architecture_is_refused():
    with pytest.raises(ConfigError, match="unknown architecture 'GPT2LMHeadModel'"):
        model_config_from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_model("/nonexistent/model")


def test_shape_mismatch_names_the_tensor(tmp_path):
    _save_hf(tmp_path, "LlamaConfig", dict(LLAMA, num_key_value_heads=2))
    cfg = (tmp_path / "config.json").read_text().replace('"intermediate_size": 96', '"intermediate_size": 100')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(WeightLoadError, match="mlp.*shape"):
        load_model(str(tmp_path))


def test_a_quantized_checkpoint_is_refused_not_read_as_weights(tmp_path):
    """A bitsandbytes int8 checkpoint (int8 codes and `.SCB` scales) is refused by its config; its int8
    tensors are refused as weights even without one."""
    import json

    from safetensors.numpy import load_file, save_file

    _save_hf(tmp_path, "LlamaConfig", dict(LLAMA, num_key_value_heads=2))
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    scale = np.abs(tensors[name]).max(axis=1) / 127
    tensors[name] = np.round(tensors[name] / scale[:, None]).astype(np.int8)
    tensors[name.replace("weight", "SCB")] = scale.astype(np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(WeightLoadError, match=f"tensor {name} .* is int8; llmjax reads floating-point weights"):
        load_model(str(tmp_path))
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantized checkpoints \(bitsandbytes\) are not supported"):
        load_model(str(tmp_path))


def test_a_folder_with_tensors_the_model_would_not_read_is_refused(tmp_path):
    """A weight the config does not account for (here q_proj biases of a Llama without
    attention_bias) is refused, not dropped; a tied model's stored lm_head copy is no such weight."""
    from safetensors.numpy import load_file, save_file

    hf_model = _save_hf(tmp_path, "LlamaConfig", dict(LLAMA, num_key_value_heads=2, tie_word_embeddings=True))
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, tmp_path / "model.safetensors")
    _assert_logits_match(load_model(str(tmp_path)), hf_model, LLAMA["vocab_size"])
    tensors["model.layers.1.self_attn.q_proj.bias"] = np.ones(64, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="does not use: model.layers.1.self_attn.q_proj.bias"):
        load_model(str(tmp_path))


def test_truncated_gguf_is_refused(tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(embedded_model_path().read_bytes()[:200_000])
    with pytest.raises(WeightLoadError, match="not a readable GGUF"):
        load_model(str(bad))


def test_bfloat16_layer_weights_stored_as_bits_compute_the_same():
    """On CPU the stacked bfloat16 layer weights are held as uint16 bits (the scan bitcasts each layer's
    slice); the logits equal those of the same bfloat16 weights held as bfloat16."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from llmjax.models.loader import random_params
    from llmjax.models.transformer import store_layer_weights

    cfg = load_model("tiny-gqa").config
    graphdef, plain = random_params(cfg, jnp.bfloat16, seed=3)
    stored = store_layer_weights(plain, platform="cpu")
    assert {x.dtype for x in jax.tree.leaves(stored)} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16)}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)))
    np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, stored)(tokens)),
                                  np.asarray(nnx.merge(graphdef, plain)(tokens)))


def test_a_folders_generation_config_sets_the_default_sampling_parameters(tmp_path):
    """vLLM's generation_config "auto": generation_config.json's temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens (as max_tokens) are the defaults of a request given no
    SamplingParams; "vllm" ignores the file; values no request could take are refused."""
    from llmjax.config import EngineConfig
    from llmjax.engine import LLMEngine
    from llmjax.sampling_params import SamplingParams
    from llmjax.tokenizer import CharTokenizer
    from tests.engine_helpers import drain

    _save_hf(tmp_path, "LlamaConfig", dict(LLAMA, num_key_value_heads=2))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.0, "top_k": 7, "repetition_penalty": None, "max_new_tokens": 3,
         "bos_token_id": 1}))
    loaded = load_model(str(tmp_path))
    assert loaded.generation_defaults == {"temperature": 0.0, "top_k": 7, "max_tokens": 3}
    config = EngineConfig(max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=1 << 20, dtype="float32")

    def run(engine, params=None):
        [output] = drain(engine, [engine.add_request([5, 6, 7], params)])
        return output.outputs[0].token_ids

    auto = LLMEngine(loaded, CharTokenizer(), config)
    expected = run(auto, SamplingParams(temperature=0.0, top_k=7, max_tokens=3))
    assert run(auto) == expected and len(expected) == 3
    ignored = LLMEngine(loaded, CharTokenizer(), config.replace(generation_config="vllm"))
    assert ignored.generation_defaults == {}
    ignored.add_request([5, 6, 7])
    assert ignored.scheduler.waiting[0].sampling_params == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(ConfigError, match="generation_config.json: temperature"):
        LLMEngine(load_model(str(tmp_path)), CharTokenizer(), config)

