"""The step bucket rules and warm-up shapes (pure Python), the packing of a step's host inputs, and
the warm-up itself on a tiny engine."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from llmjax import buckets as buckets_mod
from llmjax.buckets import StepBuckets
from llmjax.config import EngineConfig


@pytest.fixture(scope="module")
def buckets():
    return StepBuckets(EngineConfig(max_num_batched_tokens=128, max_num_seqs=64, block_size=8, max_model_len=8192))


def test_bucket_floors(buckets):
    assert buckets_mod.MIN_BLOCK_TOKENS == 2048  # the literals below: 256 blocks of 8 tokens
    # decode-only: S follows the request count, T = S (at least 8)
    assert buckets.shape(3, 3, 1) == (8, 4, 256)
    assert buckets.shape(33, 33, 1) == (64, 64, 256)
    # mixed: S >= T / 8, block tables >= MIN_BLOCK_TOKENS tokens wide
    assert buckets.shape(100, 2, 1) == (128, 16, 256)
    assert buckets.shape(100, 40, 1) == (128, 64, 256)
    assert buckets.shape(9, 1, 1) == (16, 2, 256)
    assert buckets.shape(9, 1, 300) == (16, 2, 512)  # 300 blocks of 8 tokens
    # capped by max_model_len: a 2048-token model has a single B
    small = StepBuckets(EngineConfig(max_num_batched_tokens=128, max_num_seqs=64, block_size=16, max_model_len=2048))
    assert {small.shape(1, 1, blocks)[2] for blocks in range(1, 129)} == {128}


def test_warmup_shapes_are_exactly_the_buckets_of_every_batch_within_the_smallest_tables(buckets):
    """Every batch a step can hold (decode-only: n requests of one token; otherwise n requests of
    `tokens` >= n new tokens in all) with block tables within the smallest bucket has its bucket
    among the warm-up shapes, and every warm-up shape is such a batch's bucket."""
    shapes = buckets.warmup_shapes()
    assert len(shapes) == len(set(shapes))
    b = buckets_mod.MIN_BLOCK_TOKENS // 8
    reachable = {(*buckets.shape(n, n, blocks), True) for n in range(1, 65) for blocks in (1, b)}
    reachable |= {(*buckets.shape(tokens, n, blocks), False)
                  for tokens in range(1, 129) for n in range(1, min(tokens, 64) + 1) for blocks in (1, b)}
    assert set(shapes) == reachable
    longer = buckets.warmup_shapes(max_context=4096)
    assert {b for *_, b, _ in longer} == {256, 512} and set(shapes) < set(longer)


def test_token_slice_equals_slicing_the_whole_sequence():
    from llmjax.request import Request
    from llmjax.sampling_params import SamplingParams

    request = Request("r", [11, 12, 13, 14], SamplingParams(), seed=0)
    request.output_token_ids = [15, 16, 17]
    for start in range(8):
        for end in range(start, 9):
            assert request.token_slice(start, end) == request.all_token_ids[start:end]


def test_host_inputs_round_trip_bit_for_bit():
    """Fields written into a `HostInputs` buffer on the host, `unpack` inside jit: every field back
    with its shape, dtype and bits (NaN payloads, -0.0, the top bit of uint32 included); fields do
    not overlap and fill the buffer; one layout object per bucket."""
    import dataclasses

    from llmjax.sampler import SAMPLING_DTYPES, SamplingInput
    from llmjax.step_input import HostInputs, StepInput, input_layout, unpack

    t, s, b = 6, 4, 3
    rng = np.random.default_rng(0)
    ints = lambda *shape: rng.integers(-2**31, 2**31, shape, dtype=np.int32)  # noqa: E731
    step = StepInput(token_ids=ints(t), token_source=ints(t), positions=ints(t), slot_mapping=ints(t),
                     query_start_loc=ints(s + 1), seq_lens=ints(s), block_tables=ints(s, b), logits_indices=ints(s),
                     num_decodes=np.int32(-7))
    floats = rng.standard_normal(s).astype(np.float32)
    floats[:3] = [np.float32("nan"), -0.0, np.inf]
    sampling = {}
    for f in dataclasses.fields(SamplingInput):
        dtype = np.dtype(SAMPLING_DTYPES[f.name])
        sampling[f.name] = (floats if dtype == np.float32 else np.array([0, 2**31 + 5, 2**32 - 1, 9], np.uint32)
                            if dtype == np.uint32 else rng.integers(0, 2, s).astype(bool) if dtype == np.bool_
                            else ints(s))
    inputs = HostInputs.pack(step, SamplingInput(**sampling))
    assert inputs.layout is input_layout(t, s, b) and inputs.buffer.dtype == np.int32
    assert inputs.layout.size == inputs.buffer.size == sum(np.prod(shape, dtype=int) for _, shape, _ in
                                                           inputs.layout.fields.values())
    back_step, back_sampling = jax.jit(unpack, static_argnums=1)(inputs.buffer, inputs.layout)
    expected = {**{f.name: getattr(step, f.name) for f in dataclasses.fields(StepInput)}, **sampling}
    got = {**{f.name: getattr(back_step, f.name) for f in dataclasses.fields(StepInput)},
           **{f.name: getattr(back_sampling, f.name) for f in dataclasses.fields(SamplingInput)}}
    for name, value in expected.items():
        value, back = np.asarray(value), np.asarray(got[name])
        assert back.shape == value.shape and back.dtype == value.dtype, name
        assert back.tobytes() == value.tobytes(), name


def test_warmup_compiles_the_common_buckets_and_leaves_the_cache_alone():
    """`LLMEngine.warmup` (the server's default) compiles every warm-up shape, writes only the null
    block (block 0) of the cache, and the engine then serves as a cold one does, compiling nothing
    for a batch within those shapes."""
    from tests.engine_helpers import run_to_completion, tiny_engine

    config = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    engine = tiny_engine(**config)
    rng = np.random.default_rng(0)  # a cache of noise: any write shows
    engine.runner.cache = jax.tree.map(lambda x: jax.numpy.asarray(rng.standard_normal(x.shape), x.dtype),
                                       engine.runner.cache)
    before = [np.asarray(x) for x in jax.tree.leaves(engine.runner.cache)]
    engine.warmup()
    after = [np.asarray(x) for x in jax.tree.leaves(engine.runner.cache)]
    for old, new in zip(before, after, strict=True):  # [layers, blocks, ...]: all but block 0 as they were
        np.testing.assert_array_equal(old[:, 1:], new[:, 1:])
    compiles = engine.runner.num_compiles
    warm = [o.outputs[0].token_ids for o in run_to_completion(engine, prompts)]
    assert engine.runner.num_compiles == compiles  # (compiled executables are shared: the cold engine comes after)
    cold = [o.outputs[0].token_ids for o in run_to_completion(tiny_engine(**config), prompts)]
    assert warm == cold


def test_warm_up_also_compiles_the_write_of_a_penalty_row(monkeypatch):
    """The first request with penalties (logits processing) after warm-up compiles nothing: warm-up
    compiled the write of its row too. (A fresh jitted write, so what earlier tests compiled does not
    hide a compile here.)"""
    from llmjax import runner as runner_module
    from llmjax.sampling_params import SamplingParams
    from tests.engine_helpers import run_to_completion, tiny_engine

    fresh = jax.jit(runner_module._write_penalty_row.__wrapped__, donate_argnums=(0,))
    monkeypatch.setattr(runner_module, "_write_penalty_row", fresh)
    engine = tiny_engine(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    engine.warmup()
    compiled = fresh._cache_size()
    params = SamplingParams(temperature=0.0, max_tokens=4, presence_penalty=0.5, logit_bias={7: -5.0}, min_tokens=2)
    [out] = run_to_completion(engine, [[5, 6, 7, 8, 9]], params)
    assert len(out.outputs[0].token_ids) == 4
    assert (compiled, fresh._cache_size()) == (1, 1)


def test_a_compile_outside_warm_up_is_counted_and_after_warm_up_warned(caplog):
    """Every step function compiled outside `warmup` counts (`num_serving_compiles`, the metrics'
    `step_compilations`); once warm-up has run, each is a bucket it missed and is logged as a
    warning naming the bucket. Top logprobs need no other compiled step. The runner gets its own
    (unshared) step function, so what earlier tests compiled does not hide a compile here."""
    import logging

    from llmjax.sampling_params import SamplingParams
    from tests.engine_helpers import run_to_completion, tiny_engine

    engine = tiny_engine(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    runner = engine.runner
    runner._step_fn, runner._traces = runner.step_function(runner.backend)
    prompt = [[5, 6, 7, 8, 9]]
    with caplog.at_level(logging.DEBUG, logger="llmjax.runner"):
        run_to_completion(engine, prompt)  # no warm-up yet: its prefill and decode buckets compile on use
    assert (runner.num_compiles, runner.num_serving_compiles) == (2, 2) and runner.serving_compile_seconds > 0
    assert [r.levelno for r in caplog.records] == [logging.DEBUG] * 2

    engine = tiny_engine(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    runner = engine.runner
    runner._step_fn, runner._traces = runner.step_function(runner.backend)
    t, s, b = runner.buckets.shape(1, 1, 1)
    runner.warmup([(t, s, b, True)])  # the decode bucket of one request only
    assert (runner.num_compiles, runner.num_serving_compiles) == (1, 0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmjax.runner"):
        run_to_completion(engine, prompt)  # its prefill (mixed) bucket was not warmed
        assert runner.num_serving_compiles == 1
        out = run_to_completion(engine, prompt, SamplingParams(max_tokens=3, logprobs=2))[0]
    assert [len(entry) for entry in out.outputs[0].logprobs] == [3] * 3  # the sampled token and the top 2
    assert runner.num_serving_compiles == 1 and runner.num_compiles == 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and caplog.records[0].levelno == logging.WARNING
    assert messages[0].startswith(f"compiled the step of bucket T={t} S=1 B={b} (mixed) on first use")
