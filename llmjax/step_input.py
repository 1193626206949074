"""`StepInput`: the padded arrays one engine step feeds the jitted forward (see DESIGN.md).

All arrays are int32 (sampling arrays aside), padded to bucket sizes T (tokens), S (requests)
and B (blocks per request). A new token that is still on the device (asynchronous scheduling)
has a `token_source` >= 0 instead of a value in `token_ids`; the step reads it from the previous
step's sampled tokens. Requests [0, num_decodes) have exactly one new token; padded
requests have zero new tokens and seq_len 0; padded tokens write to the null block (slot 0..).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    token_ids: jax.Array  # [T] new tokens, decodes first, then prefill chunks
    token_source: jax.Array  # [T] index of the token in the previous step's sampled tokens, -1: token_ids
    positions: jax.Array  # [T] their positions in their sequences
    slot_mapping: jax.Array  # [T] block_id * block_size + offset; padding -> null block
    query_start_loc: jax.Array  # [S+1] start of each request's tokens in the flat arrays
    seq_lens: jax.Array  # [S] context length of each request after this step
    block_tables: jax.Array  # [S, B] each request's blocks, padded with the null block
    logits_indices: jax.Array  # [S] flat index of each request's last token
    num_decodes: jax.Array  # [] requests [0, num_decodes) have one new token

    def replace(self, **changes) -> StepInput:
        return dataclasses.replace(self, **changes)


PackLayout = tuple  # (treedef, ((shape, dtype char), ...)): static, hashable


def pack(tree) -> tuple[np.ndarray, PackLayout]:
    """A pytree of host arrays (4-byte dtypes and bool) as one flat int32 buffer and its layout, so
    a step's inputs reach the device in one transfer instead of one per array. `unpack` inverts it
    inside the jitted step (slices and bit casts: free there)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [x.reshape(-1).view(np.int32) if x.dtype.itemsize == 4 else x.reshape(-1).astype(np.int32)
             for x in leaves]
    shapes = tuple((x.shape, x.dtype.char) for x in leaves)
    if any(x.dtype.itemsize != 4 and x.dtype != np.bool_ for x in leaves):
        raise TypeError(f"cannot pack {[x.dtype for x in leaves]} (4-byte dtypes and bool only)")
    return np.concatenate(parts), (treedef, shapes)


def unpack(buffer: jax.Array, layout: PackLayout):
    """The pytree `pack` flattened into `buffer` (traced: inside a jitted function)."""
    treedef, shapes = layout
    leaves, offset = [], 0
    for shape, char in shapes:
        size = math.prod(shape)
        x = buffer[offset : offset + size].reshape(shape)
        offset += size
        dtype = np.dtype(char)
        if dtype == np.bool_:
            x = x != 0
        elif dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, dtype)
        leaves.append(x)
    return jax.tree.unflatten(treedef, leaves)
