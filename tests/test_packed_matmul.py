"""The packed bfloat16 matmul (`llmjax/ops/packed_matmul.py`): packing, each kernel (AMX,
AVX512-BF16) against a float64 reference over bfloat16-rounded inputs, inside jit and a layer scan,
the model's use of the kernel selected here, and the fallback to XLA's dot where there is none or
it is switched off."""

from __future__ import annotations

import ctypes
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llmjax.attention import native
from llmjax.models.loader import load_model, random_params
from llmjax.models.transformer import pack_linear_weights, store_layer_weights
from llmjax.ops import packed_matmul as pmm
from llmjax.sampling_params import SamplingParams
from tests.engine_helpers import dense_greedy, run_to_completion, tiny_engine

BF16 = jnp.bfloat16
MODEL_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # SmolLM2-135M's (K, N)


@pytest.fixture(params=pmm.KERNELS, ids=lambda k: k.name)
def kernel(request) -> pmm.PackedKernel:
    """Each kernel, for tests that execute its instructions: skipped where the CPU lacks its
    features; where it has them, a kernel that does not build fails the test (a skip only when
    there is no compiler, or Linux refused AMX's tile permission)."""
    kernel = request.param
    if not kernel.cpu_supports():
        pytest.skip(f"the CPU lacks {', '.join(kernel.cpu_features)}")
    if not pmm.loads(kernel):
        try:
            native.find_compiler()
        except native.BuildError as exc:
            pytest.skip(str(exc))
        native.build_library(kernel.build)  # raises (fails the test) when the source does not compile
        if kernel is pmm.AMX:
            pytest.skip("AMX is present but the kernel refused to initialise (see the logged warning)")
        pytest.fail(f"{kernel.build.label} compiled but did not load (see the logged warning)")
    return kernel


@pytest.fixture
def model_kernel() -> pmm.PackedKernel:
    """The kernel a bfloat16 model runs here; skipped where there is none."""
    if pmm.selected() is None:
        pytest.skip("no packed matmul kernel here (the CPU lacks AMX and AVX512-BF16, or no compiler)")
    return pmm.selected()


def compiler_targets(kernel: pmm.PackedKernel) -> str | None:
    """Why this toolchain cannot build `kernel` (no compiler, or it does not know its flags), or None."""
    try:
        compiler = native.find_compiler()
    except native.BuildError as exc:
        return str(exc)
    probe = subprocess.run([compiler, *kernel.build.flags, "-x", "c++", "-", "-o", os.devnull],
                           input="int f() { return 0; }\n", capture_output=True, text=True, timeout=120)
    return None if probe.returncode == 0 else f"{compiler} cannot target {kernel.name}: {probe.stderr[-500:]}"


@pytest.mark.parametrize("kernel", pmm.KERNELS, ids=lambda k: k.name)
def test_kernel_source_builds(kernel):
    """Wherever a C++ compiler can target a kernel's instructions (compiling needs no such hardware),
    its source builds into a library exporting the FFI handler (and AMX's init symbol, which never
    reports ready on a CPU without AMX); so a broken kernel fails here instead of showing up as skips."""
    reason = compiler_targets(kernel)
    if reason:
        pytest.skip(reason)
    library = ctypes.CDLL(str(native.build_library(kernel.build)))  # BuildError (with the compiler's output) fails
    for _, symbol in kernel.build.targets:
        assert hasattr(library, symbol), symbol
    if kernel.build.init is None:
        return
    init = getattr(library, kernel.build.init)
    init.restype = ctypes.c_int
    code = init()  # checks CPUID first: executes no AMX instruction on a CPU without it
    if native.cpu_features().issuperset({"amx_tile", "amx_bf16"}):
        assert code in (0, 2), code  # ready, or Linux refused the tile permission
    else:
        assert code != 0, "the kernel declared itself ready on a CPU without AMX"


def weight(rng, k, n) -> np.ndarray:
    return rng.standard_normal((k, n)).astype(BF16)


def check(x, w, y):
    """y == bf16(x) @ w with float32 summation: within 1e-5 of sum |x_i w_i| per element."""
    xb = np.asarray(jnp.asarray(x).astype(BF16), np.float64)
    wf = np.asarray(w, np.float64)
    ref = xb @ wf
    bound = 1e-5 * (np.abs(xb) @ np.abs(wf)) + 1e-30
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    np.testing.assert_array_less(np.abs(y - ref), bound)


def matmul(x, packed, n, kernel):
    return jax.jit(pmm.packed_matmul, static_argnums=(2, 4))(x, packed, n, None, kernel)


def test_pack_layout():
    """Element [nb, kb, t, r, 2c + p] is W[32 kb + 2 r + p, 32 nb + 16 t + c]; padding is 0."""
    k, n = 40, 50
    w = np.arange(k * n, dtype=np.float32).reshape(k, n) % 251
    packed = pmm.pack_weight(w.astype(BF16))
    assert packed.shape == pmm.packed_shape(k, n) == (2, 2, 2, 16, 32) and packed.dtype == BF16
    p = packed.astype(np.float32)
    for nb, kb, t, r, c, q in [(0, 0, 0, 0, 0, 0), (1, 0, 0, 3, 5, 1), (0, 1, 1, 2, 7, 1),
                               (1, 1, 0, 3, 1, 0)]:
        assert p[nb, kb, t, r, 2 * c + q] == w[32 * kb + 2 * r + q, 32 * nb + 16 * t + c]
    assert (p[1, :, 1, :, 4:] == 0).all() and (p[:, 1, :, 4:] == 0).all()  # columns >= 50, rows >= 40
    stacked = pmm.pack_weight(np.stack([w, 2 * w]).astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(stacked[1].astype(np.float32), 2 * p)
    with pytest.raises(TypeError):
        pmm.pack_weight(w)


@pytest.mark.parametrize("m,k,n", [(1, 32, 32), (5, 40, 20), (16, 64, 48), (17, 96, 16),
                                   (31, 33, 100), (33, 100, 77), (250, 7, 130), (600, 576, 192)])
def test_matches_reference_on_odd_shapes(m, k, n, kernel):
    rng = np.random.default_rng(m * 1000 + k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = weight(rng, k, n)
    check(x, w, matmul(x, jnp.asarray(pmm.pack_weight(w)), n, kernel))


@pytest.mark.parametrize("rows", [1, 64, 512])
@pytest.mark.parametrize("k,n", MODEL_SHAPES)
def test_matches_reference_on_model_shapes(rows, k, n, kernel):
    rng = np.random.default_rng(rows + k + n)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    w = weight(rng, k, n)
    check(x, w, matmul(x, jnp.asarray(pmm.pack_weight(w)), n, kernel))


def test_tied_lm_head_shape(kernel):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 576)), jnp.float32)
    w = weight(rng, 576, 49152)
    check(x, w, matmul(x, jnp.asarray(pmm.pack_weight(w)), 49152, kernel))


def test_rounds_inputs_like_astype(kernel):
    """x @ I returns bf16(x) exactly: the kernel rounds as `astype(bfloat16)` does (ties to even,
    values at every rounding boundary, signs, zeros, large and tiny normals)."""
    rng = np.random.default_rng(2)
    bits = rng.integers(0x00800000, 0x7f000000, 30 * 32, dtype=np.uint32)
    bits[::3] = (bits[::3] & 0xffff0000) | 0x8000  # exact ties
    bits[1::3] = (bits[1::3] & 0xffff0000) | 0x7fff
    x = bits.view(np.float32).reshape(30, 32) * np.where(rng.random((30, 32)) < 0.5, -1, 1)
    x[0, :4] = [0.0, -0.0, 1.0, 3.0e38]
    eye = np.eye(32, dtype=np.float32).astype(BF16)
    for xin in (jnp.asarray(x), jnp.asarray(x).astype(BF16)):
        y = matmul(xin, jnp.asarray(pmm.pack_weight(eye)), 32, kernel)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(xin.astype(BF16).astype(jnp.float32)))


def test_leading_axes_and_bfloat16_input(kernel):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 9, 64)), BF16)
    w = weight(rng, 64, 96)
    y = matmul(x, jnp.asarray(pmm.pack_weight(w)), 96, kernel)
    assert y.shape == (2, 9, 96) and y.dtype == jnp.float32
    check(x.reshape(18, 64), w, y.reshape(18, 96))


def test_wrong_packing_is_an_error(kernel):
    w = jnp.asarray(pmm.pack_weight(np.zeros((64, 48), BF16)))
    with pytest.raises(ValueError, match="does not pack"):
        pmm.packed_matmul(jnp.zeros((4, 96)), w, 48, kernel=kernel)
    with pytest.raises(ValueError, match="does not pack"):
        pmm.packed_matmul(jnp.zeros((4, 64)), w.astype(jnp.float32), 48, kernel=kernel)


def copies_of_packed_weights(hlo: str, shapes) -> list[str]:
    """Instructions of compiled HLO text that produce an array of one of the packed weight
    `shapes` (or one layer of it, a leading 1) by slicing, copying or a fusion."""
    wanted = {tuple(s) for s in shapes} | {(1, *s) for s in shapes}
    found = []
    for line in hlo.splitlines():
        if " = " not in line:
            continue
        result, _, rest = line.split(" = ", 1)[1].partition(" ")
        dims = result.split("[", 1)[-1].split("]")[0]
        op = rest.split("(")[0]
        if op in ("dynamic-slice", "copy", "fusion") and dims and tuple(map(int, dims.split(","))) in wanted:
            found.append(line.strip())
    return found


def test_layer_scan_reads_the_stack_in_place(kernel):
    """A scan over layers passing the whole stack of packed weights (uint16 bits, as the model
    stores them) and the traced layer index: per-layer reference products, and no instruction
    slices or copies the weights."""
    rng = np.random.default_rng(4)
    layers, d = 3, 96
    ws = [weight(rng, d, d) * 0.1 for _ in range(layers)]
    stacked = jnp.asarray(pmm.pack_weight(np.stack(ws)).view(np.uint16))
    x = jnp.asarray(rng.standard_normal((40, d)), jnp.float32)

    @jax.jit
    def run(x, stacked):
        def body(h, layer):
            return pmm.packed_matmul(h, stacked, d, layer=layer, kernel=kernel), None
        return jax.lax.scan(body, x, jnp.arange(layers, dtype=jnp.int32))[0]

    y = run(x, stacked)
    h = x
    for w in ws:
        h = jnp.asarray(np.asarray(h.astype(BF16), np.float64) @ np.asarray(w, np.float64), jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(h), rtol=1e-4, atol=1e-4)
    hlo = run.lower(x, stacked).compile().as_text()
    assert copies_of_packed_weights(hlo, [pmm.packed_shape(d, d)]) == []


def test_layer_out_of_range_is_an_error(kernel):
    stacked = jnp.asarray(pmm.pack_weight(np.zeros((2, 32, 32), BF16)))
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(pmm.packed_matmul(jnp.zeros((4, 32)), stacked, 32, layer=2, kernel=kernel))


@pytest.mark.usefixtures("model_kernel")
def test_packed_model_computes_the_same():
    """A bfloat16 model with packed kernels (and a packed tied LM head) gives the logits of the
    same weights run by XLA's dots, up to float32 summation order; its layer scan copies no
    packed weights."""
    cfg = load_model("tiny-gqa").config.replace(tie_word_embeddings=True)
    graphdef, plain = random_params(cfg, BF16, seed=3)
    packed_def, packed = pack_linear_weights(graphdef, plain)
    packed = store_layer_weights(packed, platform="cpu")
    kernel = packed["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.shape == (cfg.num_layers, *pmm.packed_shape(cfg.hidden_size, cfg.intermediate_size))
    assert packed["lm_head"]["kernel"].shape == pmm.packed_shape(cfg.hidden_size, cfg.vocab_size)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)))
    forward = jax.jit(lambda state, tokens: nnx.merge(packed_def, state)(tokens))
    d, kv, inter = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = [pmm.packed_shape(k, n) for k, n in [(d, cfg.num_heads * cfg.head_dim), (d, kv),
                                                   (d, inter), (inter, d)]]
    assert copies_of_packed_weights(forward.lower(packed, tokens).compile().as_text(), shapes) == []
    ours = np.asarray(forward(packed, tokens))
    ref = np.asarray(nnx.merge(graphdef, store_layer_weights(plain, platform="cpu"))(tokens))
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def _is_packed(loaded) -> bool:
    return loaded.params["layers"]["mlp"]["up_proj"]["kernel"].ndim == 6


@pytest.mark.usefixtures("model_kernel")
def test_loader_packs_only_bfloat16_models(monkeypatch):
    assert _is_packed(load_model("tiny-gqa", dtype=BF16))
    assert not _is_packed(load_model("tiny-gqa", dtype=jnp.float32))
    monkeypatch.setenv(pmm.DISABLE_ENV, "1")
    assert not _is_packed(load_model("tiny-gqa", dtype=BF16))


def test_falls_back_without_a_kernel(monkeypatch):
    """A CPU with neither AMX nor AVX512-BF16: no kernel is selected or compiled, the loader keeps
    plain kernels, the model runs XLA's dots, and a kernel this CPU lacks is refused before it runs."""
    monkeypatch.setattr(pmm.native, "cpu_features", lambda: frozenset({"avx2", "avx512f"}))
    pmm.selected.cache_clear()
    try:
        assert pmm.selected() is None and not pmm.enabled(BF16)
        loaded = load_model("tiny-gqa", dtype=BF16)
        assert not _is_packed(loaded)
        logits = loaded.module()(jnp.zeros((1, 4), jnp.int32))
        assert logits.shape == (1, 4, loaded.config.vocab_size) and np.isfinite(logits).all()
        for kernel in (None, *pmm.KERNELS):
            with pytest.raises(RuntimeError, match="no packed bfloat16 matmul kernel"):
                pmm.packed_matmul(jnp.zeros((1, 32)), jnp.zeros(pmm.packed_shape(32, 32), BF16), 32, kernel=kernel)
    finally:
        pmm.selected.cache_clear()


@pytest.mark.usefixtures("model_kernel")
def test_engine_greedy_tokens_with_and_without_the_kernel(monkeypatch):
    """tiny-gqa in bfloat16: the same greedy tokens with the packed kernel as with XLA's dots, or the
    first difference falls on a near-tie of the XLA model's logits."""
    gen = np.random.default_rng(5)
    prompts = [gen.integers(3, 250, size=n).tolist() for n in (5, 19, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = tiny_engine("tiny-gqa", dtype="bfloat16")
    assert _is_packed(engine.runner)
    ours = [o.outputs[0].token_ids for o in run_to_completion(engine, prompts, params)]
    monkeypatch.setenv(pmm.DISABLE_ENV, "1")
    ref_engine = tiny_engine("tiny-gqa", dtype="bfloat16")
    assert not _is_packed(ref_engine.runner)
    refs = [o.outputs[0].token_ids for o in run_to_completion(ref_engine, prompts, params)]
    for prompt, a, b in zip(prompts, ours, refs):
        if a == b:
            continue
        i = next(j for j, (u, v) in enumerate(zip(a, b)) if u != v)
        _, logits = dense_greedy(ref_engine, prompt + b[:i], 1)
        gap = abs(float(logits[0][a[i]] - logits[0][b[i]]))
        assert gap < 1e-2 * float(np.abs(logits[0]).max()), f"token {i} differs, logit gap {gap}"


@pytest.mark.parametrize("packed, features, expected", [
    (True, {"amx_bf16", "avx512_bf16"}, jnp.bfloat16),  # Sapphire Rapids: the AMX kernel
    (False, {"amx_bf16", "avx512_bf16"}, jnp.bfloat16),  # the same with LLMJAX_NO_PACKED_MATMUL: XLA's dots
    (True, {"avx512f", "avx512_bf16"}, jnp.bfloat16),  # Zen 4: the AVX512-BF16 kernel
    (False, {"avx512f", "avx512_bf16"}, jnp.bfloat16),  # Zen 4 without it: XLA's bfloat16 dots on VDPBF16PS
    (False, {"avx2", "avx512f"}, jnp.float32),  # no bfloat16 dot instructions: XLA would upcast
])
def test_cpu_default_dtype_is_bfloat16_only_with_bfloat16_dot_instructions(monkeypatch, packed, features, expected):
    from llmjax.models import loader

    monkeypatch.setattr(loader.packed_matmul, "enabled", lambda dtype: packed and jnp.dtype(dtype) == jnp.bfloat16)
    monkeypatch.setattr(loader.native, "cpu_features", lambda: frozenset(features))
    assert loader.default_dtype() == expected


@pytest.mark.parametrize("value, disabled", [("", False), ("0", False), ("false", False), ("Off", False),
                                             ("1", True), ("true", True), ("YES", True), ("on", True)])
def test_the_disabling_variable_reads_its_value_not_its_presence(monkeypatch, value, disabled):
    monkeypatch.setenv(pmm.DISABLE_ENV, value)
    assert pmm.disabled_by_env() is disabled


def test_a_disabling_variable_that_is_no_boolean_is_an_error(monkeypatch):
    monkeypatch.setenv(pmm.DISABLE_ENV, "maybe")
    with pytest.raises(ValueError, match="LLMJAX_NO_PACKED_MATMUL"):
        pmm.disabled_by_env()
