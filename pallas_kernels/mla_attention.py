"""MLA (absorbed weights) over the paged latent cache, in Pallas (Triton backend).

Same contract as `llmjax.attention.xla.mla_ragged_paged_attention`, plus `interpret`.
All heads share one latent "KV head": the latent block `[bs, R + Dr]` is loaded once per
step and serves as the key (`c` and `k_rope`) and as the value (`c`). Runs on
`paged_attention.paged_tiles_attention` with head blocks of up to 16 heads:
- `decode_only`: one token per tile, grid (T, ceil(H/16), splits), split-K;
- mixed: tiles of `MLA_TILE_ROWS // heads_per_block` tokens, grid (tiles, ceil(H/16), 1).
Each tile reads its request's whole latent context, so long absorbed prefills cost
`ceil(q_len / tile_tokens)` context reads per head block: prefer the expanded (non-absorbed)
form for long prompts.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.paged_attention import (check_pow2, choose_splits, dot_nt, next_pow2,
                                            paged_tiles_attention)
from pallas_kernels.ragged_paged_attention import plan_tiles

MLA_TILE_ROWS = 32  # rows per program in mixed batches: accumulator [rows, R] in f32
MAX_HEAD_BLOCK = 16
NUM_WARPS = 8


def _mla_block_fn(rank, rope_dim):
    def block_fn(cache_refs, layer, block_id, head_block, qs):
        del head_block  # every head block reads the same latent block
        lat_ref, = cache_refs
        c = lat_ref[layer, block_id, :, :rank]  # [bs, R]
        k_rope = lat_ref[layer, block_id, :, rank:rank + rope_dim]  # [bs, Dr]
        return dot_nt(qs[0], c) + dot_nt(qs[1], k_rope), c
    return block_fn


@functools.partial(jax.jit, static_argnames=("sm_scale", "decode_only", "interpret"))
def mla_ragged_paged_attention(q_latent, q_rope, latent_cache, layer, query_start_loc,
                               seq_lens, block_tables, num_decodes, *, sm_scale,
                               decode_only=False, interpret=False):
    """q_latent: [T, H, R]; q_rope: [T, H, Dr]; latent_cache: [L, num_blocks, bs, R + Dr];
    other arguments as in ragged_paged_attention. Returns [T, H, R] in q_latent's dtype."""
    del num_decodes
    num_tokens, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    block_size = latent_cache.shape[2]
    check_pow2("kv_lora_rank", rank)
    check_pow2("qk_rope_head_dim", rope_dim)
    check_pow2("block_size", block_size)

    head_block = min(next_pow2(num_heads), MAX_HEAD_BLOCK)
    num_head_blocks = -(-num_heads // head_block)
    tile_tokens = 1 if decode_only else max(1, MLA_TILE_ROWS // head_block)
    meta = plan_tiles(query_start_loc, seq_lens, num_tokens, tile_tokens)
    num_splits = (choose_splits(meta.shape[1] * num_head_blocks, block_tables.shape[1])
                  if decode_only else 1)
    return paged_tiles_attention(
        (q_latent, q_rope), (latent_cache,), layer, meta, block_tables, sm_scale=sm_scale,
        tile_tokens=tile_tokens, group=head_block, num_head_blocks=num_head_blocks,
        num_splits=num_splits, block_fn=_mla_block_fn(rank, rope_dim), out_dim=rank,
        block_size=block_size, num_warps=NUM_WARPS, interpret=interpret)
