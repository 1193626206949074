"""The "cpu" attention backend: every row through the native kernel where it applies, else `xla`.

`ragged_paged_attention` has the signature and contract of `xla.ragged_paged_attention`
(docs/architecture.md, "Attention over the paged cache"). When `native_supported` (head dim a
multiple of 32, a float32 or uint16-as-bfloat16 cache) it is `paged_attention`
(`cpu_kernels/paged_decode.cc` through `jax.ffi`: decode rows and prefill tiles, the cache read
in its storage dtype in place); otherwise it is the pure-JAX `xla.ragged_paged_attention`.
The backend requires `native.available()`. MLA has no native kernel: the backend uses xla's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.attention import native, xla
from llmjax.attention.cache_dtype import BF16_BITS

_STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(BF16_BITS))


def native_supported(head_dim: int, cache_dtype) -> bool:
    """Whether `paged_attention` handles this head dim and cache storage dtype."""
    return head_dim % 32 == 0 and jnp.dtype(cache_dtype) in _STORAGE


def paged_attention(q, k_cache, v_cache, layer, query_start_loc, seq_lens, block_tables,
                    num_decodes, *, sm_scale, decode_only=False, target=native.TARGET):
    """`xla.ragged_paged_attention` in the native kernel: q [T, H, D] -> [T, H, D] in q's dtype.

    k_cache, v_cache: [L, num_blocks, bs, Hkv, D] in a dtype `native_supported` accepts; the
    other operands int32 as in xla. q is widened to float32; math is float32. CPU platform
    only; RuntimeError when `native.available()` is False. `target`: the FFI target to call,
    another registered build of the kernel (experiments/decode_attention.py compares builds).
    """
    if not native.available():
        raise RuntimeError("the native CPU attention kernel is unavailable (see the logged warning)")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    out = call(q.astype(jnp.float32), k_cache, v_cache, i32(layer), i32(query_start_loc),
               i32(seq_lens), i32(block_tables), i32(num_decodes),
               sm_scale=np.float32(sm_scale), decode_only=bool(decode_only))
    return out.astype(q.dtype)


def ragged_paged_attention(q, k_cache, v_cache, layer, query_start_loc, seq_lens, block_tables,
                           num_decodes, *, sm_scale, decode_only=False):
    """`paged_attention` where `native_supported`, else `xla.ragged_paged_attention`."""
    native_ok = native_supported(q.shape[-1], k_cache.dtype)
    attend = paged_attention if native_ok else xla.ragged_paged_attention
    return attend(q, k_cache, v_cache, layer, query_start_loc, seq_lens, block_tables,
                  num_decodes, sm_scale=sm_scale, decode_only=decode_only)
