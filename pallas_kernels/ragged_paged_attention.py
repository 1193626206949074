"""The engine's attention kernel: a mixed batch of decodes and prefill chunks in one launch.

Same contract as `llmjax.attention.xla.ragged_paged_attention` (docs/architecture.md),
plus `interpret`. Each request's new tokens are cut into query tiles of `tile_tokens`
tokens (`plan_tiles`); the padded tail of the flat token array is one more tile run,
with no context, so every output row is written (zeros). The grid is
`(num_tiles, Hkv, 1)` of `paged_attention.paged_tiles_attention`: a program holds one
tile's tokens times the `G` query heads of one KV head (`tile_tokens * G` rows, GQA
without repeating K/V), and walks the request's cache blocks up to its last query's
position, causal within the tile. With `decode_only` the batch goes to the split-K
decode kernel instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import (check_gqa_shapes, gqa_block_fn, next_pow2,
                                            paged_attention, paged_tiles_attention)

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
    runs = min(num_seqs + 1, num_tokens)
    max_tiles = min(num_tokens, (num_tokens + runs * (tile_tokens - 1)) // tile_tokens)

    tiles = -(-lens // tile_tokens)
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    run = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_seqs)
    first = (t - (tile_end[run] - tiles[run])) * tile_tokens
    n = jnp.clip(lens[run] - first, 0, tile_tokens)
    n = jnp.where(t < tile_end[-1], n, 0)
    pos0 = ends[run] - lens[run] + first
    kv_end = jnp.where((run < num_seqs) & (n > 0), pos0 + n, 0)
    return jnp.stack([jnp.minimum(run, num_seqs - 1), starts[run] + first, n, pos0, kv_end])


@functools.partial(jax.jit, static_argnames=("sm_scale", "decode_only", "interpret"))
def ragged_paged_attention(q, k_cache, v_cache, layer, query_start_loc, seq_lens,
                           block_tables, num_decodes, *, sm_scale, decode_only=False,
                           interpret=False):
    """q: [T, H, D]; k_cache, v_cache: [L, num_blocks, bs, Hkv, D]; layer: int32 scalar;
    query_start_loc: [S+1]; seq_lens: [S]; block_tables: [S, B]; num_decodes: scalar
    (only `decode_only` matters here: a decode is a request with one token).
    Returns [T, H, D] in q's dtype; padded tokens get zeros."""
    del num_decodes
    check_gqa_shapes(q, k_cache)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    num_kv_heads = k_cache.shape[3]
    if decode_only:
        qsl = query_start_loc[:-1]
        real = qsl < query_start_loc[1:]
        rows = jnp.clip(qsl, 0, num_tokens - 1)
        out = paged_attention(q[rows], k_cache, v_cache, layer, jnp.where(real, seq_lens, 0),
                              block_tables, sm_scale=sm_scale, interpret=interpret)
        return jnp.zeros_like(q).at[jnp.where(real, qsl, num_tokens)].set(out, mode="drop")

    group = q.shape[1] // num_kv_heads
    tile_tokens = max(1, TILE_ROWS // next_pow2(group))
    meta = plan_tiles(query_start_loc, seq_lens, num_tokens, tile_tokens)
    return paged_tiles_attention(
        (q,), (k_cache, v_cache), layer, meta, block_tables, sm_scale=sm_scale,
        tile_tokens=tile_tokens, group=group, num_head_blocks=num_kv_heads, num_splits=1,
        block_fn=gqa_block_fn, out_dim=q.shape[-1], block_size=k_cache.shape[2],
        interpret=interpret)
