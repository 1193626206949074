"""Attention over the paged KV cache in Pallas (Triton backend), split-K.

Two layers:

- `paged_tiles_attention`: the shared engine of the paged kernels. Work is a list of
  query *tiles* (`meta`, below): up to `tile_tokens` consecutive flat tokens of one
  request. The grid is `(num_tiles, num_head_blocks, num_splits)`; a program takes one
  tile, one block of `group` query heads and one contiguous range of the request's
  cache blocks, and runs an online softmax (base 2: `exp2`, the scale times log2(e)
  applied to the scores) over them, `pages_per_step` cache blocks (64-128 keys) per step,
  gathered straight from the whole layered cache (`cache[layer, block_ids]`: no slice
  copies) with masked loads: keys past the tile's context are never read.
  Its rows are `tile_tokens x width` (tokens x heads, `width` = `group` rounded up to
  a power of two, at least 16 rows in all for the tensor-core dot).
  Split-K (flash-decoding): programs of split tiles write (acc, max, sum) partials that
  `combine_splits` merges, so a few long requests still fill the GPU. A split tile's own
  context (not the block table's width, which the longest context allowed sets) is cut
  into `num_splits` equal ranges of at least MIN_SPLIT_STEPS steps, so short and long
  requests alike spread their keys over the splits, and a split past a short context
  reads nothing. Either no tile is
  split (`num_splits == 1`), every tile is (`split_tiles=None`: decode), or the first
  `split_tiles` tiles (a traced count: a mixed batch's decodes, one token each, tile t
  being request t) are, while the other tiles run whole in split 0.
- `paged_attention`: decode, one query token per request (each request is a tile).

Tile metadata `meta` [5, N] int32, one column per tile: request index (its block-table
row), first flat token, number of tokens, position of the first token, and `kv_end` =
one past the last key the tile may see (0 for a tile of padding tokens, so it writes
zeros). Every output element belongs to exactly one (tile, head block, split), so the
kernel writes every element by construction: no output needs pre-initialising.

Tuning knobs (static, so one GPU session can sweep them): `pages_per_step`,
`num_splits`, `num_warps`, `num_stages`. The default split count comes from the SM count
and an occupancy estimate (`choose_splits`).

Limits: block size and head dims powers of two >= 16 (the GPU dot's minimum).
Scores, softmax and accumulation are float32; P@V runs in the cache dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.platform import sm_count

NEG = -1e30  # finite initial running max: rows that see no key stay finite (output 0)
LOG2E = math.log2(math.e)
MIN_DOT_ROWS = 16
MIN_SPLIT_STEPS = 2  # a split covers at least this many steps of cache blocks
MAX_KEYS_PER_STEP = 128
KEY_TILE_BYTES = 32 << 10  # default keys per step: K and V tiles of about this size
SMEM_PER_SM = 228 << 10  # H100/H200: shared memory per SM
MAX_WARPS_PER_SM = 64

# block_fn(cache_refs, layer, block_ids [P], head_block, queries, valid [P, bs]) ->
#   (scores [rows, P*bs] f32 without sm_scale, values [P*bs, Dv]); invalid keys read as 0
BlockFn = Callable[..., tuple[jax.Array, jax.Array]]


def _compiler_params(num_warps, num_stages):
    """The Triton backend choice, in one place (its CompilerParams select Triton)."""
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


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


def default_pages_per_step(block_size: int, key_bytes: int) -> int:
    """Cache blocks per step: about KEY_TILE_BYTES of keys (and values), 16..128 keys.
    `key_bytes`: bytes of one cached row."""
    keys = max(block_size, min(MAX_KEYS_PER_STEP, KEY_TILE_BYTES // key_bytes))
    return max(1, 1 << (keys.bit_length() - 1)) // block_size or 1


def choose_splits(num_programs: int, num_steps: int, *, step_bytes: int, num_warps: int,
                  num_stages: int) -> int:
    """Split-K factor: enough programs to fill every SM at the occupancy one program allows
    (shared memory: `num_stages` buffered K+V steps of `step_bytes`; warps), with at least
    MIN_SPLIT_STEPS steps per split."""
    per_sm = max(1, min(SMEM_PER_SM // max(1, num_stages * step_bytes),
                        MAX_WARPS_PER_SM // num_warps, 8))
    want = -(-sm_count() * per_sm // max(1, num_programs))
    return max(1, min(want, num_steps // MIN_SPLIT_STEPS))


def split_range(steps, split, num_splits: int):
    """Steps [lo, hi) of split `split` of a tile with `steps` steps of cache blocks: `num_splits`
    consecutive ranges of equal length, at least MIN_SPLIT_STEPS (so trailing splits of a short
    context are empty, lo >= hi). Works on traced int32 scalars and Python ints."""
    per_split = jnp.maximum((steps + num_splits - 1) // num_splits, MIN_SPLIT_STEPS)
    lo = split * per_split
    return lo, jnp.minimum(lo + per_split, steps)


def paged_tiles_attention(q_parts, caches, layer, meta, block_tables, *, sm_scale,
                          tile_tokens, group, num_head_blocks, block_fn: BlockFn, out_dim,
                          block_size, pages_per_step=1, num_splits=1, split_tiles=None,
                          num_warps=4, num_stages=2, interpret=False):
    """The shared engine (module docstring). q_parts: tuple of [T, H, Dx] queries;
    caches: tuple of [L, num_blocks, bs, ...] arrays; meta [5, N]; block_tables [S, B].
    Head block `hb` covers heads [hb*group, (hb+1)*group) clipped to H.
    `split_tiles`: None (every tile split) or a traced int32 count of leading split tiles
    (each one token; tile t is request t); ignored when num_splits == 1.
    Returns [T, H, out_dim] in q_parts[0]'s dtype."""
    num_tokens, num_heads = q_parts[0].shape[:2]
    num_tiles = meta.shape[1]
    max_pages = block_tables.shape[1]
    width = max(next_pow2(group), -(-MIN_DOT_ROWS // tile_tokens))
    rows = tile_tokens * width
    pages = pages_per_step
    keys = pages * block_size
    dtype = q_parts[0].dtype
    mode = "direct" if num_splits == 1 else ("split" if split_tiles is None else "mixed")
    # partial rows: one per split tile, padded so a tile's [tile_tokens] store stays in bounds
    part_rows = num_tiles if mode == "split" else block_tables.shape[0] + tile_tokens
    scale = sm_scale * LOG2E

    def kernel(meta_ref, scalars_ref, tables_ref, *refs):
        q_refs = refs[:len(q_parts)]
        cache_refs = refs[len(q_parts):len(q_parts) + len(caches)]
        out_refs = refs[len(q_parts) + len(caches):]
        t, hb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        req, tok0, n, pos0, kv_end = (meta_ref[i, t] for i in range(5))
        layer = scalars_ref[0]
        head0 = hb * group
        tok = jnp.arange(tile_tokens, dtype=jnp.int32)
        head = jnp.arange(width, dtype=jnp.int32)
        head_ok = (head < group)[None, :] & (head0 + head < num_heads)[None, :]
        mask = (tok < n)[:, None] & head_ok
        idx = (pl.ds(tok0, tile_tokens), pl.ds(head0, width))
        qs = [pl_triton.load(r.at[idx], mask=mask[:, :, None], other=0).reshape(rows, -1)
              for r in q_refs]
        q_pos = pos0 + jnp.arange(rows, dtype=jnp.int32) // width

        def step(j, carry):
            acc, m, l = carry
            page = j * pages + jnp.arange(pages, dtype=jnp.int32)
            ids = pl_triton.load(tables_ref.at[req, pl.ds(j * pages, pages)],
                                 mask=page < max_pages, other=0)
            kpos = j * keys + jnp.arange(keys, dtype=jnp.int32)
            valid = (kpos < kv_end).reshape(pages, block_size)
            s, v = block_fn(cache_refs, layer, ids, hb, qs, valid)
            s = jnp.where(kpos[None, :] <= q_pos[:, None], s * scale, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
            return acc, m_new, l * alpha + p.sum(axis=1)

        steps = ((kv_end + block_size - 1) // block_size + pages - 1) // pages
        if mode == "direct":
            lo, hi = 0, steps
        else:
            split_lo, split_hi = split_range(steps, split, num_splits)
            if mode == "split":
                lo, hi = split_lo, split_hi
            else:
                is_split = t < scalars_ref[1]
                lo = jnp.where(is_split, split_lo, 0)
                hi = jnp.where(is_split, split_hi, jnp.where(split == 0, steps, 0))
        init = (jnp.zeros((rows, out_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        acc, m, l = lax.fori_loop(lo, jnp.maximum(lo, hi), step, init)

        def store_out():
            out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
            pl_triton.store(out_refs[0].at[idx], out.reshape(tile_tokens, width, out_dim)
                            .astype(dtype), mask=mask[:, :, None])

        def store_partials():
            acc_ref, m_ref, l_ref = out_refs[-3:]
            pmask = (tok == 0)[:, None] & head_ok  # a split tile has one token
            pidx = (split, pl.ds(t, tile_tokens), pl.ds(head0, width))
            pl_triton.store(acc_ref.at[pidx], acc.reshape(tile_tokens, width, out_dim),
                            mask=pmask[:, :, None])
            pl_triton.store(m_ref.at[pidx], m.reshape(tile_tokens, width), mask=pmask)
            pl_triton.store(l_ref.at[pidx], l.reshape(tile_tokens, width), mask=pmask)

        if mode == "direct":
            store_out()
        elif mode == "split":
            store_partials()
        else:
            pl.when(is_split)(store_partials)
            pl.when(jnp.logical_not(is_split) & (split == 0))(store_out)

    part = (num_splits, part_rows, num_heads)
    partials = [jax.ShapeDtypeStruct((*part, out_dim), jnp.float32),
                jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    out = [jax.ShapeDtypeStruct((num_tokens, num_heads, out_dim), dtype)]
    out_shape = {"direct": out, "split": partials, "mixed": out + partials}[mode]
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32),
                         jnp.asarray(0 if split_tiles is None else split_tiles, jnp.int32)])
    n_in = 3 + len(q_parts) + len(caches)
    result = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_head_blocks, num_splits),
        in_specs=[pl.no_block_spec] * n_in,
        out_specs=[pl.no_block_spec] * len(out_shape),
        out_shape=out_shape,
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_tiles_attention",
    )(meta, scalars, block_tables, *q_parts, *caches)
    if mode == "direct":
        return result[0]
    if mode == "split":  # tile t is token t
        return combine_splits(*result).astype(dtype)
    out, partial_parts = result[0], result[1:]
    merged = combine_splits(*partial_parts)[:block_tables.shape[0]].astype(dtype)
    s = jnp.arange(block_tables.shape[0], dtype=jnp.int32)
    rows_of = jnp.where(s < split_tiles, meta[1, jnp.minimum(s, num_tiles - 1)], num_tokens)
    return out.at[rows_of].set(merged, mode="drop")


def combine_splits(acc, m, l):
    """Merge split-K partials (base-2 maxima): acc [P, R, H, D], m/l [P, R, H] -> [R, H, D]
    float32."""
    m_all = m.max(axis=0)
    w = jnp.exp2(m - m_all[None])
    denom = (w * l).sum(axis=0)
    num = (w[..., None] * acc).sum(axis=0)
    return num / jnp.where(denom == 0.0, 1.0, denom)[..., None]


def gqa_block_fn(cache_refs, layer, block_ids, kv_head, qs, valid):
    """Scores and values of `len(block_ids)` cache blocks for one KV head, gathered with
    masked loads (keys outside `valid` read as 0, never touching memory)."""
    k_ref, v_ref = cache_refs
    pages, block_size = valid.shape
    dim = k_ref.shape[-1]
    idx = (layer, block_ids[:, None, None], jnp.arange(block_size)[None, :, None], kv_head,
           jnp.arange(dim)[None, None, :])
    k = pl_triton.load(k_ref.at[idx], mask=valid[:, :, None], other=0)
    v = pl_triton.load(v_ref.at[idx], mask=valid[:, :, None], other=0)
    keys = pages * block_size
    return dot_nt(qs[0], k.reshape(keys, dim)), v.reshape(keys, dim)


def check_gqa_shapes(q, k_cache, v_cache):
    """q: [T, H, D]; both caches [L, num_blocks, bs, Hkv, D], with H a multiple of Hkv."""
    if v_cache.shape != k_cache.shape or k_cache.ndim != 5 or k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"the K and V caches must both be [L, num_blocks, bs, Hkv, {q.shape[-1]}] "
                         f"(the query's head dim), got {k_cache.shape} and {v_cache.shape}")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check_pow2("head_dim", q.shape[-1])
    check_pow2("block_size", k_cache.shape[2])


def default_knobs(cache, key_bytes, max_pages, num_programs, pages_per_step, num_splits,
                  num_warps, num_stages):
    """(pages_per_step, num_splits) with None filled in by the defaults; the split count is
    at most the number of steps. `key_bytes`: bytes of one cached key (and value) row."""
    block_size = cache.shape[2]
    if pages_per_step is not None and (pages_per_step < 1 or pages_per_step != next_pow2(pages_per_step)):
        raise ValueError(f"pages_per_step must be a power of two (a step's keys tile a Triton block), "
                         f"got {pages_per_step}")
    pages = pages_per_step or default_pages_per_step(block_size, key_bytes)
    num_steps = -(-max_pages // pages)
    if num_splits is None:
        num_splits = choose_splits(num_programs, num_steps, step_bytes=pages * block_size * key_bytes,
                                   num_warps=num_warps, num_stages=num_stages)
    return pages, max(1, min(num_splits, num_steps))


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "pages_per_step",
                                             "num_warps", "num_stages", "interpret"))
def paged_attention(q, k_cache, v_cache, layer, seq_lens, block_tables, *, sm_scale,
                    num_splits=None, pages_per_step=None, num_warps=4, num_stages=2,
                    interpret=False):
    """Decode attention: request i's single query q[i] attends to its whole context.

    q: [S, H, D]; k_cache, v_cache: [L, num_blocks, bs, Hkv, D]; layer: int32 scalar;
    seq_lens: [S] (0 for padded requests: zeros out); block_tables: [S, B].
    Grid (S, Hkv, num_splits); None knobs take the defaults (module docstring).
    Returns [S, H, D] in q's dtype.
    """
    check_gqa_shapes(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    num_kv_heads = k_cache.shape[3]
    key_bytes = 2 * k_cache.shape[4] * k_cache.dtype.itemsize  # K and V
    pages, num_splits = default_knobs(k_cache, key_bytes, block_tables.shape[1],
                                      num_seqs * num_kv_heads, pages_per_step, num_splits,
                                      num_warps, num_stages)
    ids = jnp.arange(num_seqs, dtype=jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    meta = jnp.stack([ids, ids, jnp.ones_like(ids), seq_lens - 1, seq_lens])
    return paged_tiles_attention(
        (q,), (k_cache, v_cache), layer, meta, block_tables, sm_scale=sm_scale, tile_tokens=1,
        group=q.shape[1] // num_kv_heads, num_head_blocks=num_kv_heads, block_fn=gqa_block_fn,
        out_dim=q.shape[-1], block_size=k_cache.shape[2], pages_per_step=pages,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
