"""llmjax.attention.xla against a naive per-request NumPy reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.attention_cases import assert_close, make_batch, naive_gqa, naive_mla, random_cache
from llmjax.attention import xla
from llmjax.attention.cache_dtype import storage_dtype, to_storage

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(params=["default_tiles", "small_tiles"])
def tiles(request, monkeypatch):
    """Also run with tiny query tiles, row groups and key chunks: many tiles per request,
    many groups (the last one partial), groups stopping after different chunk counts."""
    if request.param == "small_tiles":
        monkeypatch.setattr(xla, "Q_TILE", 4)
        monkeypatch.setattr(xla, "TILE_GROUP", 3)
        monkeypatch.setattr(xla, "KV_CHUNK", 16)
        monkeypatch.setattr(xla, "DECODE_GROUP", 2)
        monkeypatch.setattr(xla, "DECODE_KV_CHUNK", 16)


def run_gqa(rng, batch, *, num_kv_heads, group, head_dim=16, dtype=jnp.float32,
            decode_only=False, layers=2):
    heads = num_kv_heads * group
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, heads, head_dim)), dtype)
    k = random_cache(rng, batch, layers, (num_kv_heads, head_dim), dtype)
    v = random_cache(rng, batch, layers, (num_kv_heads, head_dim), dtype)
    layer = int(rng.integers(layers))
    scale = head_dim ** -0.5
    f = jax.jit(functools.partial(xla.ragged_paged_attention, sm_scale=scale,
                                  decode_only=decode_only))
    out = f(q, k, v, jnp.int32(layer), *batch.args())
    assert out.shape == q.shape and out.dtype == q.dtype
    return out, naive_gqa(q, k, v, layer, batch, scale)


@pytest.mark.usefixtures("tiles")
@pytest.mark.parametrize("kind,group", [("decode", 8), ("prefill", 1), ("prefill", 4),
                                        ("mixed", 1), ("mixed", 2), ("mixed", 8)])
def test_gqa_f32(rng, kind, group):
    batch = make_batch(rng, kind, max_q=40)
    out, ref = run_gqa(rng, batch, num_kv_heads=2, group=group)
    assert_close(out, ref, batch, **TOL[jnp.float32])


@pytest.mark.usefixtures("tiles")
@pytest.mark.parametrize("group", [1, 3])
def test_gqa_decode_only(rng, group):
    batch = make_batch(rng, "decode", num_padded=2)
    out, ref = run_gqa(rng, batch, num_kv_heads=3, group=group, decode_only=True)
    assert_close(out, ref, batch, **TOL[jnp.float32])


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_gqa_bf16(rng, kind):
    batch = make_batch(rng, kind)
    out, ref = run_gqa(rng, batch, num_kv_heads=2, group=4, dtype=jnp.bfloat16)
    assert_close(out, ref, batch, **TOL[jnp.bfloat16])


@pytest.mark.parametrize("decode_only", [False, True])
def test_bf16_cache_stored_as_uint16_bits(rng, decode_only):
    """A bfloat16 cache held as its uint16 bit pattern (the CPU storage) reads the same values."""
    batch = make_batch(rng, "decode" if decode_only else "mixed")
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 6, 16)), jnp.bfloat16)
    k = random_cache(rng, batch, 2, (2, 16), jnp.bfloat16)
    v = random_cache(rng, batch, 2, (2, 16), jnp.bfloat16)
    stored = [to_storage(x, storage_dtype(jnp.bfloat16, "cpu")) for x in (k, v)]
    assert stored[0].dtype == jnp.uint16
    f = jax.jit(functools.partial(xla.ragged_paged_attention, sm_scale=0.25, decode_only=decode_only))
    out = f(q, *stored, jnp.int32(1), *batch.args())
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(f(q, k, v, jnp.int32(1), *batch.args()), np.float32))
    assert_close(out, naive_gqa(q, k, v, 1, batch, 0.25), batch, **TOL[jnp.bfloat16])


def test_uint16_cache_is_never_widened_whole():
    """XLA:CPU widens a bfloat16 operand of a gather inside a loop to float32 as a whole (the whole
    cache, every step); the uint16 storage must compile to block gathers only."""
    layers, blocks = 3, 64
    cache = jnp.zeros((layers, blocks, 8, 2, 16), jnp.uint16)
    q = jnp.zeros((8, 4, 16), jnp.bfloat16)
    args = (jnp.array([0, 1, 8]), jnp.array([5, 9]), jnp.ones((2, 4), jnp.int32), jnp.int32(1))

    def all_layers(q, k, v):
        def body(_, layer):
            return None, xla.ragged_paged_attention(q, k, v, layer, *args, sm_scale=0.25)
        return jax.lax.scan(body, None, jnp.arange(layers, dtype=jnp.int32))[1]

    hlo = jax.jit(all_layers).lower(q, cache, cache).compile().as_text()
    whole = f"[{layers},{blocks},8,2,16]"
    widened = [line for line in hlo.splitlines() if "convert(" in line and f"f32{whole}" in line]
    assert not widened, widened


def test_prefill_tiles_cover_every_prefill_token_once(rng):
    """Requests of k*q_tile + 1 tokens waste the most: the static tile bound must hold."""
    for _ in range(12):
        q_tile = int(rng.choice([1, 2, 4, 8]))
        num_seqs = int(rng.integers(1, 7))
        q_lens = np.where(rng.integers(2, size=num_seqs) == 0, 0,
                          q_tile * rng.integers(0, 4, num_seqs) + 1)
        seq_lens = q_lens + rng.integers(0, 9, num_seqs) * (q_lens > 0)
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        num_tokens = max(1, int(qsl[-1]))
        _, tok, pos = jax.jit(xla._prefill_tiles, static_argnums=(3, 4))(
            qsl[:-1], q_lens, seq_lens, num_tokens, q_tile)
        tok, pos = np.asarray(tok).ravel(), np.asarray(pos).ravel()
        real = tok < num_tokens
        assert sorted(tok[real]) == list(range(int(qsl[-1])))
        req = np.searchsorted(qsl, tok[real], side="right") - 1
        np.testing.assert_array_equal(pos[real], seq_lens[req] - qsl[req + 1] + tok[real])


def test_all_requests_padded(rng):
    """An all-padding step (no real tokens) yields zeros, not NaN."""
    batch = make_batch(rng, "prefill", num_seqs=3, num_padded=3, pad_tokens=8)
    out, _ = run_gqa(rng, batch, num_kv_heads=1, group=2)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_single_full_block_table(rng):
    """One request whose context fills its block table exactly (last key of the last block)."""
    batch = make_batch(rng, "prefill", num_seqs=1, num_padded=0, pad_tokens=0, max_blocks=4)
    batch.seq_lens_list[0] = batch.seq_lens[0] = 4 * batch.block_size
    batch.block_tables[0] = np.arange(1, 5)[::-1]
    batch.num_blocks = 5
    out, ref = run_gqa(rng, batch, num_kv_heads=1, group=1)
    assert_close(out, ref, batch, **TOL[jnp.float32])


def run_mla(rng, batch, *, heads=4, rank=32, rope=8, dtype=jnp.float32, decode_only=False):
    ql = jnp.asarray(rng.standard_normal((batch.num_tokens, heads, rank)), dtype)
    qr = jnp.asarray(rng.standard_normal((batch.num_tokens, heads, rope)), dtype)
    lat = random_cache(rng, batch, 2, (rank + rope,), dtype)
    scale = (rank + rope) ** -0.5
    f = jax.jit(functools.partial(xla.mla_ragged_paged_attention, sm_scale=scale,
                                  decode_only=decode_only))
    out = f(ql, qr, lat, jnp.int32(1), *batch.args())
    assert out.shape == ql.shape and out.dtype == ql.dtype
    return out, naive_mla(ql, qr, lat, 1, batch, scale)


@pytest.mark.usefixtures("tiles")
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_mla_f32(rng, kind):
    batch = make_batch(rng, kind, max_q=40)
    out, ref = run_mla(rng, batch, decode_only=kind == "decode")
    assert_close(out, ref, batch, **TOL[jnp.float32])


def test_mla_bf16(rng):
    batch = make_batch(rng, "mixed")
    out, ref = run_mla(rng, batch, dtype=jnp.bfloat16)
    assert_close(out, ref, batch, **TOL[jnp.bfloat16])


def test_inside_scan_over_layers(rng):
    """The engine calls it from lax.scan over layers with a traced layer index."""
    batch = make_batch(rng, "mixed")
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 4, 16)), jnp.float32)
    k = random_cache(rng, batch, 3, (2, 16), jnp.float32)
    v = random_cache(rng, batch, 3, (2, 16), jnp.float32)

    @jax.jit
    def all_layers(q, k, v, args):
        def body(_, layer):
            return None, xla.ragged_paged_attention(q, k, v, layer, *args, sm_scale=0.25)
        return jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32))[1]

    outs = all_layers(q, k, v, batch.args())
    for layer in range(3):
        assert_close(outs[layer], naive_gqa(q, k, v, layer, batch, 0.25), batch,
                     **TOL[jnp.float32])


def _eqns(jaxpr):
    """All equations, recursing into sub-jaxprs (loop bodies, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_cache_read_only_by_gathers():
    """No whole-layer copy: every op that consumes the cache is a gather of blocks."""
    k = jnp.zeros((4, 64, 8, 2, 16))
    jaxpr = jax.make_jaxpr(functools.partial(xla.ragged_paged_attention, sm_scale=1.0))(
        jnp.zeros((8, 4, 16)), k, k, jnp.int32(0), jnp.array([0, 1, 8]),
        jnp.array([5, 9]), jnp.ones((2, 4), jnp.int32), jnp.int32(1))
    users = {e.primitive.name for e in _eqns(jaxpr.jaxpr)
             if any(getattr(v, "aval", None) is not None and v.aval.shape == k.shape
                    for v in e.invars) and e.primitive.name not in ("while", "pjit")}
    assert users == {"gather"}
