"""The engine's attention kernel: a mixed batch of decodes and prefill chunks in one launch.

Same contract as `llmjax.attention.xla.ragged_paged_attention` (docs/architecture.md),
plus `interpret`. Each request's new tokens are cut into query tiles of `tile_tokens`
tokens (`plan_tiles`); the padded tail of the flat token array is one more tile run,
with no context, so every output row is written (zeros). The grid is
`(num_tiles, Hkv, num_splits)` of `paged_attention.paged_tiles_attention`: a program holds
one tile's tokens times the `G` query heads of one KV head (`tile_tokens * G` rows, GQA
without repeating K/V), and walks the request's cache blocks up to its last query's
position, causal within the tile. The decodes' tiles (the first `num_decodes` requests,
one token each) are split-K, like the decode kernel's, in the same launch; the other
tiles run whole in split 0. With `decode_only` every token is its own tile and every tile
is split-K (the decode kernel's work, on the flat tokens: no gather or scatter of rows).
`plan_step(...)` computes the tile metadata once per step, outside the layer scan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import (check_gqa_shapes, check_pow2, default_knobs, gqa_block_fn,
                                            next_pow2, paged_tiles_attention)

TILE_ROWS = 64  # rows (tokens x heads of a KV head) per program in mixed batches


def plan_tiles(query_start_loc, seq_lens, num_tokens: int, tile_tokens: int):
    """Tile metadata [5, N] (see paged_attention's docstring) for the flat token array.

    Requests and then the padded tail (a pseudo-request with no context) are cut into
    tiles of `tile_tokens`; N = min(T, (T + min(S+1, T) * (tile_tokens-1)) // tile_tokens)
    bounds the count statically (each tile holds >= 1 token, each run wastes < 1 tile).
    Unused columns have zero tokens.
    """
    num_seqs = seq_lens.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    starts = jnp.append(qsl[:-1], qsl[-1])
    lens = jnp.append(qsl[1:] - qsl[:-1], num_tokens - qsl[-1])  # [S+1]
    ends = jnp.append(seq_lens.astype(jnp.int32), 0)  # context length after this step
    tiles = -(-lens // tile_tokens)
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(max_tiles(num_tokens, num_seqs, tile_tokens), dtype=jnp.int32)
    run = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_seqs)
    first = (t - (tile_end[run] - tiles[run])) * tile_tokens
    n = jnp.clip(lens[run] - first, 0, tile_tokens)
    n = jnp.where(t < tile_end[-1], n, 0)
    pos0 = ends[run] - lens[run] + first
    kv_end = jnp.where((run < num_seqs) & (n > 0), pos0 + n, 0)
    return jnp.stack([jnp.minimum(run, num_seqs - 1), starts[run] + first, n, pos0, kv_end])


def max_tiles(num_tokens: int, num_seqs: int, tile_tokens: int) -> int:
    """The static tile count `plan_tiles` returns (its docstring's bound)."""
    runs = min(num_seqs + 1, num_tokens)
    return min(num_tokens, (num_tokens + runs * (tile_tokens - 1)) // tile_tokens)


def tile_tokens_for(group: int, decode_only: bool, tile_rows: int = TILE_ROWS) -> int:
    """Tokens per tile: one for decodes, else `tile_rows` rows of `group` (padded) heads."""
    return 1 if decode_only else max(1, tile_rows // next_pow2(group))


def plan_step(query_start_loc, seq_lens, num_tokens: int, num_heads: int, num_kv_heads: int, *,
              decode_only: bool, tile_rows: int = TILE_ROWS):
    """The step's tile metadata for `ragged_paged_attention(..., plan=...)` with the same
    `decode_only` and `tile_rows`: computed once per step, outside the layer scan, instead
    of once per layer."""
    tile = tile_tokens_for(num_heads // num_kv_heads, decode_only, tile_rows)
    return plan_tiles(query_start_loc, seq_lens, num_tokens, tile)


def checked_plan(plan_meta, query_start_loc, seq_lens, num_tokens, tile_tokens):
    """`plan_meta` if given (its static tile count checked), else the plan computed here."""
    if plan_meta is None:
        return plan_tiles(query_start_loc, seq_lens, num_tokens, tile_tokens)
    want = (5, max_tiles(num_tokens, seq_lens.shape[0], tile_tokens))
    if plan_meta.shape != want:
        raise ValueError(f"plan of shape {plan_meta.shape} does not fit this call (expected "
                         f"{want}): compute it with the same decode_only and tile_rows")
    return plan_meta


@functools.partial(jax.jit, static_argnames=("sm_scale", "decode_only", "tile_rows",
                                             "pages_per_step", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def ragged_paged_attention(q, k_cache, v_cache, layer, query_start_loc, seq_lens,
                           block_tables, num_decodes, *, sm_scale, decode_only=False, plan=None,
                           tile_rows=TILE_ROWS, pages_per_step=None, num_splits=None,
                           num_warps=4, num_stages=2, interpret=False):
    """q: [T, H, D]; k_cache, v_cache: [L, num_blocks, bs, Hkv, D]; layer: int32 scalar;
    query_start_loc: [S+1]; seq_lens: [S]; block_tables: [S, B]; num_decodes: scalar
    (requests [0, num_decodes) have one token each: their tiles are split-K);
    `plan`: this step's `plan_step(...)` (None: computed here).
    Knobs (static; None: the defaults): `tile_rows` (tokens x heads per program),
    `pages_per_step`, `num_splits` (of the decode tiles), `num_warps`, `num_stages`.
    Returns [T, H, D] in q's dtype; padded tokens get zeros."""
    check_gqa_shapes(q, k_cache, v_cache)
    check_pow2("tile_rows", tile_rows)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    num_kv_heads = k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    tile_tokens = tile_tokens_for(group, decode_only, tile_rows)
    meta = checked_plan(plan, query_start_loc, seq_lens, num_tokens, tile_tokens)
    key_bytes = 2 * k_cache.shape[4] * k_cache.dtype.itemsize
    pages, splits = default_knobs(k_cache, key_bytes, block_tables.shape[1],
                                  num_seqs * num_kv_heads, pages_per_step, num_splits,
                                  num_warps, num_stages)
    # decode_only: one tile per token (tile t is token t), every tile split-K
    split_tiles = None if decode_only else jnp.minimum(jnp.asarray(num_decodes, jnp.int32),
                                                       num_seqs)
    return paged_tiles_attention(
        (q,), (k_cache, v_cache), layer, meta, block_tables, sm_scale=sm_scale,
        tile_tokens=tile_tokens, group=group, num_head_blocks=num_kv_heads,
        block_fn=gqa_block_fn, out_dim=q.shape[-1], block_size=k_cache.shape[2],
        pages_per_step=pages, num_splits=splits, split_tiles=split_tiles,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret)
