"""Pallas kernels against the pure-JAX references, and lowered for CUDA.

Kernels run natively on a GPU and in interpret mode elsewhere (`INTERPRET`); the CUDA
lowering runs on any host (`pallas_kernels.platform.lower_for_cuda`).
Unwritten outputs cannot pass in interpret mode: Pallas' interpreter fills every output
buffer with NaN before the kernel runs (`test_interpreter_poisons_outputs` pins that
premise; natively an unwritten element is whatever memory held), the
kernels write every element by construction, and every test asserts the whole output
finite and equal to the reference, padded tokens included (the reference gives zeros
there). The caches hold NaN outside the requests' contexts, so a masked key that leaks
into a softmax or a P@V product also fails. Inputs are fresh random values each run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from tests.attention_cases import make_batch, random_cache
from llmjax.attention import get_attention_backend, xla
from pallas_kernels import (flash_attention, flash_prefill, mla_ragged_paged_attention, paged_attention,
                            prefill_segment_starts, ragged_paged_attention)
from pallas_kernels.paged_attention import MIN_SPLIT_STEPS, split_range
from pallas_kernels.platform import default_interpret, lower_for_cuda, on_gpu
from pallas_kernels.ragged_paged_attention import plan_tiles

BS = 16  # block size: the kernels need powers of two >= 16
INTERPRET = default_interpret()  # native on a GPU, interpret mode elsewhere
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def assert_matches(out, ref, dtype):
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "non-finite output: an unwritten or masked-in element"
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), **TOL[dtype])


def lowers_for_cuda(f, *args):
    lower_for_cuda(f, *args)


def test_interpreter_poisons_outputs():
    """The premise of the 'every element written' checks: unwritten outputs read NaN."""
    def kernel(x_ref, o_ref):
        pl_triton.store(o_ref.at[pl.ds(0, 16)], x_ref[pl.ds(0, 16)])

    out = pl.pallas_call(kernel, grid=(1,), in_specs=[pl.no_block_spec],
                         out_specs=pl.no_block_spec, out_shape=jax.ShapeDtypeStruct((32,), jnp.float32),
                         compiler_params=pl_triton.CompilerParams(), interpret=True)(jnp.ones(32))
    assert np.isfinite(out[:16]).all() and np.isnan(out[16:]).all()


def gqa_inputs(rng, batch, *, num_kv_heads, group, head_dim=16, dtype=jnp.float32):
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, num_kv_heads * group, head_dim)), dtype)
    k = random_cache(rng, batch, 2, (num_kv_heads, head_dim), dtype)
    v = random_cache(rng, batch, 2, (num_kv_heads, head_dim), dtype)
    return q, k, v, jnp.int32(int(rng.integers(2)))


def f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


# --- ragged paged attention (the engine's kernel) ---

def worst_case_lens(rng, num_runs, tile):
    """Run lengths of 0 or k*tile + 1 (each wastes the most of its last tile) or random."""
    kind = rng.integers(3, size=num_runs)
    return np.where(kind == 0, 0, np.where(kind == 1, tile * rng.integers(0, 4, num_runs) + 1,
                                           rng.integers(1, 3 * tile + 2, num_runs)))


def test_plan_tiles_covers_every_token_once(rng):
    """Within the static tile bound, every flat token (padding included) lands in exactly
    one tile, with its request's position; padding tiles see no keys."""
    for _ in range(12):
        tile = int(rng.choice([1, 2, 4, 8]))
        num_seqs = int(rng.integers(1, 7))
        lens = worst_case_lens(rng, num_seqs + 1, tile)  # last one: the padded tail
        q_lens, pad = lens[:-1], int(lens[-1])
        seq_lens = np.where(q_lens > 0, q_lens + rng.integers(0, 20, num_seqs), 0)
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        num_tokens = max(1, int(qsl[-1]) + pad)
        req, tok0, n, pos0, kv_end = np.asarray(
            jax.jit(plan_tiles, static_argnums=(2, 3))(qsl, seq_lens, num_tokens, tile))
        owner = np.full(num_tokens, -1)
        for t in np.flatnonzero(n):
            toks = tok0[t] + np.arange(n[t])
            assert (owner[toks] == -1).all()
            owner[toks] = t
            if toks[0] < qsl[-1]:  # a real request's tokens
                r = req[t]
                assert qsl[r] <= toks[0] and toks[-1] < qsl[r + 1]
                assert pos0[t] == seq_lens[r] - q_lens[r] + toks[0] - qsl[r]
                assert kv_end[t] == pos0[t] + n[t]
            else:
                assert kv_end[t] == 0
        assert (owner >= 0).all(), "a token is in no tile: the static tile bound is too small"


@pytest.mark.parametrize("kind,group,decode_only,dtype,knobs", [
    ("mixed", 1, False, jnp.float32, dict(num_splits=1, pages_per_step=1)),
    ("mixed", 2, False, jnp.float32, dict(num_splits=3, pages_per_step=2)),  # split decode tiles
    ("prefill", 4, False, jnp.float32, dict(pages_per_step=4)),  # steps past the table's end
    ("mixed", 8, False, jnp.float32, dict(num_splits=2, tile_rows=32)),
    ("decode", 2, False, jnp.float32, dict(num_splits=1)),   # decodes through the tiled path
    ("decode", 3, True, jnp.float32, dict(pages_per_step=2)),  # decode kernel; group padded to 4
    ("mixed", 4, False, jnp.bfloat16, {}),
    ("decode", 8, True, jnp.bfloat16, {}),
])
def test_ragged(rng, kind, group, decode_only, dtype, knobs):
    batch = make_batch(rng, kind, block_size=BS, max_blocks=5, max_q=40, num_padded=2)
    q, k, v, layer = gqa_inputs(rng, batch, num_kv_heads=2, group=group, dtype=dtype)
    args = (layer, *batch.args())
    out = ragged_paged_attention(q, k, v, *args, sm_scale=0.25, decode_only=decode_only,
                                 interpret=INTERPRET, **knobs)
    ref = jax.jit(functools.partial(xla.ragged_paged_attention, sm_scale=0.25,
                                    decode_only=decode_only))(*f32(q, k, v), *args)
    assert out.dtype == q.dtype
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("decode_only", [False, True])
def test_ragged_lowers_for_cuda(rng, decode_only):
    batch = make_batch(rng, "decode" if decode_only else "mixed", block_size=BS)
    q, k, v, layer = gqa_inputs(rng, batch, num_kv_heads=2, group=4, head_dim=64,
                                dtype=jnp.bfloat16)
    lowers_for_cuda(functools.partial(ragged_paged_attention, sm_scale=0.125,
                                      decode_only=decode_only), q, k, v, layer, *batch.args())


def test_ragged_rejects_unsupported_shapes(rng):
    batch = make_batch(rng, "decode", block_size=8)
    q, k, v, layer = gqa_inputs(rng, batch, num_kv_heads=1, group=1)
    with pytest.raises(ValueError, match="block_size"):
        ragged_paged_attention(q, k, v, layer, *batch.args(), sm_scale=1.0, interpret=INTERPRET)


# --- paged decode attention (split-K) ---

@pytest.mark.parametrize("num_splits,pages_per_step,table_blocks", [
    (1, 1, 8), (3, 2, 8), (None, None, 8),
    (4, 1, 40),  # contexts of up to 8 blocks in tables 40 wide: each split takes a share of the context
])
def test_paged_decode(rng, num_splits, pages_per_step, table_blocks):
    batch = make_batch(rng, "decode", block_size=BS, max_blocks=8, num_padded=2, table_blocks=table_blocks)
    q, k, v, layer = gqa_inputs(rng, batch, num_kv_heads=2, group=4)
    qsl, seq_lens, tables, _ = batch.args()
    rows = q[qsl[:-1]]  # padded requests read a padded token: their output must be 0
    out = paged_attention(rows, k, v, layer, seq_lens, tables, sm_scale=0.25,
                          num_splits=num_splits, pages_per_step=pages_per_step,
                          interpret=INTERPRET)
    n = seq_lens.shape[0]
    ref = xla.ragged_paged_attention(rows, k, v, layer, jnp.arange(n + 1), seq_lens, tables,
                                     jnp.int32(n), sm_scale=0.25, decode_only=True)
    assert_matches(out, ref, jnp.float32)
    lowers_for_cuda(functools.partial(paged_attention, sm_scale=0.25, num_splits=num_splits),
                    rows, k, v, layer, seq_lens, tables)


def test_split_ranges_cover_each_context_evenly():
    """A tile's steps are cut into `num_splits` consecutive disjoint ranges that cover them exactly,
    each as long as an even share (at least MIN_SPLIT_STEPS): set by the tile's own context, not by
    the table width."""
    for num_splits in range(1, 9):
        for steps in range(0, 41):
            ranges = [tuple(int(x) for x in split_range(jnp.int32(steps), jnp.int32(split), num_splits))
                      for split in range(num_splits)]
            covered = [j for lo, hi in ranges for j in range(lo, hi)]
            assert covered == list(range(steps)), (steps, num_splits, ranges)
            share = max(-(-steps // num_splits), MIN_SPLIT_STEPS)
            assert all(hi - lo <= share for lo, hi in ranges), (steps, num_splits, ranges)
            assert sum(hi > lo for lo, hi in ranges) == min(num_splits, -(-steps // share)), ranges


# --- MLA ---

def mla_inputs(rng, batch, *, heads, rank=32, rope=16, dtype=jnp.float32):
    ql = jnp.asarray(rng.standard_normal((batch.num_tokens, heads, rank)), dtype)
    qr = jnp.asarray(rng.standard_normal((batch.num_tokens, heads, rope)), dtype)
    return ql, qr, random_cache(rng, batch, 2, (rank + rope,), dtype), jnp.int32(1)


@pytest.mark.parametrize("kind,heads,decode_only,dtype,knobs", [
    ("mixed", 4, False, jnp.float32, dict(num_splits=2)),  # split decode tiles
    ("prefill", 20, False, jnp.float32, {}),  # two head blocks, the second partial
    ("decode", 4, True, jnp.float32, dict(num_splits=3, pages_per_step=1)),  # split-K
    ("mixed", 8, False, jnp.bfloat16, {}),
])
def test_mla(rng, kind, heads, decode_only, dtype, knobs):
    batch = make_batch(rng, kind, block_size=BS, max_blocks=6, max_q=40)
    ql, qr, lat, layer = mla_inputs(rng, batch, heads=heads, dtype=dtype)
    args = (layer, *batch.args())
    out = mla_ragged_paged_attention(ql, qr, lat, *args, sm_scale=0.2, decode_only=decode_only,
                                     interpret=INTERPRET, **knobs)
    ref = jax.jit(functools.partial(xla.mla_ragged_paged_attention, sm_scale=0.2,
                                    decode_only=decode_only))(*f32(ql, qr, lat), *args)
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("decode_only", [False, True])
def test_mla_lowers_for_cuda(rng, decode_only):
    batch = make_batch(rng, "decode" if decode_only else "mixed", block_size=BS)
    ql, qr, lat, layer = mla_inputs(rng, batch, heads=16, rank=512, rope=64, dtype=jnp.bfloat16)
    lowers_for_cuda(functools.partial(mla_ragged_paged_attention, sm_scale=0.1,
                                      decode_only=decode_only), ql, qr, lat, layer, *batch.args())


# --- flash attention (dense causal prefill) ---

def dense_attention(q, k, v, *, causal, q_offset):
    """Reference: materialised scores, float32, K/V repeated per group."""
    q, k, v = f32(q, k, v)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
    if causal:
        q_pos = q_offset + jnp.arange(q.shape[1])
        s = jnp.where(jnp.arange(k.shape[1])[None, :] <= q_pos[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision="highest")


@pytest.mark.parametrize("q_len,kv_len,heads,kv_heads,head_dim,causal,dtype,blocks", [
    (40, 40, 4, 4, 64, True, jnp.float32, (16, 16)),     # MHA, partial last tiles
    (20, 75, 8, 1, 64, True, jnp.float32, (16, 16)),     # MQA, chunked prefill (q offset 55)
    (33, 33, 4, 2, 48, True, jnp.float32, (16, 32)),     # head dim padded to 64
    (24, 40, 2, 2, 16, False, jnp.float32, (16, 16)),    # non-causal
    (48, 48, 8, 2, 128, True, jnp.bfloat16, (16, 16)),
    (150, 290, 2, 1, 64, True, jnp.bfloat16, (None, None)),  # the default 128 x 64 tiles
    (10, 12, 2, 1, 32, True, jnp.float32, (None, None)),  # sequences shorter than one tile
])
def test_flash(rng, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, blocks):
    q = jnp.asarray(rng.standard_normal((2, q_len, heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((2, kv_len, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((2, kv_len, kv_heads, head_dim)), dtype)
    out = flash_attention(q, k, v, causal=causal, block_q=blocks[0], block_k=blocks[1],
                          interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches(out, dense_attention(q, k, v, causal=causal, q_offset=kv_len - q_len), dtype)


def varlen_reference(q, k, v, lens):
    """Reference for a fresh prefill: each request (`lens` tokens, concatenated, then padding)
    attends causally within itself (`dense_attention` per request); padded tokens, each its own
    sequence, attend to themselves only (their output is their own v)."""
    out, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        out.append(dense_attention(q[None, sl], k[None, sl], v[None, sl], causal=True, q_offset=0)[0])
        start += n
    group = q.shape[1] // k.shape[1]
    out.append(jnp.repeat(f32(v[start:])[0], group, axis=1))
    return jnp.concatenate(out)


@pytest.mark.parametrize("lens,num_tokens,heads,kv_heads,head_dim,dtype,blocks", [
    ((5, 40, 1, 70, 17), 160, 4, 2, 32, jnp.float32, (16, 16)),  # requests across tiles, a padded tail
    ((16, 16, 32), 64, 4, 4, 64, jnp.float32, (16, 16)),         # requests on tile boundaries
    ((3, 200, 9), 256, 8, 1, 64, jnp.bfloat16, (None, None)),    # MQA, the default 128 x 64 tiles
    ((7,), 8, 2, 2, 48, jnp.float32, (16, 16)),                  # one request, head dim padded
])
def test_flash_prefill_varlen(rng, lens, num_tokens, heads, kv_heads, head_dim, dtype, blocks):
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, head_dim)), dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    segments = prefill_segment_starts(qsl, num_tokens)
    out = flash_prefill(q, k, v, segments, sm_scale=head_dim ** -0.5, block_q=blocks[0], block_k=blocks[1],
                        interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches(out, varlen_reference(q, k, v, lens), dtype)


def test_flash_prefill_keeps_one_requests_non_finite_values_to_itself(rng):
    """Requests packed in one row share key tiles: request B's inf/NaN values (an overflowing
    float16 activation) must not reach request A's rows through a masked p = 0 (0 * inf is NaN)."""
    lens, d = (5, 5, 22), 16
    q, k, v = (jnp.asarray(rng.standard_normal((sum(lens), 2, d)), jnp.float32) for _ in range(3))
    v = v.at[7].set(jnp.nan).at[12].set(jnp.inf)  # in B's rows (5..9) and C's (10..31)
    segments = prefill_segment_starts(jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32), sum(lens))
    out = flash_prefill(q, k, v, segments, sm_scale=d ** -0.5, block_q=16, block_k=16, interpret=INTERPRET)
    assert_matches(out[:5], varlen_reference(q[:5], k[:5], v[:5], [5]), jnp.float32)


def test_kernels_refuse_inputs_they_would_compute_wrong(rng):
    """Shapes that the kernels would read wrongly or out of bounds, and tuning knobs that only a
    GPU compilation would refuse, are refused on any host."""
    batch = make_batch(rng, "mixed", block_size=BS)
    q, k, v, layer = gqa_inputs(rng, batch, num_kv_heads=2, group=2)
    for bad_v in (v[..., :1, :], jnp.concatenate([v, v], axis=-1)):  # other KV heads; another head dim
        with pytest.raises(ValueError, match="K and V caches must both be"):
            ragged_paged_attention(q, k, bad_v, layer, *batch.args(), sm_scale=1.0, interpret=INTERPRET)
    for knobs, name in ((dict(tile_rows=48), "tile_rows"), (dict(pages_per_step=3), "pages_per_step")):
        with pytest.raises(ValueError, match=name):
            ragged_paged_attention(q, k, v, layer, *batch.args(), sm_scale=1.0, interpret=INTERPRET, **knobs)
    ql, qr, lat, layer = mla_inputs(rng, batch, heads=2, rank=16, rope=16)
    for bad in ((ql, qr, jnp.concatenate([lat, lat[..., :16]], axis=-1)), (ql, qr[:, :1], lat)):
        with pytest.raises(ValueError, match="latent cache"):
            mla_ragged_paged_attention(*bad, layer, *batch.args(), sm_scale=1.0, interpret=INTERPRET)
    x = jnp.zeros((2, 16, 2, 16), jnp.float32)
    for args, kwargs, message in (
        ((x, x[:1], x[:1]), {}, "k and v must both be"),  # another batch
        ((x, x, x[:, :, :1]), {}, "k and v must both be"),  # V with other KV heads than K
        ((x, x[:, :8], x[:, :8]), {}, "Tq 16 > Tk 8"),  # rows before position 0
        ((x, x, x), dict(block_q=24), "block_q"),
    ):
        with pytest.raises(ValueError, match=message):
            flash_attention(*args, interpret=INTERPRET, **kwargs)


def test_flash_prefill_keeps_bfloat16_scores_in_float32(rng):
    """Large logits (q and k of std 3: scores of std 9): the softmax scale is applied to the float32
    scores; folded into a bfloat16 q, it rounded each query again and the error was 4x."""
    n, d = 128, 128
    q, k = (jnp.asarray(rng.standard_normal((n, h, d)) * 3, jnp.bfloat16) for h in (2, 1))
    v = jnp.asarray(rng.standard_normal((n, 1, d)), jnp.bfloat16)
    segments = prefill_segment_starts(jnp.asarray([0, n], jnp.int32), n)
    out = flash_prefill(q, k, v, segments, sm_scale=d ** -0.5, interpret=INTERPRET)
    error = np.abs(np.asarray(out.astype(jnp.float32)) - np.asarray(varlen_reference(q, k, v, [n])))
    assert error.max() < 0.025 and error.mean() < 0.0015, (error.max(), error.mean())


def test_flash_prefill_lowers_for_cuda():
    q, k = jnp.zeros((512, 9, 64), jnp.bfloat16), jnp.zeros((512, 3, 64), jnp.bfloat16)
    segments = prefill_segment_starts(jnp.asarray([0, 100, 300, 450], jnp.int32), 512)
    lowers_for_cuda(functools.partial(flash_prefill, sm_scale=0.125), q, k, k, segments)


@pytest.mark.parametrize("head_dim,dtype", [(64, jnp.float32), (128, jnp.bfloat16)])
def test_flash_lowers_for_cuda(head_dim, dtype):
    q = jnp.zeros((1, 256, 8, head_dim), dtype)
    k = jnp.zeros((1, 512, 2, head_dim), dtype)
    lowers_for_cuda(flash_attention, q, k, k)


# --- backend selection ---

def test_backend_names(monkeypatch):
    from llmjax.attention import backend
    assert get_attention_backend(None).name == backend.default_backend_name()
    assert get_attention_backend("xla").ragged_paged_attention is xla.ragged_paged_attention
    # xla stays the default on a GPU until gpu_check has passed on that JAX version
    # the CPU default: the native decode kernel when it builds, else the pure-JAX path
    from llmjax.attention import native
    cpu_default = "cpu" if native.available() else "xla"
    assert backend.default_backend_name("gpu", "0.11.2") == "xla"
    assert backend.default_backend_name("cpu", "0.11.2") == cpu_default
    monkeypatch.setattr(backend, "PALLAS_VERIFIED_JAX", ("0.11.2",))
    assert backend.default_backend_name("gpu", "0.11.2") == "pallas"
    assert backend.default_backend_name("cpu", "0.11.2") == cpu_default
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("cudnn")
    if not on_gpu():
        with pytest.raises(ValueError, match="needs a GPU"):
            get_attention_backend("pallas")


def test_pallas_backend_in_scan_with_a_step_plan(rng):
    """The model's use: inside jit, inside lax.scan over layers with a traced layer, the
    tile plan computed once outside the scan (`backend.plan`)."""
    import dataclasses
    from types import SimpleNamespace

    from llmjax.config import PRESETS
    batch = make_batch(rng, "mixed", block_size=BS, max_blocks=3)
    q, k, v, _ = gqa_inputs(rng, batch, num_kv_heads=1, group=2)
    args = batch.args()
    step = SimpleNamespace(token_ids=q[:, 0, 0], query_start_loc=args[0], seq_lens=args[1])
    model_config = dataclasses.replace(PRESETS["tiny-gqa"], num_heads=2, num_kv_heads=1)

    def all_layers(backend):
        def run():
            plan = backend.plan(step, model_config, False) if backend.plan else None
            kw = {} if plan is None else {"plan": plan}

            def body(_, layer):
                return None, backend.ragged_paged_attention(q, k, v, layer, *args, sm_scale=0.25,
                                                            **kw)
            return jax.lax.scan(body, None, jnp.arange(2, dtype=jnp.int32))[1]
        return jax.jit(run)()

    out = all_layers(get_attention_backend("pallas-interpret" if INTERPRET else "pallas"))
    assert_matches(out, all_layers(get_attention_backend("xla")), jnp.float32)


def test_ragged_rejects_a_plan_of_another_tiling(rng):
    from pallas_kernels.ragged_paged_attention import plan_step
    batch = make_batch(rng, "mixed", block_size=BS, max_blocks=3)
    q, k, v, layer = gqa_inputs(rng, batch, num_kv_heads=1, group=2)
    qsl, seq_lens, tables, nd = batch.args()
    plan = plan_step(qsl, seq_lens, q.shape[0], 2, 1, decode_only=False, tile_rows=16)
    with pytest.raises(ValueError, match="plan of shape"):
        ragged_paged_attention(q, k, v, layer, qsl, seq_lens, tables, nd, sm_scale=0.25, plan=plan,
                               interpret=INTERPRET)
