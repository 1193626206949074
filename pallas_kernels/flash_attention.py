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
def flash_attention(q, k, v, *, sm_scale=None, causal=True, q_offset=None, block_q=None,
                    block_k=None, num_warps=None, num_stages=3, interpret=False):
    """q: [batch, Tq, H, D]; k, v: [batch, Tk, Hkv, D] with H % Hkv == 0.

    Query row r sits at position `q_offset + r` and, when `causal`, sees keys at
    positions <= its own. `sm_scale` defaults to D ** -0.5. Knobs (static): `block_q`,
    `block_k`, `num_warps`, `num_stages` (None: `_config`'s). Returns [batch, Tq, H, D].
    """
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    q_offset = kv_len - q_len if q_offset is None else q_offset
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
    num_q_tiles = -(-q_len // bq)
    group = num_heads // num_kv_heads
    scale = sm_scale * LOG2E  # folded into q: scores come out in base 2, softmax uses exp2

    def kernel(q_ref, k_ref, v_ref, o_ref):
        i = num_q_tiles - 1 - pl.program_id(0)
        h, b = pl.program_id(1), pl.program_id(2)
        kv_head = h // group
        rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
        q_idx = (b, pl.ds(i * bq, bq), h)
        qt = pl_triton.load(q_ref.at[q_idx], mask=(rows < q_len)[:, None], other=0)
        qt = (qt.astype(jnp.float32) * scale).astype(qt.dtype)
        q_pos = q_offset + rows

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
                s = jnp.where(visible, dot_nt(qt, kt), -jnp.inf)
            else:  # every key visible to every row
                kt, vt = k_ref[kv_idx], v_ref[kv_idx]
                s = dot_nt(qt, kt)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            acc = acc * alpha[:, None] + dot_nn(p.astype(vt.dtype), vt)
            return acc, m_new, l * alpha + p.sum(axis=1)

        # key tiles [0, full) are visible to all rows of this tile; [full, last) need masks
        last_key = jnp.minimum(kv_len, q_offset + (i + 1) * bq) if causal else kv_len
        full = kv_len // bk
        if causal:
            full = jnp.minimum(full, jnp.maximum(q_offset + i * bq + 1, 0) // bk)
        last = (last_key + bk - 1) // bk
        init = (jnp.zeros((bq, padded_dim), jnp.float32), jnp.full((bq,), NEG, jnp.float32),
                jnp.zeros((bq,), jnp.float32))
        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), init)
        acc, _, l = lax.fori_loop(full, jnp.maximum(full, last), functools.partial(step, masked=True),
                                  carry)
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        pl_triton.store(o_ref.at[q_idx], out.astype(o_ref.dtype), mask=(rows < q_len)[:, None])

    out = pl.pallas_call(
        kernel,
        grid=(num_q_tiles, num_heads, batch),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(warps, num_stages),
        interpret=interpret,
        name="flash_attention",
    )(q, k, v)
    return out[:, :q_len, :, :head_dim]
