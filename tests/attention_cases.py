"""Random paged-attention batches and a naive NumPy reference, shared by the attention tests and
by experiments/gpu_check.py (so it needs no pytest: the tests' `rng` fixture is in conftest.py).

A batch is a list of (q_len, seq_len) per request: decodes first (q_len 1), then prefill
chunks, then padded requests (0, 0). Block tables hold shuffled, non-contiguous block
ids; every cache slot outside a request's context (the null block included) is NaN, so
an implementation that lets a masked key contribute produces NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np


@dataclass
class Batch:
    q_lens: list[int]
    seq_lens_list: list[int]
    num_decodes: int
    num_tokens: int  # T (>= sum of q_lens; the rest are padded tokens)
    block_size: int
    max_blocks: int  # B
    query_start_loc: np.ndarray  # [S+1]
    seq_lens: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, B]
    num_blocks: int

    def args(self):
        """(query_start_loc, seq_lens, block_tables, num_decodes) as JAX arrays."""
        return (jnp.asarray(self.query_start_loc), jnp.asarray(self.seq_lens),
                jnp.asarray(self.block_tables), jnp.int32(self.num_decodes))


def make_batch(rng, kind, *, num_seqs=6, block_size=8, max_blocks=8, num_padded=1,
               pad_tokens=3, max_q=24, table_blocks=None):
    """kind: 'decode' | 'prefill' | 'mixed'. Contexts end both mid-block and on a block
    boundary; some prefills are chunks after a cached prefix, some are whole prompts.
    Contexts fill at most `max_blocks` blocks of block tables `table_blocks` wide (default
    `max_blocks`; wider: the engine's tables, sized for the longest context allowed)."""
    table_blocks = table_blocks or max_blocks
    cap = block_size * max_blocks
    n_real = num_seqs - num_padded
    if kind == "decode":
        n_dec = n_real
    elif kind == "prefill":
        n_dec = 0
    else:
        n_dec = max(1, n_real // 2)
    q_lens, seq_lens = [], []
    for i in range(n_real):
        q = 1 if i < n_dec else int(rng.integers(1, max_q + 1))
        if i % 3 == 0:  # on a block boundary
            s = block_size * int(rng.integers(-(-q // block_size), max_blocks + 1))
        elif i % 3 == 1 and i >= n_dec:  # a whole prompt, no cached prefix
            s = q
        else:
            s = int(rng.integers(q, cap + 1))
        q_lens.append(q)
        seq_lens.append(s)
    q_lens += [0] * num_padded
    seq_lens += [0] * num_padded

    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 4
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((num_seqs, table_blocks), np.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[used:used + n]
        used += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Batch(q_lens, seq_lens, n_dec, int(qsl[-1]) + pad_tokens, block_size, table_blocks,
                 qsl, np.asarray(seq_lens, np.int32), tables, num_blocks)


def context_mask(batch: Batch) -> np.ndarray:
    """[num_blocks, bs] True where a slot holds a request's context token."""
    mask = np.zeros((batch.num_blocks, batch.block_size), bool)
    for i, s in enumerate(batch.seq_lens_list):
        for p in range(s):
            mask[batch.block_tables[i, p // batch.block_size], p % batch.block_size] = True
    return mask


def random_cache(rng, batch: Batch, num_layers, tail_shape, dtype):
    """[L, num_blocks, bs, *tail_shape] normal values in context slots, NaN elsewhere."""
    x = rng.standard_normal((num_layers, batch.num_blocks, batch.block_size, *tail_shape))
    mask = context_mask(batch).reshape(1, batch.num_blocks, batch.block_size,
                                       *([1] * len(tail_shape)))
    return jnp.asarray(np.where(mask, x, np.nan), dtype)


def contiguous(cache, batch: Batch, layer, i):
    """Request i's context as a contiguous float64 array [seq_len, ...]."""
    c = np.asarray(cache[layer], np.float64)
    blocks = batch.block_tables[i, :-(-batch.seq_lens_list[i] // batch.block_size)]
    return c[blocks].reshape(-1, *c.shape[2:])[:batch.seq_lens_list[i]]


def naive_attention(scores_fn, values_fn, batch: Batch, out_shape):
    """Per request, per new token: causal softmax over its context, float64.

    scores_fn(i, t) -> [H, ctx] scores of flat token t of request i over its context;
    values_fn(i) -> [ctx, H, Dv]. Rows of padded tokens stay NaN (not compared).
    """
    out = np.full(out_shape, np.nan)
    for i, (q_len, s) in enumerate(zip(batch.q_lens, batch.seq_lens_list)):
        if q_len == 0:
            continue
        v = values_fn(i)
        for j in range(q_len):
            t = batch.query_start_loc[i] + j
            pos = s - q_len + j
            sc = scores_fn(i, t)[:, :pos + 1]
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[t] = np.einsum("hc,chd->hd", p, v[:pos + 1])
    return out


def naive_gqa(q, k_cache, v_cache, layer, batch: Batch, sm_scale):
    """Reference for ragged_paged_attention: q [T, H, D] -> [T, H, D] float64."""
    qn = np.asarray(q, np.float64)
    group = q.shape[1] // k_cache.shape[3]

    def scores(i, t):
        k = np.repeat(contiguous(k_cache, batch, layer, i), group, axis=1)  # [ctx, H, D]
        return np.einsum("hd,chd->hc", qn[t], k) * sm_scale

    def values(i):
        return np.repeat(contiguous(v_cache, batch, layer, i), group, axis=1)

    return naive_attention(scores, values, batch, q.shape)


def naive_mla(q_latent, q_rope, latent_cache, layer, batch: Batch, sm_scale):
    """Reference for mla_ragged_paged_attention: -> [T, H, R] float64."""
    rank = q_latent.shape[-1]
    ql, qr = np.asarray(q_latent, np.float64), np.asarray(q_rope, np.float64)

    def scores(i, t):
        lat = contiguous(latent_cache, batch, layer, i)  # [ctx, R + Dr]
        return (ql[t] @ lat[:, :rank].T + qr[t] @ lat[:, rank:].T) * sm_scale

    def values(i):
        c = contiguous(latent_cache, batch, layer, i)[:, :rank]
        return np.broadcast_to(c[:, None, :], (c.shape[0], q_latent.shape[1], rank))

    return naive_attention(scores, values, batch, q_latent.shape)


def assert_close(out, ref, batch: Batch, *, rtol, atol):
    """Real tokens match the reference; padded tokens are finite."""
    out = np.asarray(out, np.float64)
    n = int(batch.query_start_loc[-1])
    assert np.isfinite(out).all(), "non-finite output (an unwritten or masked-in element)"
    np.testing.assert_allclose(out[:n], ref[:n], rtol=rtol, atol=atol)
