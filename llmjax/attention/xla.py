"""Pure-JAX attention over the paged KV cache: the kernels' oracle, and the "cpu" backend's
fallback where its native kernel does not apply (`llmjax.attention.cpu`).

Both functions follow the contract in docs/architecture.md ("Attention over the paged
cache"). Design: every query row carries its request index and its position. Rows are
visited in groups, in a `lax.fori_loop` that stops after the last real row, so padding
rows (padded requests, unused tiles) cost nothing; within a group, keys are visited in
chunks of whole cache blocks with an online softmax, in an inner `lax.fori_loop` whose
trip count is the group's longest context (so short batches do not pay for the static
block-table width, and a long prompt's early tiles stop early: causal work skipping at
group granularity).

- Decode rows: one row per request `i`, the token at `query_start_loc[i]`; used for
  requests `i < num_decodes` (every request when `decode_only`). Groups of
  `DECODE_GROUP` rows, chunks of `DECODE_KV_CHUNK` keys: a group's gathered chunk
  (`DECODE_GROUP * DECODE_KV_CHUNK * Hkv * D` of K and of V) stays in the CPU caches
  between the gather and its use.
- Prefill rows: the new tokens of requests `i >= num_decodes`, cut into query tiles of
  `q_tile = min(Q_TILE, T)` tokens, `TILE_GROUP` tiles per group, chunks of `KV_CHUNK`
  keys. The static tile arrays hold the worst case
  `N = min(T, (T + min(S, T) * (q_tile - 1)) // q_tile)` tiles (each tile holds >= 1
  token and each request wastes < 1 tile); only the real ones are visited. Skipped when
  `decode_only`.

Cost per call, with `K` = a group's longest context rounded up to a chunk:
- decode: reads `K * Hkv * D` of K and of V per real decode row (one gather per chunk),
  `4*H*K*D` FLOPs per row;
- prefill: each tile gathers its request's context up to its group's last position, so
  a request's K/V are read about `ceil(q_len / q_tile)` times; `4 * q_tile * H * K * D`
  FLOPs per tile;
- live memory per chunk step: `group * chunk * Hkv * D` for K and V plus
  `group * H * q_tile * chunk` f32 scores. Nothing is ever copied per token, and the
  cache is indexed as `cache[layer, block_ids]` in one gather (no per-layer copy).

Scores and softmax are float32 whatever the input dtype; the output has q's dtype. The cache
may hold float32 or bfloat16 values, the latter possibly stored as uint16 bits (see
`llmjax.attention.cache_dtype`); gathered rows are widened to float32 after the gather.
Keys past a request's context never contribute, even if the cache holds NaN there.
Padded requests and padded tokens produce zeros.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from llmjax.attention.cache_dtype import to_float32

Q_TILE = 32  # prefill query tokens per tile
TILE_GROUP = 4  # prefill tiles per group (one outer-loop step)
KV_CHUNK = 128  # keys per online-softmax step of the prefill tiles, rounded to whole blocks
DECODE_GROUP = 8  # decode rows per group
DECODE_KV_CHUNK = 256  # keys per online-softmax step of the decode rows
_NEG = -1e30  # finite "minus infinity" for the running max: fully masked rows stay finite
_HI = lax.Precision.HIGHEST

# load(block_ids [N, nb]) -> (key parts, each [N, nb*bs, Hkv, Dk_i]; values [N, nb*bs, Hkv, Dv])
Loader = Callable[[jax.Array], tuple[tuple[jax.Array, ...], jax.Array]]


def ragged_paged_attention(q, k_cache, v_cache, layer, query_start_loc, seq_lens,
                           block_tables, num_decodes, *, sm_scale, decode_only=False):
    """Causal attention of the flat new tokens over the paged GQA cache.

    q: [T, H, D]; k_cache, v_cache: [L, num_blocks, bs, Hkv, D]; layer: int32 scalar;
    query_start_loc: [S+1]; seq_lens: [S]; block_tables: [S, B]; num_decodes: int32
    scalar. H must be a multiple of Hkv. Returns [T, H, D] in q's dtype.
    """

    def load(block_ids):
        n = block_ids.shape[0]
        k = k_cache[layer, block_ids]  # [N, nb, bs, Hkv, D]: one gather, no layer copy
        v = v_cache[layer, block_ids]
        return (k.reshape(n, -1, *k.shape[3:]),), v.reshape(n, -1, *v.shape[3:])

    return _ragged_attention((q,), load, k_cache.shape[3], k_cache.shape[2], q.shape[-1],
                             query_start_loc, seq_lens, block_tables, num_decodes,
                             sm_scale=sm_scale, decode_only=decode_only)


def mla_ragged_paged_attention(q_latent, q_rope, latent_cache, layer, query_start_loc,
                               seq_lens, block_tables, num_decodes, *, sm_scale,
                               decode_only=False):
    """Absorbed MLA over the paged latent cache.

    q_latent: [T, H, R]; q_rope: [T, H, Dr]; latent_cache: [L, num_blocks, bs, R + Dr]
    (c first, then the shared RoPE key). score = q_latent.c + q_rope.k_rope;
    returns softmax @ c: [T, H, R] in q_latent's dtype.
    """
    rank = q_latent.shape[-1]

    def load(block_ids):
        n = block_ids.shape[0]
        lat = latent_cache[layer, block_ids]  # [N, nb, bs, R + Dr]
        lat = lat.reshape(n, -1, 1, lat.shape[-1])  # one shared "kv head"
        c = lat[..., :rank]
        return (c, lat[..., rank:]), c

    return _ragged_attention((q_latent, q_rope), load, 1, latent_cache.shape[2], rank,
                             query_start_loc, seq_lens, block_tables, num_decodes,
                             sm_scale=sm_scale, decode_only=decode_only)


def _ragged_attention(q_parts, load: Loader, num_kv_heads, block_size, out_dim,
                      query_start_loc, seq_lens, block_tables, num_decodes, *,
                      sm_scale, decode_only):
    """Decode rows, then (unless `decode_only`) prefill tiles; scattered into [T, H, Dv]."""
    num_tokens, num_heads = q_parts[0].shape[:2]
    num_seqs = seq_lens.shape[0]
    starts = query_start_loc[:-1]
    q_lens = query_start_loc[1:] - starts
    out = jnp.zeros((num_tokens, num_heads, out_dim), q_parts[0].dtype)

    seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
    is_decode = q_lens > 0
    if not decode_only:
        is_decode &= seq_ids < num_decodes
    tok = jnp.where(is_decode, starts, num_tokens)[:, None]  # [S, 1]; T = dropped
    pos = jnp.where(is_decode, seq_lens - 1, -1)[:, None]
    last = jnp.max(jnp.where(is_decode, seq_ids + 1, 0))  # rows past the last decode: skipped
    out = _attend_rows(out, q_parts, load, num_kv_heads, block_size, seq_ids, tok, pos,
                       seq_lens, block_tables, sm_scale, num_rows=last,
                       group_rows=DECODE_GROUP, kv_chunk=DECODE_KV_CHUNK)
    if decode_only:
        return out

    q_tile = min(Q_TILE, num_tokens)
    prefill_lens = jnp.where(is_decode, 0, q_lens)
    req, tok, pos = _prefill_tiles(starts, prefill_lens, seq_lens, num_tokens, q_tile)
    num_tiles = jnp.sum(-(-prefill_lens // q_tile))  # the real tiles come first
    return _attend_rows(out, q_parts, load, num_kv_heads, block_size, req, tok, pos,
                        seq_lens, block_tables, sm_scale, num_rows=num_tiles,
                        group_rows=TILE_GROUP, kv_chunk=KV_CHUNK)


def _prefill_tiles(starts, q_lens, seq_lens, num_tokens, q_tile):
    """Cut each request's `q_lens[i]` tokens into tiles of `q_tile`.

    Returns req [N], tok [N, q_tile] (flat token index, `num_tokens` where unused) and
    pos [N, q_tile] (query position, -1 where unused); N is the static bound above, and
    the `sum(ceil(q_lens / q_tile))` real tiles come first.
    """
    num_seqs = starts.shape[0]
    max_tiles = min(num_tokens,
                    (num_tokens + min(num_seqs, num_tokens) * (q_tile - 1)) // q_tile)
    tiles_per_req = -(-q_lens // q_tile)
    tile_end = jnp.cumsum(tiles_per_req)
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_seqs - 1)
    first = (t - (tile_end[req] - tiles_per_req[req])) * q_tile  # offset in the request
    offset = first[:, None] + jnp.arange(q_tile, dtype=jnp.int32)[None, :]
    valid = (offset < q_lens[req][:, None]) & (t < tile_end[-1])[:, None]
    tok = jnp.where(valid, starts[req][:, None] + offset, num_tokens)
    pos = jnp.where(valid, (seq_lens[req] - q_lens[req])[:, None] + offset, -1)
    return req.astype(jnp.int32), tok, pos


def _attend_rows(out, q_parts, load: Loader, num_kv_heads, block_size, req, tok, pos,
                 seq_lens, block_tables, sm_scale, *, num_rows, group_rows, kv_chunk):
    """Rows (req [N], tok [N, Q], pos [N, Q]) attend to keys at positions <= pos.

    Only rows [0, num_rows) (a traced count) are visited, `group_rows` at a time; each
    group runs an online softmax over chunks of about `kv_chunk` keys (whole blocks) up
    to its own longest context, and scatters its result into `out` at `tok`
    (out-of-range `tok` rows are dropped).
    """
    num_tokens, num_heads = q_parts[0].shape[:2]
    n, q_len = tok.shape
    group = num_heads // num_kv_heads
    rows = min(group_rows, n)
    padded = -(-n // rows) * rows
    req = jnp.pad(req, (0, padded - n))
    tok = jnp.pad(tok, ((0, padded - n), (0, 0)), constant_values=num_tokens)
    pos = jnp.pad(pos, ((0, padded - n), (0, 0)), constant_values=-1)
    max_blocks = block_tables.shape[1]
    chunk_blocks = max(1, min(max_blocks, kv_chunk // block_size))
    num_chunks = -(-max_blocks // chunk_blocks)
    chunk = chunk_blocks * block_size
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * chunk_blocks - max_blocks)))

    def attend_group(g, out):
        g_req = lax.dynamic_slice_in_dim(req, g * rows, rows)
        g_tok = lax.dynamic_slice_in_dim(tok, g * rows, rows)
        g_pos = lax.dynamic_slice_in_dim(pos, g * rows, rows)
        g_tables = tables[g_req]
        kv_lens = seq_lens[g_req]  # [rows]
        qs = [x[jnp.clip(g_tok, 0, num_tokens - 1)].astype(jnp.float32)
              .reshape(rows, q_len, num_kv_heads, group, x.shape[-1]) for x in q_parts]

        def step(c, carry):
            m, l, acc = carry  # [R, Hkv, G, Q], [R, Hkv, G, Q], [R, Hkv, G, Q, Dv]
            ids = lax.dynamic_slice_in_dim(g_tables, c * chunk_blocks, chunk_blocks, axis=1)
            keys, v = load(ids)
            kpos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            s = sum(_qk(qp, to_float32(kp)) for qp, kp in zip(qs, keys)) * sm_scale
            visible = kpos[None, None, :] <= g_pos[:, :, None]  # [R, Q, C]
            s = jnp.where(visible[:, None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            in_ctx = (kpos[None, :] < kv_lens[:, None])[:, :, None, None]  # [R, C, 1, 1]
            v = jnp.where(in_ctx, to_float32(v), 0.0)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + _pv(p, v)

        shape = (rows, num_kv_heads, group, q_len)
        init = (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, out.shape[-1]), jnp.float32))
        trips = -(-(jnp.max(g_pos) + 1) // chunk)
        _, l, acc = lax.fori_loop(0, trips, step, init)
        res = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # [R, Hkv, G, Q, Dv]
        res = res.transpose(0, 3, 1, 2, 4).reshape(rows * q_len, num_heads, -1)
        return out.at[g_tok.reshape(-1)].set(res.astype(out.dtype), mode="drop")

    return lax.fori_loop(0, -(-num_rows // rows), attend_group, out)


def _qk(q, k):
    """q [N, Q, Hkv, G, D] . k [N, C, Hkv, D] -> scores [N, Hkv, G, Q, C].

    One query per row (decode) with both a group and several KV heads (GQA proper) uses a
    fused multiply-reduce, which XLA:CPU runs up to 2x faster than the batched mat-vec
    einsum; with a size-1 head axis (MHA: G == 1; MQA and MLA: Hkv == 1) the same
    multiply-reduce is up to 10x slower than the einsum, so those take the einsum."""
    if _multiply_reduce(q.shape[1], q.shape[2], q.shape[3]):
        s = (q[:, 0, None] * k[:, :, :, None, :]).sum(-1)  # [N, C, Hkv, G]
        return s.transpose(0, 2, 3, 1)[:, :, :, None, :]
    return jnp.einsum("nqkgd,nckd->nkgqc", q, k, precision=_HI)


def _pv(p, v):
    """p [N, Hkv, G, Q, C] @ v [N, C, Hkv, Dv] -> [N, Hkv, G, Q, Dv] (as in _qk)."""
    if _multiply_reduce(p.shape[3], p.shape[1], p.shape[2]):
        pt = p[:, :, :, 0].transpose(0, 3, 1, 2)  # [N, C, Hkv, G]
        return (pt[..., None] * v[:, :, :, None, :]).sum(1)[:, :, :, None, :]
    return jnp.einsum("nkgqc,nckd->nkgqd", p, v, precision=_HI)


def _multiply_reduce(num_queries, num_kv_heads, group):
    """Whether a chunk's scores and values take the multiply-reduce form (see _qk)."""
    return num_queries == 1 and num_kv_heads > 1 and group > 1
