"""MLA (absorbed weights) over the paged latent cache, in Pallas (Triton backend).

Same contract as `llmjax.attention.xla.mla_ragged_paged_attention`, plus `interpret`.
All heads share one latent "KV head": the latent block `[bs, R + Dr]` is loaded once per
step (`MLA_PAGES_PER_STEP` cache blocks, masked loads) and serves as the key (`c` and
`k_rope`) and as the value (`c`). Runs on `paged_attention.paged_tiles_attention` with head
blocks of up to 16 heads:
- `decode_only`: one token per tile, grid (T, ceil(H/16), splits), split-K;
- mixed: tiles of `MLA_TILE_ROWS // heads_per_block` tokens, grid (tiles, ceil(H/16),
  splits), the decodes' tiles split-K.
Each tile reads its request's whole latent context, so long absorbed prefills cost
`ceil(q_len / tile_tokens)` context reads per head block: prefer the expanded (non-absorbed)
form for long prompts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.paged_attention import (check_pow2, default_knobs, dot_nt, next_pow2,
                                            paged_tiles_attention)
from pallas_kernels.ragged_paged_attention import checked_plan, plan_tiles

MLA_TILE_ROWS = 32  # rows per program in mixed batches: accumulator [rows, R] in f32
MAX_HEAD_BLOCK = 16
NUM_WARPS = 8
MLA_PAGES_PER_STEP = 2  # latent rows are wide (R + Dr): 32 keys of 16-token blocks per step


def _tile_tokens(num_heads: int, decode_only: bool) -> int:
    return 1 if decode_only else max(1, MLA_TILE_ROWS // min(next_pow2(num_heads), MAX_HEAD_BLOCK))


def plan_step(query_start_loc, seq_lens, num_tokens: int, num_heads: int, *, decode_only: bool):
    """The step's tile metadata for `mla_ragged_paged_attention(..., plan=...)`, computed once
    per step outside the layer scan."""
    return plan_tiles(query_start_loc, seq_lens, num_tokens, _tile_tokens(num_heads, decode_only))


def _mla_block_fn(rank, rope_dim):
    def block_fn(cache_refs, layer, block_ids, head_block, qs, valid):
        del head_block  # every head block reads the same latent block
        lat_ref, = cache_refs
        pages, block_size = valid.shape
        ids = block_ids[:, None, None]
        pos = jnp.arange(block_size)[None, :, None]
        mask = valid[:, :, None]
        c = pl_triton.load(lat_ref.at[layer, ids, pos, jnp.arange(rank)[None, None, :]],
                           mask=mask, other=0).reshape(pages * block_size, rank)
        k_rope = pl_triton.load(
            lat_ref.at[layer, ids, pos, rank + jnp.arange(rope_dim)[None, None, :]],
            mask=mask, other=0).reshape(pages * block_size, rope_dim)
        return dot_nt(qs[0], c) + dot_nt(qs[1], k_rope), c
    return block_fn


@functools.partial(jax.jit, static_argnames=("sm_scale", "decode_only", "pages_per_step",
                                             "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def mla_ragged_paged_attention(q_latent, q_rope, latent_cache, layer, query_start_loc,
                               seq_lens, block_tables, num_decodes, *, sm_scale,
                               decode_only=False, plan=None, pages_per_step=MLA_PAGES_PER_STEP,
                               num_splits=None, num_warps=NUM_WARPS, num_stages=2,
                               interpret=False):
    """q_latent: [T, H, R]; q_rope: [T, H, Dr]; latent_cache: [L, num_blocks, bs, R + Dr];
    other arguments and knobs as in ragged_paged_attention (decode tiles split-K; `plan`:
    this step's `plan_step(...)`).
    Returns [T, H, R] in q_latent's dtype."""
    num_tokens, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    block_size = latent_cache.shape[2]
    check_pow2("kv_lora_rank", rank)
    check_pow2("qk_rope_head_dim", rope_dim)
    check_pow2("block_size", block_size)
    if q_rope.shape[:2] != q_latent.shape[:2] or latent_cache.ndim != 4 or latent_cache.shape[-1] != rank + rope_dim:
        raise ValueError(f"q_rope must be [T, H, Dr] beside q_latent's [T, H, R] {q_latent.shape}, and the latent "
                         f"cache [L, num_blocks, bs, R + Dr = {rank + rope_dim}]; got q_rope {q_rope.shape}, "
                         f"cache {latent_cache.shape}")

    head_block = min(next_pow2(num_heads), MAX_HEAD_BLOCK)
    num_head_blocks = -(-num_heads // head_block)
    tile_tokens = _tile_tokens(num_heads, decode_only)
    meta = checked_plan(plan, query_start_loc, seq_lens, num_tokens, tile_tokens)
    key_bytes = latent_cache.shape[3] * latent_cache.dtype.itemsize
    num_seqs = seq_lens.shape[0]
    pages, splits = default_knobs(latent_cache, key_bytes, block_tables.shape[1],
                                  num_seqs * num_head_blocks, pages_per_step, num_splits,
                                  num_warps, num_stages)
    split_tiles = None if decode_only else jnp.minimum(jnp.asarray(num_decodes, jnp.int32),
                                                       num_seqs)
    return paged_tiles_attention(
        (q_latent, q_rope), (latent_cache,), layer, meta, block_tables, sm_scale=sm_scale,
        tile_tokens=tile_tokens, group=head_block, num_head_blocks=num_head_blocks,
        block_fn=_mla_block_fn(rank, rope_dim), out_dim=rank, block_size=block_size,
        pages_per_step=pages, num_splits=splits, split_tiles=split_tiles, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret)
