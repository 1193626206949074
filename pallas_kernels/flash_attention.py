"""Causal prefill flash attention in Pallas (Triton backend): tiles and an online softmax.

Grid `(ceil(Tq / block_q), H, batch)`; a program owns one query tile of one head and
walks the key tiles of its KV head (`h // G`: GQA without repeating K/V) up to the
causal limit of its last row, so no `Tq x Tk` matrix ever exists; only the key tiles on
the diagonal and the tail tile are masked, the others load and score unmasked. Softmax in
base 2: `log2(e) * scale` is folded into q once, and `exp2` replaces `exp`. The query-tile axis is
walked backwards so the longest (last) tiles start first, and neighbouring programs
share a head's K/V in L2. Queries are the last `Tq` positions of a `Tk`-long context
(`q_offset = Tk - Tq` by default: chunked prefill). Head dims that are not a power of
two >= 16 are zero-padded (a copy of q, k, v), and so are sequences shorter than one tile.
Softmax in float32; output in q's dtype.

Variable-length batches (`segment_starts`, FlashAttention's varlen): one flat row of
concatenated sequences, each row attending causally within its own sequence. A query tile
then starts its key walk at the first row's sequence start; key tiles inside every row's
sequence and causal window run unmasked, the ones at either end masked. `flash_prefill` is
the engine's entry: a step whose every request starts at position 0 (a fresh prefill) as
one such row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.paged_attention import LOG2E, NEG, dot_nn, dot_nt, next_pow2


def _config(head_dim):
    """(block_q, block_k, num_warps) per head dim: 128-row query tiles."""
    return (128, 64, 4) if head_dim <= 64 else (128, 64, 8)


def _compiler_params(num_warps, num_stages):
    """The Triton backend choice, in one place (its CompilerParams select Triton)."""
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "q_offset", "block_q",
                                             "block_k", "num_warps", "num_stages", "interpret"))
def flash_attention(q, k, v, segment_starts=None, *, sm_scale=None, causal=True, q_offset=None,
                    block_q=None, block_k=None, num_warps=None, num_stages=3, interpret=False):
    """q: [batch, Tq, H, D]; k, v: [batch, Tk, Hkv, D] with H % Hkv == 0.

    Query row r sits at position `q_offset + r` and, when `causal`, sees keys at
    positions <= its own. `sm_scale` defaults to D ** -0.5. Knobs (static): `block_q`,
    `block_k`, `num_warps`, `num_stages` (None: `_config`'s). Returns [batch, Tq, H, D].

    `segment_starts` ([batch, T] int32, causal, Tq == Tk, q_offset 0): row r belongs to the
    sequence starting at row `segment_starts[b, r]` (<= r; rows of one sequence are
    contiguous and share it) and sees only keys in [segment_starts[b, r], r].
    """
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    if v.shape != k.shape or k.ndim != 4 or (k.shape[0], k.shape[3]) != (batch, head_dim):
        raise ValueError(f"k and v must both be [batch {batch}, Tk, Hkv, D {head_dim}], got {k.shape} and {v.shape}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None and (size < 16 or size != next_pow2(size)):
            raise ValueError(f"{name} must be a power of two >= 16 (a Triton dot's tile), got {size}")
    varlen = segment_starts is not None
    if varlen and (not causal or q_len != kv_len or q_offset not in (None, 0)
                   or segment_starts.shape != (batch, q_len)):
        raise ValueError("segment_starts needs causal attention, Tq == Tk, q_offset 0 and shape [batch, T]")
    q_offset = kv_len - q_len if q_offset is None else q_offset
    if q_offset < 0:
        raise ValueError(f"query rows start at position {q_offset} (Tq {q_len} > Tk {kv_len} needs an explicit "
                         "q_offset >= 0): rows before position 0 would see no key")
    sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    padded_dim = max(16, next_pow2(head_dim))
    if padded_dim != head_dim:
        pad = ((0, 0), (0, 0), (0, 0), (0, padded_dim - head_dim))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    bq, bk, warps = _config(padded_dim)
    bq, bk, warps = block_q or bq, block_k or bk, num_warps or warps
    bq, bk = min(bq, max(16, next_pow2(q_len))), min(bk, max(16, next_pow2(kv_len)))
    if q_len < bq or kv_len < bk:  # a sequence shorter than one tile: pad it to the tile
        q = jnp.pad(q, ((0, 0), (0, max(0, bq - q_len)), (0, 0), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, max(0, bk - kv_len)), (0, 0), (0, 0))) for x in (k, v))
    extra = [jnp.pad(segment_starts.astype(jnp.int32), ((0, 0), (0, q.shape[1] - q_len)))] if varlen else []
    num_q_tiles = -(-q_len // bq)
    group = num_heads // num_kv_heads
    scale = sm_scale * LOG2E  # applied to the float32 scores (base 2: softmax uses exp2); folded into a
    # bfloat16 q instead, it would round every query a second time

    def kernel(q_ref, k_ref, v_ref, *refs):
        seg_ref, o_ref = refs if varlen else (None, refs[0])
        i = num_q_tiles - 1 - pl.program_id(0)
        h, b = pl.program_id(1), pl.program_id(2)
        kv_head = h // group
        rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
        valid = rows < q_len
        q_idx = (b, pl.ds(i * bq, bq), h)
        qt = pl_triton.load(q_ref.at[q_idx], mask=valid[:, None], other=0)
        q_pos = q_offset + rows
        if varlen:  # each row's sequence start; rows past the end count as their own sequence
            seg = jnp.where(valid, pl_triton.load(seg_ref.at[b, pl.ds(i * bq, bq)], mask=valid, other=0), rows)

        def step(j, carry, masked):
            acc, m, l = carry
            kv_idx = (b, pl.ds(j * bk, bk), kv_head)
            if masked:  # the diagonal and the tail: per-key masks
                kpos = j * bk + jnp.arange(bk, dtype=jnp.int32)
                in_range = (kpos < kv_len)[:, None]
                kt = pl_triton.load(k_ref.at[kv_idx], mask=in_range, other=0)
                vt = pl_triton.load(v_ref.at[kv_idx], mask=in_range, other=0)
                visible = kpos[None, :] < kv_len
                if causal:
                    visible &= kpos[None, :] <= q_pos[:, None]
                if varlen:  # the tile may hold another sequence's keys: a non-finite value of
                    # theirs would reach these rows through p = 0 (0 * inf is NaN)
                    visible &= kpos[None, :] >= seg[:, None]
                    vt = jnp.where(jnp.isfinite(vt), vt, 0)
                s = jnp.where(visible, dot_nt(qt, kt) * scale, -jnp.inf)
            else:  # every key visible to every row
                kt, vt = k_ref[kv_idx], v_ref[kv_idx]
                s = dot_nt(qt, kt) * scale
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            acc = acc * alpha[:, None] + dot_nn(p.astype(vt.dtype), vt)
            return acc, m_new, l * alpha + p.sum(axis=1)

        # key tiles [first, lo) and [hi, last) need masks; [lo, hi) are visible to every row of this
        # tile (inside every row's sequence and causal window)
        last_key = jnp.minimum(kv_len, q_offset + (i + 1) * bq) if causal else kv_len
        last = (last_key + bk - 1) // bk
        if varlen:
            first = jnp.min(jnp.where(valid, seg, q_len)) // bk
            lo = jnp.maximum(first, (jnp.max(jnp.where(valid, seg, 0)) + bk - 1) // bk)
            hi = jnp.maximum(lo, (i * bq + 1) // bk)
        else:
            first = lo = 0
            hi = kv_len // bk
            if causal:
                hi = jnp.minimum(hi, jnp.maximum(q_offset + i * bq + 1, 0) // bk)
        init = (jnp.zeros((bq, padded_dim), jnp.float32), jnp.full((bq,), NEG, jnp.float32),
                jnp.zeros((bq,), jnp.float32))
        carry = lax.fori_loop(first, lo, functools.partial(step, masked=True), init) if varlen else init
        carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
        acc, _, l = lax.fori_loop(hi, jnp.maximum(hi, last), functools.partial(step, masked=True), carry)
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        pl_triton.store(o_ref.at[q_idx], out.astype(o_ref.dtype), mask=(rows < q_len)[:, None])

    out = pl.pallas_call(
        kernel,
        grid=(num_q_tiles, num_heads, batch),
        in_specs=[pl.no_block_spec] * (3 + len(extra)),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(warps, num_stages),
        interpret=interpret,
        name="flash_attention",
    )(q, k, v, *extra)
    return out[:, :q_len, :, :head_dim]


def prefill_segment_starts(query_start_loc, num_tokens: int):
    """[T] int32: for each of the flat tokens of a step, the flat index of its request's first
    token; padded tokens (past `query_start_loc[-1]`) are each their own sequence."""
    qsl = query_start_loc.astype(jnp.int32)
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    request = jnp.clip(jnp.searchsorted(qsl, tokens, side="right") - 1, 0, qsl.shape[0] - 1)
    return jnp.where(tokens < qsl[-1], qsl[request], tokens)


def flash_prefill(q, k, v, segment_starts, *, sm_scale, interpret=False, **knobs):
    """A fresh prefill step (every request starts at position 0): q [T, H, D] and its own k, v
    [T, Hkv, D] (flat, requests concatenated), `segment_starts` from `prefill_segment_starts`.
    Returns [T, H, D]; every row is written (padded tokens attend to themselves)."""
    out = flash_attention(q[None], k[None], v[None], segment_starts[None], sm_scale=sm_scale,
                          q_offset=0, interpret=interpret, **knobs)
    return out[0]
