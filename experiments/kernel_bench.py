"""GPU benchmark of the Pallas attention kernels, side by side with the alternatives.

For every kernel: first a correctness check against its pure-JAX reference, then
timings (warm-up, median over repeats, inputs rotated through enough copies, or cache
layers, to exceed L2) beside the best alternative on the same inputs and the roofline:

- flash_attention vs `jax.nn.dot_product_attention(implementation="cudnn")`;
  roofline = causal FLOPs / measured bf16 matmul peak;
- paged_attention (decode) vs JAX's bundled Pallas `ops.gpu.paged_attention` (which has
  no softmax scale: it gets q pre-multiplied by the scale);
  roofline = KV bytes / measured device-to-device copy bandwidth;
- mla_ragged_paged_attention (decode) vs the pure-JAX path (llmjax.attention.xla);
- a fresh prefill step (every request from position 0) through flash_attention on its own
  K/V, as the engine runs it, vs ragged_paged_attention over the paged cache;
- ragged_paged_attention on a mixed batch vs its decode and prefill parts run separately;
- a sweep of each kernel's tuning knobs (static arguments) on one shape.

A kernel that fails (wrong result, compile error) is reported in its row and the run goes
on; the exit status is 1 when any row failed. `experiments/gpu_check.py` reuses the bench
functions with its own shapes and time caps.

Usage: python experiments/kernel_bench.py            (GPU; about 2-4 minutes)
       python experiments/kernel_bench.py --smoke    (tiny shapes, interpret mode, any host)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python experiments/kernel_bench.py` finds llmjax and pallas_kernels

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from llmjax.attention import xla  # noqa: E402
from pallas_kernels import (flash_attention, flash_prefill, mla_ragged_paged_attention, paged_attention,  # noqa: E402
                            prefill_segment_starts, ragged_paged_attention)
from pallas_kernels.platform import on_gpu  # noqa: E402

L2_BYTES = 64 << 20  # rotate inputs through at least 4x this much memory
BLOCK_SIZE = 16
TOL = 2e-2  # bf16: max error relative to the reference's largest magnitude
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


class WrongResult(Exception):
    pass


def check(name, out, ref, tol=TOL):
    """Raise WrongResult unless `out` is finite and within `tol` x max|ref| of `ref`."""
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    err = float(jnp.max(jnp.abs(out - ref)))
    scale = float(jnp.max(jnp.abs(ref))) or 1.0
    ok = bool(jnp.isfinite(out).all()) and err <= tol * scale
    log(f"check {name}: max err {err:.2e} (x{scale:.2g}) {'ok' if ok else 'FAILED'}")
    if not ok:
        raise WrongResult(f"{name}: max error {err:.3g} > {tol} x {scale:.3g} or non-finite")
    return err / scale


def guarded(name, fn, *args, **kwargs):
    """Rows of `fn(*args)`, or one failure row (the error logged) if it raises."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  one failing kernel must not stop the others
        log(f"{name} FAILED: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=3)
        return [dict(shape=name, error=f"{type(e).__name__}: {str(e)[:200]}")]


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


def flash_inputs(cfg, batch, q_len, kv_len, heads, kv_heads, dim):
    nbytes = 2 * batch * (q_len * heads + 2 * kv_len * kv_heads) * dim
    sets = []
    for c in range(copies_for(cfg, nbytes)):
        kq, kk, kv = jax.random.split(jax.random.key(c), 3)
        sets.append((jax.random.normal(kq, (batch, q_len, heads, dim), jnp.bfloat16),
                     jax.random.normal(kk, (batch, kv_len, kv_heads, dim), jnp.bfloat16),
                     jax.random.normal(kv, (batch, kv_len, kv_heads, dim), jnp.bfloat16)))
    return sets


def decode_inputs(cfg, seqs, ctx, heads, kv_heads, dim):
    layer_bytes = 2 * 2 * seqs * ctx * kv_heads * dim
    layers = copies_for(cfg, layer_bytes)
    q, (k, v), (_, seq_lens, tables, _) = paged_batch(
        0, [1] * seqs, [ctx] * seqs, heads=heads, kv_heads=kv_heads, head_dim=dim,
        layers=layers, dtype=jnp.bfloat16)
    sets = [(q, k, v, jnp.int32(i), seq_lens, tables) for i in range(layers)]
    ref = xla.ragged_paged_attention(q, k, v, jnp.int32(0), jnp.arange(seqs + 1), seq_lens,
                                     tables, jnp.int32(seqs), sm_scale=dim ** -0.5,
                                     decode_only=True)
    return sets, ref, layer_bytes


# --- benchmarks: each returns table rows ---

def bench_flash(cfg, peak_flops, shapes=None, alternatives=True, **knobs):
    """`alternatives`: time cuDNN too (a knob sweep leaves it out: its time does not change)."""
    rows = []
    for batch, q_len, kv_len, heads, kv_heads, dim in shapes or cfg.prefill:
        shape = f"flash b{batch} q{q_len} k{kv_len} h{heads}/{kv_heads} d{dim}"
        rows += guarded(shape, _bench_flash_one, cfg, peak_flops, shape, batch, q_len, kv_len,
                        heads, kv_heads, dim, knobs, alternatives)
    return rows


def _bench_flash_one(cfg, peak_flops, shape, batch, q_len, kv_len, heads, kv_heads, dim, knobs,
                     alternatives):
    log(f"{shape}: inputs")
    sets = flash_inputs(cfg, batch, q_len, kv_len, heads, kv_heads, dim)
    ours = functools.partial(flash_attention, interpret=cfg.interpret, **knobs)
    if shape not in cfg.references:  # inputs are seeded: one dense reference per shape
        cfg.references[shape] = _dense_reference(*sets[0], q_offset=kv_len - q_len)
    ref = cfg.references[shape]
    err = check(shape, ours(*sets[0]), ref)
    t = time_call(ours, sets, repeats=cfg.repeats, inner=cfg.inner)
    off = kv_len - q_len
    flops = 4 * batch * heads * dim * (q_len * off + q_len * (q_len + 1) / 2)
    alt_name, alt_t = "-", None
    if cfg.on_gpu and q_len == kv_len and alternatives:
        alt_name = "cudnn"
        alt = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                        implementation="cudnn"))
        alt_t = _time_alt(alt, sets, cfg, ref)
    return [_row(shape, t, flops / t / 1e12, "TFLOP/s", flops / peak_flops / t, alt_name, alt_t,
                 err=err, knobs=knobs)]


def _dense_reference(q, k, v, *, q_offset):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
    visible = jnp.arange(k.shape[1])[None, :] <= q_offset + jnp.arange(q.shape[1])[:, None]
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


def _time_alt(fn, sets, cfg, ref):
    """Seconds per call of an alternative, or None if it fails or is wrong (logged)."""
    try:
        check("alternative", fn(*sets[0]), ref)
        return time_call(fn, sets, repeats=cfg.repeats, inner=cfg.inner)
    except Exception as e:  # noqa: BLE001  an alternative that does not support the shape
        log(f"alternative failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def bench_decode(cfg, peak_bw, shapes=None, alternatives=True, **knobs):
    """`alternatives`: time JAX's bundled kernel too (a knob sweep leaves it out)."""
    rows = []
    for seqs, ctx, heads, kv_heads, dim in shapes or cfg.decode:
        shape = f"paged decode s{seqs} ctx{ctx} h{heads}/{kv_heads} d{dim}"
        rows += guarded(shape, _bench_decode_one, cfg, peak_bw, shape, seqs, ctx, heads,
                        kv_heads, dim, knobs, alternatives)
    return rows


def _bench_decode_one(cfg, peak_bw, shape, seqs, ctx, heads, kv_heads, dim, knobs, alternatives):
    log(f"{shape}: inputs")
    sets, ref, layer_bytes = decode_inputs(cfg, seqs, ctx, heads, kv_heads, dim)
    ours = functools.partial(paged_attention, sm_scale=dim ** -0.5, interpret=cfg.interpret,
                             **knobs)
    err = check(shape, ours(*sets[0]), ref)
    t = time_call(ours, sets, repeats=cfg.repeats, inner=cfg.inner)
    alt_name, alt_t = "-", None
    if cfg.on_gpu and alternatives:
        alt_name, alt_t = "jax pallas paged", _bundled_paged(sets, cfg, ref, dim ** -0.5)
    return [_row(shape, t, layer_bytes / t / 1e9, "GB/s", layer_bytes / peak_bw / t,
                 alt_name, alt_t, err=err, knobs=knobs)]


def _bundled_paged(sets, cfg, ref, sm_scale):
    """JAX's bundled Pallas paged attention, on its own layout [Hkv, N, bs, D] per layer.
    It applies no softmax scale, so its q is pre-scaled (outside the timed region)."""
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as alt
    except ImportError:
        return None
    tables = sets[0][5]
    pages = tables.shape[1]
    per_block = min(8, pages)
    splits = max(1, min(16, pages // per_block))
    fn = jax.jit(functools.partial(alt, pages_per_compute_block=per_block, k_splits=splits))
    alt_sets = [((q * sm_scale).astype(q.dtype), k[int(layer)].transpose(2, 0, 1, 3),
                 v[int(layer)].transpose(2, 0, 1, 3), tables, seq_lens)
                for q, k, v, layer, seq_lens, tables in sets]
    return _time_alt(fn, alt_sets, cfg, ref)


def bench_mla(cfg, peak_bw, shapes=None, **knobs):
    rows = []
    for seqs, ctx, heads, rank, rope in shapes or cfg.mla:
        shape = f"mla decode s{seqs} ctx{ctx} h{heads} r{rank}+{rope}"
        rows += guarded(shape, _bench_mla_one, cfg, peak_bw, shape, seqs, ctx, heads, rank,
                        rope, knobs)
    return rows


def _bench_mla_one(cfg, peak_bw, shape, seqs, ctx, heads, rank, rope, knobs):
    layer_bytes = 2 * seqs * ctx * (rank + rope)
    layers = copies_for(cfg, layer_bytes)
    log(f"{shape}: inputs ({layers} layers)")
    q, (lat,), meta = paged_batch(1, [1] * seqs, [ctx] * seqs, heads=heads, kv_heads=1,
                                  head_dim=rank + rope, layers=layers, dtype=jnp.bfloat16,
                                  latent=True)
    ql, qr = q[..., :rank], q[..., rank:]
    sets = [(ql, qr, lat, jnp.int32(i), *meta) for i in range(layers)]
    kw = dict(sm_scale=(rank + rope) ** -0.5, decode_only=True)
    ours = functools.partial(mla_ragged_paged_attention, interpret=cfg.interpret, **kw, **knobs)
    alt = jax.jit(functools.partial(xla.mla_ragged_paged_attention, **kw))
    ref = alt(*sets[0])
    err = check(shape, ours(*sets[0]), ref)
    t = time_call(ours, sets, repeats=cfg.repeats, inner=cfg.inner)
    alt_t = time_call(alt, sets, repeats=cfg.repeats, inner=cfg.inner)
    return [_row(shape, t, layer_bytes / t / 1e9, "GB/s", layer_bytes / peak_bw / t,
                 "llmjax xla", alt_t, err=err, knobs=knobs)]


def bench_ragged_mixed(cfg, mixed=None, **knobs):
    """One launch for a mixed batch vs its decode and prefill parts launched separately."""
    decodes, dec_ctx, chunks, chunk, chunk_ctx, heads, kv_heads, dim = mixed or cfg.mixed
    shape = f"ragged {decodes}x1@{dec_ctx} + {chunks}x{chunk}@{chunk_ctx} h{heads}/{kv_heads}"
    return guarded(shape, _bench_ragged_one, cfg, shape, decodes, dec_ctx, chunks, chunk,
                   chunk_ctx, heads, kv_heads, dim, knobs)


def _bench_ragged_one(cfg, shape, decodes, dec_ctx, chunks, chunk, chunk_ctx, heads, kv_heads,
                      dim, knobs):
    log(f"{shape}: inputs")
    q_lens = [1] * decodes + [chunk] * chunks
    seq_lens = [dec_ctx] * decodes + [chunk_ctx] * chunks
    q, (k, v), (qsl, sl, tables, _) = paged_batch(
        2, q_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=dim, layers=2,
        dtype=jnp.bfloat16)
    kw = dict(sm_scale=dim ** -0.5, interpret=cfg.interpret)
    run = functools.partial(ragged_paged_attention, **kw, **knobs)
    mixed = (q, k, v, jnp.int32(0), qsl, sl, tables, jnp.int32(decodes))
    ref = jax.jit(functools.partial(xla.ragged_paged_attention, sm_scale=dim ** -0.5))(*mixed)
    err = check(shape, run(*mixed), ref)
    dec = (q[:decodes], k, v, jnp.int32(0), qsl[:decodes + 1], sl[:decodes],
           tables[:decodes], jnp.int32(decodes))
    pre = (q[decodes:], k, v, jnp.int32(0), qsl[decodes:] - decodes, sl[decodes:],
           tables[decodes:], jnp.int32(0))
    opts = dict(repeats=cfg.repeats, inner=cfg.inner)
    t_mixed = time_call(run, [mixed], **opts)
    t_dec = time_call(functools.partial(run, decode_only=True), [dec], **opts)
    t_pre = time_call(run, [pre], **opts)
    log(f"ragged parts: decode {t_dec * 1e6:.1f} us, prefill {t_pre * 1e6:.1f} us")
    return [_row(shape, t_mixed, None, "", None, "decode+prefill apart", t_dec + t_pre, err=err,
                 knobs=knobs)]


def bench_fresh_prefill(cfg, peak_flops):
    """A fresh prefill step (every request from position 0): the flash path the engine takes for it
    (`flash_prefill` on the step's own K/V) vs the ragged kernel over the paged cache."""
    lens, heads, kv_heads, dim = cfg.fresh
    shape = f"fresh prefill {len(lens)} requests T{sum(lens)} h{heads}/{kv_heads} d{dim}"
    return guarded(shape, _bench_fresh_prefill_one, cfg, peak_flops, shape, lens, heads, kv_heads, dim)


def _bench_fresh_prefill_one(cfg, peak_flops, shape, lens, heads, kv_heads, dim):
    log(f"{shape}: inputs")
    q, (k, v), (qsl, sl, tables, _) = paged_batch(3, lens, lens, heads=heads, kv_heads=kv_heads, head_dim=dim,
                                                  layers=1, dtype=jnp.bfloat16)
    flat = lambda cache: jnp.concatenate([cache[0, tables[i]].reshape(-1, kv_heads, dim)[:n]  # noqa: E731
                                          for i, n in enumerate(lens)])
    k_new, v_new = flat(k), flat(v)
    segments = prefill_segment_starts(qsl, q.shape[0])
    kw = dict(sm_scale=dim ** -0.5, interpret=cfg.interpret)
    flash = jax.jit(functools.partial(flash_prefill, **kw))
    ragged = functools.partial(ragged_paged_attention, **kw)
    ragged_args = (q, k, v, jnp.int32(0), qsl, sl, tables, jnp.int32(0))
    ref = jax.jit(functools.partial(xla.ragged_paged_attention, sm_scale=dim ** -0.5))(*ragged_args)
    err = check(shape, flash(q, k_new, v_new, segments), ref)
    opts = dict(repeats=cfg.repeats, inner=cfg.inner)
    t = time_call(flash, [(q, k_new, v_new, segments)], **opts)
    alt_t = _time_alt(ragged, [ragged_args], cfg, ref)
    flops = 4 * heads * dim * sum(n * (n + 1) / 2 for n in lens)
    return [_row(shape, t, flops / t / 1e12, "TFLOP/s", flops / peak_flops / t, "ragged (paged)", alt_t, err=err)]


def bench_sweep(cfg, peak_flops, peak_bw, on_rows=None):
    """Each kernel's tuning knobs (static arguments) on one shape: a row per setting (the
    alternatives of flash and decode are in their own rows); `on_rows(rows so far)` after each."""
    rows = []
    flash_shape, decode_shape, mixed = cfg.sweep_shapes
    runs = [functools.partial(bench_flash, cfg, peak_flops, [flash_shape], False, **k) for k in cfg.flash_knobs]
    runs += [functools.partial(bench_decode, cfg, peak_bw, [decode_shape], False, **k) for k in cfg.decode_knobs]
    runs += [functools.partial(bench_ragged_mixed, cfg, mixed, **k) for k in cfg.ragged_knobs]
    for run in runs:
        rows += run()
        if on_rows:
            on_rows(rows)
    return rows


def _row(shape, t, rate, unit, frac, alt_name, alt_t, *, err=None, knobs=None):
    return dict(shape=shape, knobs=" ".join(f"{k}={v}" for k, v in (knobs or {}).items()) or "-",
                us=t * 1e6, rate=f"{rate:.1f} {unit}" if rate else "-",
                roof=f"{100 * frac:.0f}%" if frac else "-", alt=alt_name,
                alt_us=f"{alt_t * 1e6:.0f}" if alt_t else "-",
                ratio=f"{alt_t / t:.2f}x" if alt_t else "-",
                rel_err=f"{err:.1e}" if err is not None else "-", error="")


COLUMNS = [("shape", "shape"), ("knobs", "knobs"), ("us", "time (us)"), ("rate", "rate"),
           ("roof", "% roofline"), ("alt", "alternative"), ("alt_us", "alt (us)"),
           ("ratio", "alt/ours"), ("rel_err", "rel err"), ("error", "error")]


def markdown_table(rows):
    cells = [[(f"{r[c]:.0f}" if c == "us" and c in r else str(r.get(c, "-"))) for c, _ in COLUMNS]
             for r in rows]
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


class Config:
    """Shapes, knobs and repeat counts: full on a GPU, tiny in --smoke (interpret mode)."""

    def __init__(self, smoke):
        self.on_gpu = on_gpu()
        self.interpret = not self.on_gpu
        self.references = {}  # shape -> its dense reference output (flash)
        if smoke:
            self.repeats, self.inner, self.matmul_n, self.copy_elems = 2, 1, 256, 1 << 20
            self.max_copies = 2
            self.prefill = [(1, 64, 64, 4, 2, 64), (1, 32, 80, 4, 1, 128)]
            self.decode = [(4, 64, 8, 2, 64)]
            self.mla = [(2, 64, 16, 64, 16)]
            self.mixed = (4, 48, 1, 24, 40, 4, 2, 64)
            self.fresh = ((24, 40), 4, 2, 64)
            self.sweep_shapes = ((1, 32, 32, 2, 1, 64), (2, 48, 4, 2, 64), self.mixed)
            self.flash_knobs = [dict(block_q=16, block_k=16)]
            self.decode_knobs = [dict(num_splits=2)]
            self.ragged_knobs = []
        else:
            self.repeats, self.inner, self.matmul_n, self.copy_elems = 15, 10, 8192, 1 << 29
            self.max_copies = 64
            self.prefill = [(1, 4096, 4096, 32, 8, 128), (4, 2048, 2048, 16, 16, 64),
                            (1, 1024, 8192, 32, 8, 128)]
            self.decode = [(64, 2048, 32, 8, 128), (256, 1024, 32, 8, 128),
                           (4, 16384, 32, 8, 128), (32, 2048, 9, 3, 64)]
            self.mla = [(64, 2048, 16, 512, 64)]
            self.mixed = (64, 2048, 2, 512, 2048, 32, 8, 128)
            self.fresh = ((512, 1536, 1024, 1024), 32, 8, 128)
            self.sweep_shapes = ((1, 4096, 4096, 32, 8, 128), (64, 4096, 32, 8, 128), self.mixed)
            self.flash_knobs = [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
                                for bq, bk, w, st in ((64, 64, 4, 3), (128, 64, 4, 3),
                                                      (128, 64, 8, 3), (128, 128, 8, 2),
                                                      (128, 64, 4, 4))]
            self.decode_knobs = [dict(pages_per_step=p, num_splits=s, num_warps=w)
                                 for p, s, w in ((1, None, 4), (2, None, 4), (4, None, 4),
                                                 (8, None, 4), (4, 1, 4), (4, 16, 4),
                                                 (4, None, 8))]
            self.ragged_knobs = [dict(num_splits=s, tile_rows=r, pages_per_step=p)
                                 for s, r, p in ((1, 64, 4), (None, 64, 4), (None, 128, 4),
                                                 (None, 64, 8))]


def run_all(cfg, on_rows=None):
    """Every benchmark; returns (peaks, rows). Failures are rows with an `error`.
    `on_rows(rows so far)` is called after each group (partial results)."""
    log(f"device: {jax.devices()[0].device_kind}; measuring peaks")
    peak_flops, peak_bw = measure_peaks(cfg)
    log(f"bf16 matmul {peak_flops / 1e12:.1f} TFLOP/s, copy {peak_bw / 1e9:.0f} GB/s")
    rows = []
    def sweep():  # its rows are reported as they come: a cap that stops it keeps them
        return bench_sweep(cfg, peak_flops, peak_bw, on_rows and (lambda part: on_rows(rows + part)))

    benches = [lambda: bench_flash(cfg, peak_flops), lambda: bench_decode(cfg, peak_bw),
               lambda: bench_mla(cfg, peak_bw), sweep]
    if cfg.mixed:
        benches.insert(3, lambda: bench_ragged_mixed(cfg))
    if cfg.fresh:
        benches.insert(1, lambda: bench_fresh_prefill(cfg, peak_flops))
    for bench in benches:
        rows += bench()
        if on_rows:
            on_rows(rows)
    return (peak_flops, peak_bw), rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (interpret mode without a GPU; timings are meaningless)")
    args = parser.parse_args()
    cfg = Config(args.smoke)
    if not cfg.on_gpu and not args.smoke:
        sys.exit(f"kernel_bench needs a GPU (JAX platform: {jax.default_backend()}); "
                 "use --smoke for a tiny interpret-mode run of the script")
    (peak_flops, peak_bw), rows = run_all(cfg)
    body = (f"bf16; peaks measured here: matmul {peak_flops / 1e12:.1f} TFLOP/s, copy "
            f"{peak_bw / 1e9:.0f} GB/s; alt/ours > 1 means ours is faster\n\n"
            + markdown_table(rows))
    print("\n" + body)
    if cfg.on_gpu and not args.smoke:
        from llmjax.provenance import write_results
        write_results(ROOT / "results" / "gpu", "kernel_bench", "# Pallas kernels on the GPU\n\n"
                      + body, dict(peak_flops=peak_flops, peak_bw=peak_bw, rows=rows))
    failed = [r["shape"] for r in rows if r.get("error")]
    log(f"done; {len(failed)} failed: {failed}" if failed else "done")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
