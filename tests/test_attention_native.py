"""The "cpu" attention backend: the native kernel (decode rows and prefill tiles) against a naive
NumPy reference and the pure-JAX path, its use inside the engine, and the loader's fallback when
it cannot compile."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmjax.attention import backend, cpu, native, xla
from llmjax.attention.cache_dtype import BF16_BITS, to_storage
from llmjax.config import ConfigError
from llmjax.sampling_params import SamplingParams
from tests.attention_cases import Batch, assert_close, naive_gqa, random_cache
from tests.engine_helpers import run_to_completion, tiny_engine

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
BLOCK = 16
DECODE_CONTEXTS = [1, 15, 16, 17, 64, 65, 130, 300]  # block and 64-key chunk boundaries
# (q_len, seq_len) of prefill requests. Their tiles hold 48 // G tokens (48, 16, 12 for G = 1, 3,
# 4): several full tiles and a partial one, a single partial tile; prompts from position 0 and
# chunks mid-context; contexts ending on and across block (16) and 64-key chunk boundaries.
CHUNKS = [(50, 50), (37, 130), (16, 64), (13, 77), (1, 1), (49, 97), (20, 47), (9, 16)]


@pytest.fixture
def kernel():
    if not native.available():
        pytest.skip("the native CPU attention kernel did not build here")


def batch_of(rng, requests, *, num_seqs=None, num_tokens=None, num_blocks=None,
             max_blocks=24) -> Batch:
    """A Batch of (q_len, seq_len) requests (decodes first), then padded (0, 0) requests up to
    `num_seqs` (default: 2 of them), `num_tokens` tokens (default: 3 padded ones) and
    `num_blocks` cache blocks (default: 3 spare); shuffled, non-contiguous block ids, block 0
    (the null block) never used."""
    requests = list(requests)
    requests += [(0, 0)] * ((num_seqs or len(requests) + 2) - len(requests))
    q_lens = [q for q, _ in requests]
    seq_lens = [s for _, s in requests]
    need = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = num_blocks or sum(need) + 3
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(requests), max_blocks), np.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[used:used + n]
        used += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_decodes = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    return Batch(q_lens, seq_lens, num_decodes, num_tokens or int(qsl[-1]) + 3, BLOCK, max_blocks,
                 qsl, np.asarray(seq_lens, np.int32), tables, num_blocks)


def inputs(rng, batch, *, num_kv_heads, group, head_dim, dtype, layers=2):
    """q [T, H, D] and K/V caches holding NaN outside every context, as values and as stored."""
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, num_kv_heads * group, head_dim)), dtype)
    k, v = (random_cache(rng, batch, layers, (num_kv_heads, head_dim), dtype) for _ in range(2))
    stored = (k, v) if dtype == jnp.float32 else tuple(to_storage(x, BF16_BITS) for x in (k, v))
    return q, (k, v), stored


def jitted(fn, **kwargs):
    return jax.jit(functools.partial(fn, **kwargs))


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1), (2, 4), (1, 4)])
def test_kernel_matches_xla(rng, num_kv_heads, group, dtype):
    """Prefill tiles alone, then decodes with the same chunks (one compiled shape): every row
    against the pure-JAX path; padded tokens exactly 0."""
    assert cpu.native_supported(64, jnp.float32) and cpu.native_supported(64, BF16_BITS)
    decodes = [(1, int(c)) for c in rng.permutation(DECODE_CONTEXTS)]
    mixed = batch_of(rng, decodes + CHUNKS)
    prefill = batch_of(rng, CHUNKS, num_seqs=len(mixed.q_lens), num_tokens=mixed.num_tokens,
                       num_blocks=mixed.num_blocks)
    ours = jitted(cpu.ragged_paged_attention, sm_scale=0.125)
    oracle = jitted(xla.ragged_paged_attention, sm_scale=0.125)
    for batch in (prefill, mixed):
        q, _, stored = inputs(rng, batch, num_kv_heads=num_kv_heads, group=group, head_dim=64,
                              dtype=dtype)
        out = ours(q, *stored, jnp.int32(1), *batch.args())
        assert out.dtype == q.dtype
        assert_close(out, np.asarray(oracle(q, *stored, jnp.int32(1), *batch.args()), np.float64),
                     batch, **TOL[dtype])
        np.testing.assert_array_equal(np.asarray(out)[batch.query_start_loc[-1]:], 0.0)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_only_matches_xla(rng, dtype):
    """A decode-only step (`decode_only=True`: every request one token) on the decode path."""
    batch = batch_of(rng, [(1, int(c)) for c in rng.permutation(DECODE_CONTEXTS)])
    q, (k, v), stored = inputs(rng, batch, num_kv_heads=3, group=3, head_dim=64, dtype=dtype)
    out = jitted(cpu.ragged_paged_attention, sm_scale=0.125, decode_only=True)(
        q, *stored, jnp.int32(0), *batch.args())
    assert_close(out, naive_gqa(q, k, v, 0, batch, 0.125), batch, **TOL[dtype])
    oracle = jitted(xla.ragged_paged_attention, sm_scale=0.125, decode_only=True)
    assert_close(out, np.asarray(oracle(q, *stored, jnp.int32(0), *batch.args()), np.float64),
                 batch, **TOL[dtype])


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_traced_inside_scan(rng, dtype):
    """The model's use: lax.scan over layers, the layer index traced; decodes and chunks."""
    batch = batch_of(rng, [(1, 40), (1, 17), (1, 1)] + CHUNKS[1:4])
    q, (k, v), stored = inputs(rng, batch, num_kv_heads=2, group=2, head_dim=32, dtype=dtype,
                               layers=3)

    def all_layers(attention):
        def run(q, k, v, args):
            def body(_, layer):
                return None, attention(q, k, v, layer, *args, sm_scale=0.25)
            return jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32))[1]
        return jax.jit(run)(q, *stored, batch.args())

    outs = all_layers(cpu.ragged_paged_attention)
    oracle = np.asarray(all_layers(xla.ragged_paged_attention), np.float64)
    for layer in range(3):
        assert_close(outs[layer], naive_gqa(q, k, v, layer, batch, 0.25), batch, **TOL[dtype])
        assert_close(outs[layer], oracle[layer], batch, **TOL[dtype])


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("decode_only", [True, False])
def test_cache_is_read_in_place(decode_only):
    """The cache, a scan carry updated every layer, is handed to the kernel without a copy."""
    layers, blocks = 3, 64
    cache = jnp.zeros((layers, blocks, BLOCK, 2, 32), BF16_BITS)
    q = jnp.zeros((8, 4, 32), jnp.bfloat16)
    args = (jnp.array([0, 1, 4]), jnp.array([5, 9]), jnp.ones((2, 4), jnp.int32),
            jnp.int32(2 if decode_only else 1))

    def step(q, k, v):
        def body(carry, layer):
            k, v = (c.at[layer, 1, 0].set(jnp.ones((2, 32), BF16_BITS)) for c in carry)
            out = cpu.ragged_paged_attention(q, k, v, layer, *args, sm_scale=0.25,
                                             decode_only=decode_only)
            return (k, v), out
        return jax.lax.scan(body, (k, v), jnp.arange(layers, dtype=jnp.int32))

    hlo = jax.jit(step, donate_argnums=(1, 2)).lower(q, cache, cache).compile().as_text()
    whole = f"[{layers},{blocks},{BLOCK},2,32]"
    assert any("custom-call" in line and native.TARGET in line for line in hlo.splitlines())
    copies = [line for line in hlo.splitlines() if whole in line and ("copy(" in line or "convert(" in line)]
    assert not copies, copies


@pytest.mark.usefixtures("kernel")
def test_unsupported_head_dim_uses_the_pure_jax_path(rng):
    batch = batch_of(rng, [(1, 20), (1, 3), (7, 30)])
    q, (k, v), stored = inputs(rng, batch, num_kv_heads=1, group=2, head_dim=16, dtype=jnp.float32)
    assert not cpu.native_supported(16, jnp.float32)
    out = jitted(cpu.ragged_paged_attention, sm_scale=0.25)(q, *stored, jnp.int32(0), *batch.args())
    assert_close(out, naive_gqa(q, k, v, 0, batch, 0.25), batch, **TOL[jnp.float32])


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("request_,error", [((1, 20), "block id out of range"),
                                            ((5, 20), "block id out of range"),
                                            ((5, 4), r"seq_lens\[0\] out of range")])
def test_bad_inputs_are_errors(rng, request_, error):
    """An out-of-range block id (decode or prefill request), a prefill context shorter than
    its new tokens."""
    batch = batch_of(rng, [request_], num_seqs=1)
    q, _, stored = inputs(rng, batch, num_kv_heads=1, group=1, head_dim=32, dtype=jnp.float32)
    batch.block_tables[0, 1] = batch.num_blocks  # one past the last block
    with pytest.raises(Exception, match=error):
        jax.block_until_ready(cpu.paged_attention(q, *stored, jnp.int32(0), *batch.args(),
                                                  sm_scale=1.0))


@pytest.mark.usefixtures("kernel")
def test_engine_matches_xla_backend():
    """tiny-gqa (head dim 32, GQA group 4): the same greedy tokens with "cpu" as with "xla";
    step 2 mixes decodes with a prefill chunk."""
    gen = np.random.default_rng(7)
    prompts = [gen.integers(3, 250, size=n).tolist() for n in (5, 19, 20, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {b: run_to_completion(tiny_engine("tiny-gqa", attention_backend=b, block_size=16,
                                                max_num_batched_tokens=32), prompts, params)
               for b in ("xla", "cpu")}
    for ours, ref in zip(outputs["cpu"], outputs["xla"]):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.usefixtures("kernel")
def test_backend_selection():
    assert backend.default_backend_name("cpu") == "cpu"
    b = backend.get_attention_backend("cpu")
    assert b.name == "cpu" and b.reads_storage
    assert b.mla_ragged_paged_attention is xla.mla_ragged_paged_attention
    assert backend.get_attention_backend("xla").reads_storage
    assert not backend.get_attention_backend("pallas-interpret").reads_storage  # bfloat16 views
    assert "cpu" in backend.BACKENDS


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("preset, kv_cache_dtype, message", [
    ("tiny-mla", None, "no MLA path"),
    ("tiny-gqa", "float16", "float32 or bfloat16 KV cache, not head dim 32 and float16"),
])
def test_a_named_cpu_backend_refuses_what_its_kernel_cannot_run(preset, kv_cache_dtype, message):
    """Named, "cpu" is the native kernel or an error; the default choice runs the same model on xla."""
    with pytest.raises(ConfigError, match=message):
        tiny_engine(preset, attention_backend="cpu", kv_cache_dtype=kv_cache_dtype)
    engine = tiny_engine(preset, attention_backend=None, kv_cache_dtype=kv_cache_dtype)
    assert engine.runner.backend.name == "cpu"  # the default, with xla's functions for this model
    [out] = run_to_completion(engine, [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2


def test_build_is_cached_and_safe_to_race(tmp_path, capfd):
    """Two builders at once into an empty cache: one library, no partial file left behind; a
    later build reuses it without compiling."""
    try:
        native.find_compiler()
    except native.BuildError:
        pytest.skip("no C++ compiler")
    paths = [None, None]

    def run(i):
        paths[i] = native.build(tmp_path)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert paths[0] == paths[1] and paths[0].exists()
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    capfd.readouterr()
    assert native.build(tmp_path) == paths[0]
    assert "compiling" not in capfd.readouterr().err


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """No compiler on PATH, an empty kernel cache; the loader's state is reset before and after."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setenv("LLMJAX_NATIVE_CACHE", str(tmp_path / "cache"))
    native.available.cache_clear()
    yield
    native.available.cache_clear()


@pytest.mark.usefixtures("no_compiler")
def test_falls_back_without_a_compiler(caplog):
    with caplog.at_level("WARNING", logger=native.__name__):
        assert not native.available()
        assert not native.available()  # one warning, not one per call
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    assert backend.default_backend_name("cpu") == "xla"
    with pytest.raises(ValueError, match="native kernel is unavailable"):
        backend.get_attention_backend("cpu")


def test_cxx_that_names_no_executable_is_an_error(monkeypatch):
    # not silently replaced by another compiler
    monkeypatch.setenv("CXX", "clang++-no-such-compiler")
    with pytest.raises(native.BuildError, match="no executable"):
        native.find_compiler()


def test_a_cached_library_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    if not native.available():
        pytest.skip("no native kernel here")
    good = native.build()
    broken = tmp_path / "cut-short.so"
    broken.write_bytes(b"")  # what a crash between compiling and syncing can leave under the cached name
    paths = iter([broken, good])
    monkeypatch.setattr(native, "build_library", lambda kernel, directory=None: next(paths))
    assert native.load(native.PAGED_DECODE)
    assert not broken.exists()
