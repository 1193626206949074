"""GPU benchmark of the Pallas attention kernels, side by side with the alternatives.

For every kernel: first a correctness check against its pure-JAX reference, then
timings (warm-up, median over repeats, inputs rotated through enough copies, or cache
layers, to exceed L2) beside the best alternative on the same inputs and the roofline:

- flash_attention vs `jax.nn.dot_product_attention(implementation="cudnn")`;
  roofline = causal FLOPs / measured bf16 matmul peak;
- paged_attention (decode) vs JAX's bundled Pallas `ops.gpu.paged_attention`;
  roofline = KV bytes / measured device-to-device copy bandwidth;
- mla_ragged_paged_attention (decode) vs the pure-JAX path (llmjax.attention.xla);
- ragged_paged_attention on a mixed batch vs its decode and prefill parts run separately.

Usage: python experiments/kernel_bench.py            (GPU; about 2-4 minutes)
       python experiments/kernel_bench.py --smoke    (tiny shapes, interpret mode, any host)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.attention import xla
from pallas_kernels import (flash_attention, mla_ragged_paged_attention, paged_attention,
                            ragged_paged_attention)

L2_BYTES = 64 << 20  # rotate inputs through at least 4x this much memory
BLOCK_SIZE = 16
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def time_call(fn, arg_sets, *, repeats, inner):
    """Median seconds per call; calls cycle through `arg_sets` (rotated inputs) and are
    queued back to back (`inner` per sample) so dispatch overlaps the GPU work."""
    jax.block_until_ready(fn(*arg_sets[0]))  # compile + warm-up
    jax.block_until_ready([fn(*a) for a in arg_sets])
    samples, k = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*arg_sets[k % len(arg_sets)])
            k += 1
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def copies_for(cfg, nbytes):
    """How many input copies (or cache layers) to rotate through: > 4x L2 in all."""
    return min(cfg.max_copies, max(2, -(-4 * L2_BYTES // max(1, nbytes))))


def measure_peaks(cfg):
    """(bf16 matmul FLOP/s, device-to-device copy bytes/s), measured here."""
    n = cfg.matmul_n
    keys = jax.random.split(jax.random.key(0), 4)
    mats = [jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys]
    t = time_call(jax.jit(jnp.matmul), [(mats[i], mats[i + 1]) for i in range(3)],
                  repeats=cfg.repeats, inner=cfg.inner)
    x = [jnp.ones((cfg.copy_elems,), jnp.bfloat16) * i for i in range(2)]
    tc = time_call(jax.jit(lambda a: a + 1), [(a,) for a in x], repeats=cfg.repeats,
                   inner=cfg.inner)
    return 2 * n ** 3 / t, 2 * x[0].nbytes / tc


def check(name, out, ref, tol):
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) or 1.0
    ok = bool(jnp.isfinite(out.astype(jnp.float32)).all()) and err <= tol * scale
    log(f"check {name}: max err {err:.2e} (x{scale:.2g}) {'ok' if ok else 'FAILED'}")
    return ok


# --- inputs ---

def paged_batch(seed, q_lens, seq_lens, *, heads, kv_heads, head_dim, layers, dtype,
                num_tokens=None, latent=False):
    """Flat queries and a layered paged cache with shuffled block tables."""
    rng = np.random.default_rng(seed)
    q_lens, seq_lens = np.asarray(q_lens, np.int32), np.asarray(seq_lens, np.int32)
    need = -(-seq_lens // BLOCK_SIZE)
    max_blocks = int(need.max())
    num_blocks = int(need.sum()) + 1
    ids = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
    tables = np.zeros((len(seq_lens), max_blocks), np.int32)
    for i, start in enumerate(np.concatenate([[0], np.cumsum(need)[:-1]])):
        tables[i, :need[i]] = ids[start:start + need[i]]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = num_tokens or int(qsl[-1])
    keys = jax.random.split(jax.random.key(seed), 3)
    tail = (head_dim,) if latent else (kv_heads, head_dim)
    cache_shape = (layers, num_blocks, BLOCK_SIZE, *tail)
    caches = [jax.random.normal(k, cache_shape, dtype) for k in keys[1:(2 if latent else 3)]]
    q = jax.random.normal(keys[0], (num_tokens, heads, head_dim), dtype)
    meta = (jnp.asarray(qsl), jnp.asarray(seq_lens), jnp.asarray(tables),
            jnp.int32(int((q_lens == 1).sum())))
    return q, caches, meta


# --- benchmarks: each returns table rows ---

def bench_flash(cfg, peak_flops):
    rows = []
    for batch, q_len, kv_len, heads, kv_heads, dim in cfg.prefill:
        shape = f"flash b{batch} q{q_len} k{kv_len} h{heads}/{kv_heads} d{dim}"
        log(f"{shape}: inputs")
        nbytes = 2 * batch * (q_len * heads + 2 * kv_len * kv_heads) * dim
        sets = []
        for c in range(copies_for(cfg, nbytes)):
            kq, kk, kv = jax.random.split(jax.random.key(c), 3)
            sets.append((jax.random.normal(kq, (batch, q_len, heads, dim), jnp.bfloat16),
                         jax.random.normal(kk, (batch, kv_len, kv_heads, dim), jnp.bfloat16),
                         jax.random.normal(kv, (batch, kv_len, kv_heads, dim), jnp.bfloat16)))
        ours = functools.partial(flash_attention, interpret=cfg.interpret)
        ref = _dense_reference(*sets[0], q_offset=kv_len - q_len)
        if not check(shape, ours(*sets[0]), ref, 2e-2):
            sys.exit(f"{shape}: wrong result, not timing it")
        t = time_call(ours, sets, repeats=cfg.repeats, inner=cfg.inner)
        off = kv_len - q_len
        flops = 4 * batch * heads * dim * (q_len * off + q_len * (q_len + 1) / 2)
        alt_name, alt_t = "-", None
        if cfg.on_gpu and q_len == kv_len:
            alt_name = "cudnn"
            alt = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                            implementation="cudnn"))
            alt_t = _time_alt(alt, sets, cfg, ref)
        rows.append(_row(shape, t, flops / t / 1e12, "TFLOP/s", flops / peak_flops / t,
                         alt_name, alt_t))
    return rows


def _dense_reference(q, k, v, *, q_offset):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
    visible = jnp.arange(k.shape[1])[None, :] <= q_offset + jnp.arange(q.shape[1])[:, None]
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


def _time_alt(fn, sets, cfg, ref):
    try:
        if not check("alternative", fn(*sets[0]), ref, 2e-2):
            return None
        return time_call(fn, sets, repeats=cfg.repeats, inner=cfg.inner)
    except Exception as e:  # an alternative that does not support the shape
        log(f"alternative failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def bench_decode(cfg, peak_bw):
    rows = []
    for seqs, ctx, heads, kv_heads, dim in cfg.decode:
        shape = f"paged decode s{seqs} ctx{ctx} h{heads}/{kv_heads} d{dim}"
        layer_bytes = 2 * 2 * seqs * ctx * kv_heads * dim
        layers = copies_for(cfg, layer_bytes)
        log(f"{shape}: inputs ({layers} layers)")
        q, (k, v), (_, seq_lens, tables, _) = paged_batch(
            0, [1] * seqs, [ctx] * seqs, heads=heads, kv_heads=kv_heads, head_dim=dim,
            layers=layers, dtype=jnp.bfloat16)
        sets = [(q, k, v, jnp.int32(i), seq_lens, tables) for i in range(layers)]
        ours = functools.partial(paged_attention, sm_scale=dim ** -0.5, interpret=cfg.interpret)
        n = seqs
        ref = xla.ragged_paged_attention(q, k, v, jnp.int32(0), jnp.arange(n + 1), seq_lens,
                                         tables, jnp.int32(n), sm_scale=dim ** -0.5,
                                         decode_only=True)
        if not check(shape, ours(*sets[0]), ref, 2e-2):
            sys.exit(f"{shape}: wrong result, not timing it")
        t = time_call(ours, sets, repeats=cfg.repeats, inner=cfg.inner)
        alt_name, alt_t = "-", None
        if cfg.on_gpu:
            alt_name, alt_t = "jax pallas paged", _bundled_paged(q, k, v, seq_lens, tables,
                                                                 layers, cfg, ref)
        rows.append(_row(shape, t, layer_bytes / t / 1e9, "GB/s", layer_bytes / peak_bw / t,
                         alt_name, alt_t))
    return rows


def _bundled_paged(q, k, v, seq_lens, tables, layers, cfg, ref):
    """JAX's bundled Pallas paged attention, on its own layout [Hkv, N, bs, D] per layer."""
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as alt
    except ImportError:
        return None
    pages = tables.shape[1]
    per_block = min(8, pages)
    splits = max(1, min(16, pages // per_block))
    fn = jax.jit(functools.partial(alt, pages_per_compute_block=per_block, k_splits=splits))
    sets = [(q, k[i].transpose(2, 0, 1, 3), v[i].transpose(2, 0, 1, 3), tables, seq_lens)
            for i in range(layers)]
    return _time_alt(fn, sets, cfg, ref)


def bench_mla(cfg, peak_bw):
    rows = []
    for seqs, ctx, heads, rank, rope in cfg.mla:
        shape = f"mla decode s{seqs} ctx{ctx} h{heads} r{rank}+{rope}"
        layer_bytes = 2 * seqs * ctx * (rank + rope)
        layers = copies_for(cfg, layer_bytes)
        log(f"{shape}: inputs ({layers} layers)")
        q, (lat,), meta = paged_batch(1, [1] * seqs, [ctx] * seqs, heads=heads, kv_heads=1,
                                      head_dim=rank + rope, layers=layers, dtype=jnp.bfloat16,
                                      latent=True)
        ql, qr = q[..., :rank], q[..., rank:]
        sets = [(ql, qr, lat, jnp.int32(i), *meta) for i in range(layers)]
        kw = dict(sm_scale=(rank + rope) ** -0.5, decode_only=True)
        ours = functools.partial(mla_ragged_paged_attention, interpret=cfg.interpret, **kw)
        alt = jax.jit(functools.partial(xla.mla_ragged_paged_attention, **kw))
        ref = alt(*sets[0])
        if not check(shape, ours(*sets[0]), ref, 2e-2):
            sys.exit(f"{shape}: wrong result, not timing it")
        t = time_call(ours, sets, repeats=cfg.repeats, inner=cfg.inner)
        alt_t = time_call(alt, sets, repeats=cfg.repeats, inner=cfg.inner)
        rows.append(_row(shape, t, layer_bytes / t / 1e9, "GB/s", layer_bytes / peak_bw / t,
                         "llmjax xla", alt_t))
    return rows


def bench_ragged_mixed(cfg):
    """One launch for a mixed batch vs its decode and prefill parts launched separately."""
    decodes, dec_ctx, chunks, chunk, chunk_ctx, heads, kv_heads, dim = cfg.mixed
    q_lens = [1] * decodes + [chunk] * chunks
    seq_lens = [dec_ctx] * decodes + [chunk_ctx] * chunks
    log(f"ragged mixed: {decodes} decodes @{dec_ctx} + {chunks} chunks of {chunk} @{chunk_ctx}")
    q, (k, v), (qsl, sl, tables, _) = paged_batch(
        2, q_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=dim, layers=2,
        dtype=jnp.bfloat16)
    kw = dict(sm_scale=dim ** -0.5, interpret=cfg.interpret)
    run = functools.partial(ragged_paged_attention, **kw)
    mixed = (q, k, v, jnp.int32(0), qsl, sl, tables, jnp.int32(decodes))
    ref = jax.jit(functools.partial(xla.ragged_paged_attention, sm_scale=dim ** -0.5))(*mixed)
    if not check("ragged mixed", run(*mixed), ref, 2e-2):
        sys.exit("ragged mixed: wrong result, not timing it")
    dec = (q[:decodes], k, v, jnp.int32(0), qsl[:decodes + 1], sl[:decodes],
           tables[:decodes], jnp.int32(decodes))
    pre = (q[decodes:], k, v, jnp.int32(0), qsl[decodes:] - decodes, sl[decodes:],
           tables[decodes:], jnp.int32(0))
    opts = dict(repeats=cfg.repeats, inner=cfg.inner)
    t_mixed = time_call(run, [mixed], **opts)
    t_dec = time_call(functools.partial(run, decode_only=True), [dec], **opts)
    t_pre = time_call(run, [pre], **opts)
    shape = f"ragged {decodes}x1@{dec_ctx} + {chunks}x{chunk}@{chunk_ctx} h{heads}/{kv_heads}"
    log(f"ragged parts: decode {t_dec * 1e6:.1f} us, prefill {t_pre * 1e6:.1f} us")
    return [_row(shape, t_mixed, None, "", None, "decode+prefill apart", t_dec + t_pre)]


def _row(shape, t, rate, unit, frac, alt_name, alt_t):
    return dict(shape=shape, us=t * 1e6, rate=f"{rate:.1f} {unit}" if rate else "-",
                roof=f"{100 * frac:.0f}%" if frac else "-", alt=alt_name,
                alt_us=f"{alt_t * 1e6:.0f}" if alt_t else "-",
                ratio=f"{alt_t / t:.2f}x" if alt_t else "-")


def print_table(rows):
    cols = [("shape", "shape"), ("us", "time (us)"), ("rate", "rate"), ("roof", "% roofline"),
            ("alt", "alternative"), ("alt_us", "alt (us)"), ("ratio", "alt/ours")]
    cells = [[f"{r[c]:.0f}" if c == "us" else str(r[c]) for c, _ in cols] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, (_, h) in enumerate(cols)]
    print("| " + " | ".join(h.ljust(w) for (_, h), w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


class Config:
    """Shapes and repeat counts: full on a GPU, tiny in --smoke (interpret mode)."""

    def __init__(self, smoke):
        self.on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
        self.interpret = smoke
        if smoke:
            self.repeats, self.inner, self.matmul_n, self.copy_elems = 2, 1, 256, 1 << 20
            self.max_copies = 2
            self.prefill = [(1, 64, 64, 4, 2, 64), (1, 32, 80, 4, 1, 128)]
            self.decode = [(4, 64, 8, 2, 64)]
            self.mla = [(2, 64, 16, 64, 16)]
            self.mixed = (4, 48, 1, 24, 40, 4, 2, 64)
        else:
            self.repeats, self.inner, self.matmul_n, self.copy_elems = 15, 10, 8192, 1 << 29
            self.max_copies = 64
            self.prefill = [(1, 4096, 4096, 32, 8, 128), (4, 2048, 2048, 16, 16, 64),
                            (1, 1024, 8192, 32, 8, 128)]
            self.decode = [(64, 2048, 32, 8, 128), (256, 1024, 32, 8, 128),
                           (4, 16384, 32, 8, 128), (32, 2048, 9, 3, 64)]
            self.mla = [(64, 2048, 16, 512, 64)]
            self.mixed = (64, 2048, 2, 512, 2048, 32, 8, 128)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in interpret mode (checks the script; timings are meaningless)")
    args = parser.parse_args()
    cfg = Config(args.smoke)
    if not cfg.on_gpu and not args.smoke:
        sys.exit(f"kernel_bench needs a GPU (JAX platform: {jax.default_backend()}); "
                 "use --smoke for a tiny interpret-mode run of the script")
    log(f"device: {jax.devices()[0].device_kind}; measuring peaks")
    peak_flops, peak_bw = measure_peaks(cfg)
    log(f"bf16 matmul {peak_flops / 1e12:.1f} TFLOP/s, copy {peak_bw / 1e9:.0f} GB/s")
    rows = bench_flash(cfg, peak_flops) + bench_decode(cfg, peak_bw) + bench_mla(cfg, peak_bw)
    rows += bench_ragged_mixed(cfg)
    print(f"\nbf16; peaks measured here: matmul {peak_flops / 1e12:.1f} TFLOP/s, "
          f"copy {peak_bw / 1e9:.0f} GB/s; alt/ours > 1 means ours is faster\n")
    print_table(rows)
    log("done")


if __name__ == "__main__":
    main()
