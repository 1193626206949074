"""The step bucket rules and warm-up shapes (pure Python: nothing is compiled here)."""

from __future__ import annotations

import pytest

from llmjax import buckets as buckets_mod
from llmjax.buckets import StepBuckets
from llmjax.config import EngineConfig


@pytest.fixture(scope="module")
def buckets():
    return StepBuckets(EngineConfig(max_num_batched_tokens=128, max_num_seqs=64, block_size=8, max_model_len=2048))


def test_bucket_floors(buckets):
    # decode-only: S follows the request count, T = S (at least 8)
    assert buckets.shape(3, 3, 1) == (8, 4, 128)
    assert buckets.shape(33, 33, 1) == (64, 64, 128)
    # mixed: S >= T / 8, block tables >= MIN_BLOCK_TOKENS tokens wide
    assert buckets.shape(100, 2, 1) == (128, 16, 128)
    assert buckets.shape(100, 40, 1) == (128, 64, 128)
    assert buckets.shape(9, 1, 1) == (16, 2, 128)
    assert buckets.shape(9, 1, 200) == (16, 2, 256)  # 200 blocks of 8 tokens


def test_warmup_shapes_cover_each_bucket_once(buckets):
    shapes = buckets.warmup_shapes()
    assert len(shapes) == len(set(shapes)) == 17
    assert {b for *_, b, _ in shapes} == {buckets_mod.MIN_BLOCK_TOKENS // 8}
    decode = {s for t, s, b, d in shapes if d}
    mixed = {t for t, s, b, d in shapes if not d}
    assert decode == {1, 2, 4, 8, 16, 32, 64}
    assert mixed == {8, 16, 32, 64, 128}
    for t, s, b, decode_only in shapes:  # each is the bucket of a real batch
        n = s if decode_only else min(s, t - 1)
        tokens = n if decode_only else t
        assert buckets.shape(tokens, n, b) == (t, s, b)
    longer = buckets.warmup_shapes(max_context=2048)
    assert {b for *_, b, _ in longer} == {128, 256} and set(shapes) < set(longer)


def test_token_slice_equals_slicing_the_whole_sequence():
    from llmjax.request import Request
    from llmjax.sampling_params import SamplingParams

    request = Request("r", [11, 12, 13, 14], SamplingParams(), seed=0)
    request.output_token_ids = [15, 16, 17]
    for start in range(8):
        for end in range(start, 9):
            assert request.token_slice(start, end) == request.all_token_ids[start:end]
