"""Attention over the paged KV cache in Pallas (Triton backend), split-K.

Two layers:

- `paged_tiles_attention`: the shared engine of the paged kernels. Work is a list of
  query *tiles* (`meta`, below): up to `tile_tokens` consecutive flat tokens of one
  request. The grid is `(num_tiles, num_head_blocks, num_splits)`; a program takes one
  tile, one block of `group` query heads and one contiguous range of the request's
  cache blocks, and runs an online softmax over those cache blocks, one block per step,
  straight from the whole layered cache (`cache[layer, block_id]`: no slice copies).
  Its rows are `tile_tokens x width` (tokens x heads, `width` = `group` rounded up to
  a power of two, at least 16 rows in all for the tensor-core dot). With one split it
  writes normalised outputs; with several it writes (acc, max, sum) partials that
  `_combine_splits` merges (flash-decoding), so a few long requests still fill the GPU.
- `paged_attention`: decode, one query token per request (each request is a tile).

Tile metadata `meta` [5, N] int32, one column per tile: request index (its block-table
row), first flat token, number of tokens, position of the first token, and `kv_end` =
one past the last key the tile may see (0 for a tile of padding tokens, so it writes
zeros). Every output element belongs to exactly one (tile, head block, split), so the
kernel writes every element by construction: no output needs pre-initialising.

Limits: block size and head dims powers of two >= 16 (the GPU dot's minimum).
Scores, softmax and accumulation are float32; P@V runs in the cache dtype.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

NEG = -1e30  # finite initial running max: rows that see no key stay finite (output 0)
MIN_DOT_ROWS = 16
TARGET_PROGRAMS = 512  # split-K aims for about this many programs (several waves of SMs)
MIN_SPLIT_BLOCKS = 4  # a split covers at least this many cache blocks

# block_fn(cache_refs, layer, block_id, head_block, queries) ->
#   (scores [rows, bs] f32 without sm_scale, values [bs, Dv])
BlockFn = Callable[..., tuple[jax.Array, jax.Array]]


def _compiler_params(num_warps):
    """The Triton backend choice, in one place (its CompilerParams select Triton)."""
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=2)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_pow2(name: str, n: int) -> None:
    if n < 16 or n != next_pow2(n):
        raise ValueError(f"Pallas paged attention needs {name} a power of two >= 16, got {n}")


def dot_nt(a, b):
    """a [M, K] @ b [N, K].T -> [M, N] float32 (full f32 precision for f32 inputs)."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, K] @ b [K, N] -> [M, N] float32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def choose_splits(num_programs: int, max_blocks: int) -> int:
    """Split-K factor: enough programs for the GPU, at least MIN_SPLIT_BLOCKS per split."""
    want = -(-TARGET_PROGRAMS // max(1, num_programs))
    return max(1, min(want, max_blocks // MIN_SPLIT_BLOCKS))


def paged_tiles_attention(q_parts, caches, layer, meta, block_tables, *, sm_scale,
                          tile_tokens, group, num_head_blocks, num_splits, block_fn: BlockFn,
                          out_dim, block_size, num_warps=4, interpret=False):
    """The shared engine (module docstring). q_parts: tuple of [T, H, Dx] queries;
    caches: tuple of [L, num_blocks, bs, ...] arrays; meta [5, N]; block_tables [S, B].
    Head block `hb` covers heads [hb*group, (hb+1)*group) clipped to H.
    Returns [T, H, out_dim] in q_parts[0]'s dtype."""
    num_tokens, num_heads = q_parts[0].shape[:2]
    num_tiles = meta.shape[1]
    width = max(next_pow2(group), -(-MIN_DOT_ROWS // tile_tokens))
    rows = tile_tokens * width
    blocks_per_split = -(-block_tables.shape[1] // num_splits)
    dtype = q_parts[0].dtype

    def kernel(meta_ref, layer_ref, tables_ref, *refs):
        q_refs = refs[:len(q_parts)]
        cache_refs = refs[len(q_parts):len(q_parts) + len(caches)]
        out_refs = refs[len(q_parts) + len(caches):]
        t, hb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        req, tok0, n, pos0, kv_end = (meta_ref[i, t] for i in range(5))
        layer = layer_ref[0]
        head0 = hb * group
        tok = jnp.arange(tile_tokens, dtype=jnp.int32)
        head = jnp.arange(width, dtype=jnp.int32)
        mask = (tok < n)[:, None] & (head < group)[None, :] & (head0 + head < num_heads)[None, :]
        idx = (pl.ds(tok0, tile_tokens), pl.ds(head0, width))
        qs = [pl_triton.load(r.at[idx], mask=mask[:, :, None], other=0).reshape(rows, -1)
              for r in q_refs]
        q_pos = pos0 + jnp.arange(rows, dtype=jnp.int32) // width

        def step(j, carry):
            acc, m, l = carry
            s, v = block_fn(cache_refs, layer, tables_ref[req, j], hb, qs)
            kpos = j * block_size + jnp.arange(block_size, dtype=jnp.int32)
            s = jnp.where(kpos[None, :] <= q_pos[:, None], s * sm_scale, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            v = jnp.where((kpos < kv_end)[:, None], v, jnp.zeros_like(v))
            acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
            return acc, m_new, l * alpha + p.sum(axis=1)

        lo = split * blocks_per_split
        hi = jnp.minimum(lo + blocks_per_split, (kv_end + block_size - 1) // block_size)
        init = (jnp.zeros((rows, out_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        acc, m, l = lax.fori_loop(lo, jnp.maximum(lo, hi), step, init)
        if num_splits == 1:
            out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
            pl_triton.store(out_refs[0].at[idx], out.reshape(tile_tokens, width, out_dim)
                            .astype(dtype), mask=mask[:, :, None])
        else:
            acc_ref, m_ref, l_ref = out_refs
            pidx = (split, *idx)
            pl_triton.store(acc_ref.at[pidx], acc.reshape(tile_tokens, width, out_dim),
                            mask=mask[:, :, None])
            pl_triton.store(m_ref.at[pidx], m.reshape(tile_tokens, width), mask=mask)
            pl_triton.store(l_ref.at[pidx], l.reshape(tile_tokens, width), mask=mask)

    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_tokens, num_heads, out_dim), dtype)
    else:
        part = (num_splits, num_tokens, num_heads)
        out_shape = (jax.ShapeDtypeStruct((*part, out_dim), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32))
    n_in = 3 + len(q_parts) + len(caches)
    result = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_head_blocks, num_splits),
        in_specs=[pl.no_block_spec] * n_in,
        out_specs=pl.no_block_spec if num_splits == 1 else [pl.no_block_spec] * 3,
        out_shape=out_shape,
        compiler_params=_compiler_params(num_warps),
        interpret=interpret,
        name="paged_tiles_attention",
    )(meta, jnp.reshape(layer, (1,)).astype(jnp.int32), block_tables, *q_parts, *caches)
    return result if num_splits == 1 else _combine_splits(*result).astype(dtype)


def _combine_splits(acc, m, l):
    """Merge split-K partials: acc [P, T, H, D], m/l [P, T, H] -> [T, H, D] float32."""
    m_all = m.max(axis=0)
    w = jnp.exp(m - m_all[None])
    denom = (w * l).sum(axis=0)
    num = (w[..., None] * acc).sum(axis=0)
    return num / jnp.where(denom == 0.0, 1.0, denom)[..., None]


def gqa_block_fn(cache_refs, layer, block_id, kv_head, qs):
    """Scores and values of one cache block for one KV head: q [rows, D] . K [bs, D]."""
    k_ref, v_ref = cache_refs
    return dot_nt(qs[0], k_ref[layer, block_id, :, kv_head, :]), \
        v_ref[layer, block_id, :, kv_head, :]


def check_gqa_shapes(q, k_cache):
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check_pow2("head_dim", q.shape[-1])
    check_pow2("block_size", k_cache.shape[2])


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "interpret"))
def paged_attention(q, k_cache, v_cache, layer, seq_lens, block_tables, *, sm_scale,
                    num_splits=None, interpret=False):
    """Decode attention: request i's single query q[i] attends to its whole context.

    q: [S, H, D]; k_cache, v_cache: [L, num_blocks, bs, Hkv, D]; layer: int32 scalar;
    seq_lens: [S] (0 for padded requests: zeros out); block_tables: [S, B].
    Grid (S, Hkv, num_splits); num_splits=None picks one from the batch shape.
    Returns [S, H, D] in q's dtype.
    """
    check_gqa_shapes(q, k_cache)
    num_seqs = q.shape[0]
    num_kv_heads = k_cache.shape[3]
    if num_splits is None:
        num_splits = choose_splits(num_seqs * num_kv_heads, block_tables.shape[1])
    ids = jnp.arange(num_seqs, dtype=jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    meta = jnp.stack([ids, ids, jnp.ones_like(ids), seq_lens - 1, seq_lens])
    return paged_tiles_attention(
        (q,), (k_cache, v_cache), layer, meta, block_tables, sm_scale=sm_scale, tile_tokens=1,
        group=q.shape[1] // num_kv_heads, num_head_blocks=num_kv_heads, num_splits=num_splits,
        block_fn=gqa_block_fn, out_dim=q.shape[-1], block_size=k_cache.shape[2],
        interpret=interpret)
