"""A step's inputs: `StepInput` (tokens, positions, slots, block tables) and `SamplingInput`
(`llmjax.sampler`), written on the host into one int32 buffer (`HostInputs`) that reaches the
device in one transfer, and read back as the two dataclasses inside the jitted step (`unpack`).

All `StepInput` arrays are int32, padded to bucket sizes T (tokens), S (requests) and B (blocks
per request). A new token that is still on the device (asynchronous scheduling) has a
`token_source` >= 0 instead of a value in `token_ids`; the step reads it from the previous
step's sampled tokens. Requests [0, num_decodes) have exactly one new token; padded requests
have zero new tokens and seq_len 0; padded tokens write to the null block (slot 0..).

The buffer's layout depends only on the bucket (`input_layout`: one object per bucket in a
process, hashed and compared by its bucket, so as the step's static argument it costs a lookup).
Each field is a run of int32 words: float32 and uint32 fields are their bits, bool fields 0 / 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.sampler import SAMPLING_DTYPES, SamplingInput


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


@dataclass(frozen=True, eq=False)
class InputLayout:
    """Where each field lies in the buffer of bucket (T, S, B): `fields[name] = (offset, shape,
    dtype)`, the `StepInput` fields first, then the `SamplingInput` ones from `sampling_offset`;
    `words[name] = (offset, end)` for the fields whose host view is a plain slice of the buffer
    (one-dimensional, int32 or bool)."""

    bucket: tuple[int, int, int]
    fields: dict[str, tuple[int, tuple[int, ...], np.dtype]]
    words: dict[str, tuple[int, int]]
    sampling_offset: int
    size: int

    def __hash__(self) -> int:
        return hash(self.bucket)

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, InputLayout) and self.bucket == other.bucket)


@functools.lru_cache(maxsize=None)
def input_layout(t: int, s: int, b: int) -> InputLayout:
    """The layout of bucket (T, S, B); the same object every call."""
    shapes = dict(token_ids=(t,), token_source=(t,), positions=(t,), slot_mapping=(t,), query_start_loc=(s + 1,),
                  seq_lens=(s,), block_tables=(s, b), logits_indices=(s,), num_decodes=())
    specs = [(name, shapes[name], np.dtype(np.int32)) for name in (f.name for f in dataclasses.fields(StepInput))]
    specs += [(f.name, (s,), np.dtype(SAMPLING_DTYPES[f.name])) for f in dataclasses.fields(SamplingInput)]
    fields, words, offset, sampling_offset = {}, {}, 0, 0
    for name, shape, dtype in specs:
        if name == "temperature":
            sampling_offset = offset
        fields[name] = (offset, shape, dtype)
        if len(shape) == 1 and dtype in (np.int32, np.bool_):
            words[name] = (offset, offset + shape[0])
        offset += math.prod(shape)
    return InputLayout((t, s, b), fields, words, sampling_offset, offset)


class HostInputs:
    """One step's inputs on the host: a zeroed int32 `buffer` of `layout.size` words, written
    through `field` views. Owned by the step it is given to: not written once dispatched."""

    __slots__ = ("layout", "buffer")

    def __init__(self, layout: InputLayout):
        self.layout = layout
        self.buffer = np.zeros(layout.size, np.int32)

    def field(self, name: str) -> np.ndarray:
        """A writable view of one field, in its shape; bool fields are int32 0 / 1."""
        plain = self.layout.words.get(name)
        if plain is not None:
            return self.buffer[plain[0] : plain[1]]
        offset, shape, dtype = self.layout.fields[name]
        words = self.buffer[offset : offset + math.prod(shape)]
        if dtype != np.int32 and dtype != np.bool_:
            words = words.view(dtype)
        return words.reshape(shape)

    @classmethod
    def pack(cls, step: StepInput, sampling: SamplingInput) -> HostInputs:
        """The buffer of given host arrays (their shapes give the bucket)."""
        t, (s, b) = len(step.token_ids), np.shape(step.block_tables)
        inputs = cls(input_layout(t, s, b))
        for part in (step, sampling):
            for f in dataclasses.fields(part):
                inputs.field(f.name)[...] = getattr(part, f.name)
        return inputs

    def step_input(self) -> StepInput:
        """The `StepInput` fields as views (to read)."""
        return StepInput(**{f.name: self.field(f.name) for f in dataclasses.fields(StepInput)})

    def sampling_input(self) -> SamplingInput:
        """The `SamplingInput` fields as arrays of their dtypes (to read)."""
        return SamplingInput(**{f.name: self.field(f.name).astype(SAMPLING_DTYPES[f.name])
                                for f in dataclasses.fields(SamplingInput)})


def unpack(buffer: jax.Array, layout: InputLayout) -> tuple[StepInput, SamplingInput]:
    """The `StepInput` and `SamplingInput` in `buffer` (traced: inside a jitted function; slices and
    bit casts, free there)."""
    values = {}
    for name, (offset, shape, dtype) in layout.fields.items():
        x = buffer[offset : offset + math.prod(shape)].reshape(shape)
        if dtype == np.bool_:
            x = x != 0
        elif dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        values[name] = x
    step = StepInput(**{f.name: values[f.name] for f in dataclasses.fields(StepInput)})
    return step, SamplingInput(**{f.name: values[f.name] for f in dataclasses.fields(SamplingInput)})
