"""How KV cache values are stored: a bfloat16 cache on CPU is kept as its bit pattern in uint16.

Why: XLA:CPU turns a gather from a bfloat16 array inside a loop (the layer scan, the attention
loops) into a float32 conversion of the whole array, i.e. of the whole cache on every step
(measured: a 25-block decode read of one layer took ~1.5 s instead of ~3 ms). A uint16 array is
gathered as is; the gathered rows are bitcast back to bfloat16 and widened to float32. The values
are exactly the bfloat16 ones. Every other dtype (and bfloat16 on an accelerator) is stored as is.

Contract for readers of a cache array: `value_dtype(cache.dtype)` is the dtype its values have,
`to_float32(rows)` widens gathered rows; writers store `to_storage(values, cache.dtype)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BF16_BITS = jnp.uint16  # storage dtype of a bfloat16 cache on CPU


def storage_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype a cache of `dtype` values is allocated with on `platform` (default: JAX's)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and (platform or jax.default_backend()) == "cpu":
        return jnp.dtype(BF16_BITS)
    return dtype


def value_dtype(stored) -> jnp.dtype:
    """The dtype of the values held in an array allocated as `stored`."""
    stored = jnp.dtype(stored)
    return jnp.dtype(jnp.bfloat16) if stored == BF16_BITS else stored


def to_storage(values: jax.Array, stored) -> jax.Array:
    """`values` rounded to the cache's value dtype, in its storage dtype."""
    stored = jnp.dtype(stored)
    if stored == BF16_BITS:
        return lax.bitcast_convert_type(values.astype(jnp.bfloat16), BF16_BITS)
    return values.astype(stored)


def to_values(rows: jax.Array) -> jax.Array:
    """Stored rows as values (bfloat16 for uint16 storage)."""
    if rows.dtype == BF16_BITS:
        return lax.bitcast_convert_type(rows, jnp.bfloat16)
    return rows


def to_float32(rows: jax.Array) -> jax.Array:
    """Stored rows widened to float32 (exact)."""
    return to_values(rows).astype(jnp.float32)
