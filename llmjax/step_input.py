"""`StepInput`: the padded arrays one engine step feeds the jitted forward (see DESIGN.md).

All arrays are int32 (sampling arrays aside), padded to bucket sizes T (tokens), S (requests)
and B (blocks per request). A new token that is still on the device (asynchronous scheduling)
has a `token_source` >= 0 instead of a value in `token_ids`; the step reads it from the previous
step's sampled tokens. Requests [0, num_decodes) have exactly one new token; padded
requests have zero new tokens and seq_len 0; padded tokens write to the null block (slot 0..).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax


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
