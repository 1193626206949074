"""The engine on tiny random models: greedy outputs equal a dense no-cache reference under every
batching configuration, sampling, stops, abort, KV invariants, compilation counts."""

import dataclasses

import jax
import numpy as np
import pytest

from llmjax.engine import LLMEngine, RequestError
from llmjax.outputs import OutputAccumulator
from llmjax.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_helpers import (GREEDY, assert_greedy_matches, assert_logprob_ranks_and_texts, dense_greedy,
                                  dense_logits, drain,
                                  engine_bytes_per_token, run_to_completion, tiny_engine)

RNG = np.random.default_rng(1234)
SHARED = RNG.integers(3, 250, size=40).tolist()
PROMPTS = [SHARED + RNG.integers(3, 250, size=n).tolist() for n in (1, 7, 20)] + [
    RNG.integers(3, 250, size=n).tolist() for n in (5, 33, 70, 2)
]

CONFIGS = {
    "continuous": {},
    "no-chunked-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=128),
    "chunk-16": dict(max_num_batched_tokens=16),
    "chunk-24": dict(max_num_batched_tokens=24),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "lpm": dict(queue_order="lpm"),
    "max-seqs-1": dict(max_num_seqs=1),
    "max-seqs-4": dict(max_num_seqs=4),
    "max-seqs-64": dict(max_num_seqs=64, max_num_batched_tokens=256),
    "static": dict(scheduling_policy="static", batch_size=3),
    "dynamic": dict(scheduling_policy="dynamic", batch_size=3, max_delay=0.0),
}


@pytest.fixture(scope="module", params=["tiny-gqa", "tiny-mla"])
def reference(request):
    engine = tiny_engine(request.param)
    return request.param, [dense_greedy(engine, p, GREEDY.max_tokens) for p in PROMPTS]


# every config on tiny-gqa; on tiny-mla (its attention, not its scheduling, differs) one of each kind
CASES = [("tiny-gqa", c) for c in sorted(CONFIGS)] + \
        [("tiny-mla", c) for c in ("continuous", "no-chunked-prefill", "chunk-16", "max-seqs-4", "static", "lpm")]


@pytest.mark.parametrize("reference, config", CASES, indirect=["reference"])
def test_greedy_equals_dense_reference(reference, config):
    preset, expected = reference
    engine = tiny_engine(preset, **CONFIGS[config])
    outputs = run_to_completion(engine, PROMPTS)
    for out, (tokens, logits) in zip(outputs, expected):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logits)
    assert engine.kv.usage().used == 0


def test_preemption_keeps_outputs(reference):
    preset, expected = reference
    # 24 usable blocks of 8 tokens: too few for every prompt's growth at once, enough for any single one
    engine = tiny_engine(preset, kv_cache_memory_bytes=25 * 8 * engine_bytes_per_token(preset))
    outputs = run_to_completion(engine, PROMPTS)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.stats().queries == len(PROMPTS)  # a re-admission after preemption is no new query
    for out, (tokens, logits) in zip(outputs, expected):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logits)


def test_a_preempted_request_reports_the_cached_tokens_of_its_first_admission():
    """`num_cached_tokens` counts the prompt tokens the prefix cache served at the first admission, as
    vLLM's does: a request preempted and recomputed finds its own blocks (prompt and output) cached,
    which is no hit (it once reported them, even more tokens than its prompt has)."""
    engine = tiny_engine(kv_cache_memory_bytes=25 * 8 * engine_bytes_per_token("tiny-gqa"))
    outputs = run_to_completion(engine, PROMPTS)
    assert any(o.metrics.num_preemptions for o in outputs[3:])
    assert [o.num_cached_tokens for o in outputs[3:]] == [0] * 4  # prompts that share nothing


def test_prefix_cache_hits_shared_prompts():
    engine = tiny_engine()
    run_to_completion(engine, PROMPTS[:1])
    [out] = run_to_completion(engine, PROMPTS[1:2])
    assert out.num_cached_tokens == 40  # the 40 shared tokens are 5 whole blocks of 8


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone = run_to_completion(tiny_engine(), [PROMPTS[0]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    engine = tiny_engine()
    ids = [engine.add_request(PROMPTS[3], others), engine.add_request(PROMPTS[0], params),
           engine.add_request(PROMPTS[4], others)]
    assert drain(engine, ids)[1].outputs[0].token_ids == alone


def test_engine_seed_fixes_unseeded_sampling():
    """`EngineConfig.seed` draws the seeds of requests that give none: two engines with the same
    config seed sample the same unseeded tokens (temperature 1, three requests one after the other),
    another config seed samples other tokens, and each request draws a seed of its own (the same
    prompt twice samples differently). The model weights are the same in every engine."""
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)

    def unseeded(seed: int) -> list[list[int]]:
        engine = tiny_engine(seed=seed)
        prompts = (PROMPTS[0], PROMPTS[0], PROMPTS[1])
        return [run_to_completion(engine, [p], params)[0].outputs[0].token_ids for p in prompts]

    first, again, other = unseeded(11), unseeded(11), unseeded(12)
    assert first == again
    assert all(a != b for a, b in zip(first, other)), (first, other)
    assert first[0] != first[1]


def test_greedy_logprobs_are_the_reference_log_softmax():
    """`logprobs=k` on greedy requests batched together (k = 0, 1, 5, 20), and alone (k = 2): each
    token's entry holds the sampled token, then the top k ids of the dense reference's log-softmax at
    that position (scored along the engine's own tokens) most probable first, with their values; the
    sampled token is the reference's top one; the cumulative logprob sums the sampled tokens'."""
    engine = tiny_engine()
    runs = []
    for batch in ([(PROMPTS[0], 0), (PROMPTS[1], 1), (PROMPTS[3], 5), (PROMPTS[6], 20)], [(PROMPTS[4], 2)]):
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=k))
               for p, k in batch]
        runs += [(p, k, out) for (p, k), out in zip(batch, drain(engine, ids))]
    tol = 1e-4
    for prompt, k, out in runs:
        [c] = out.outputs
        assert len(c.token_ids) == len(c.logprobs) == 6
        logits = dense_logits(engine, prompt + c.token_ids)[len(prompt) - 1 : -1].astype(np.float64)
        ref = logits - logits.max(-1, keepdims=True)
        ref -= np.log(np.exp(ref).sum(-1, keepdims=True))  # NumPy log-softmax
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            best = np.sort(ref[i])[::-1]
            assert ref[i, token] > best[0] - tol, f"token {i}: {token} is not the reference's argmax"
            got = list(entry)
            assert got[0] == token and len(got) == max(k, 1), f"token {i}: {got} for logprobs={k}"
            # the top k of the reference, most probable first (up to float near-ties)
            assert all(ref[i, t] > best[k - 1] - tol for t in got[1:]), (i, got)  # none below the k-th
            assert all(ref[i, a] > ref[i, b] - tol for a, b in zip(got, got[1:])), (i, got)
            for t, value in entry.items():
                assert value.logprob == pytest.approx(ref[i, t], abs=tol), (i, t)
            assert_logprob_ranks_and_texts(engine, entry, ref[i], k, tol)
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                                                     abs=1e-4)


def test_stop_string_cuts_the_text():
    engine = tiny_engine()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    [full] = run_to_completion(engine, [PROMPTS[2]], params)
    text = full.outputs[0].text
    stop = text[10:12]
    [cut] = run_to_completion(engine, [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=30,
                                                                    ignore_eos=True, stop=[stop]))
    cut = cut.outputs[0]
    assert cut.text == text[: text.find(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop


def test_a_stop_string_must_end_after_the_first_min_tokens_tokens():
    """As in vLLM: the first `min_tokens` tokens can complete no stop string (as they can be no EOS);
    the next occurrence, ending in a later token's text, stops the request."""
    engine = tiny_engine()
    greedy = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    [full] = run_to_completion(engine, [PROMPTS[2]], SamplingParams(**greedy))
    ids, text_of = full.outputs[0].token_ids, engine.tokenizer.decode
    # a stop string that the min_tokens-th token completes and a later token completes again
    m, stop = next((m, text_of(ids[m - 1 : m])) for m in range(3, 20)
                   if text_of(ids[m - 1 : m]) and text_of(ids[m - 1 : m]) not in text_of(ids[: m - 1])
                   and text_of(ids[m - 1 : m]) in text_of(ids[m:]))
    [cut] = run_to_completion(engine, [PROMPTS[2]], SamplingParams(**greedy, stop=[stop], min_tokens=m))
    later = text_of(ids).index(stop, len(text_of(ids[:m])))
    assert (cut.outputs[0].text, cut.outputs[0].stop_reason) == (text_of(ids)[:later], stop)
    [early] = run_to_completion(engine, [PROMPTS[2]], SamplingParams(**greedy, stop=[stop], min_tokens=m - 1))
    assert early.outputs[0].text == text_of(ids[: m - 1])  # one token earlier it stops at the first


def test_stop_token_ids_and_max_tokens():
    engine = tiny_engine()
    [full] = run_to_completion(engine, [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    full = full.outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 8
    stop_id = full.token_ids[3]
    [cut] = run_to_completion(engine, [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                    stop_token_ids=[stop_id]))
    cut = cut.outputs[0]
    first = full.token_ids.index(stop_id)
    assert cut.token_ids == full.token_ids[: first + 1] and cut.stop_reason == stop_id


def _final_only_outputs(engine, prompts, params, abort_after: int | None = None):
    """Every output `step()` returns for FINAL_ONLY requests (after `abort_after` steps, all are aborted)."""
    final = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [engine.add_request(list(p), final) for p in prompts]
    outputs, steps = [], 0
    while engine.has_unfinished_requests():
        if steps == abort_after:
            outputs += [o for o in map(engine.abort, ids) if o is not None]
            break
        outputs += engine.step()
        steps += 1
    return ids, outputs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),  # text made once, when it finishes
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["a", "e", "x"]),
], ids=["plain", "logprobs", "n-3", "stop"])
def test_final_only_returns_one_output_equal_to_the_accumulated_deltas(params):
    prompts = PROMPTS[:4]
    expected = run_to_completion(tiny_engine(), prompts, params)
    engine = tiny_engine()
    ids, outputs = _final_only_outputs(engine, prompts, params)
    assert sorted(o.request_id for o in outputs) == sorted(ids)  # one output each
    by_id = {o.request_id: o for o in outputs}
    for rid, want in zip(ids, expected):
        got = by_id[rid]
        assert got.finished
        assert [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in got.outputs] == \
            [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in want.outputs]


def test_final_only_abort_returns_everything_generated_so_far():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2)
    engine = tiny_engine()
    ids, outputs = _final_only_outputs(engine, PROMPTS[:2], params, abort_after=6)
    assert sorted(o.request_id for o in outputs) == sorted(ids)
    for out in outputs:
        assert out.finished and [c.index for c in out.outputs] == [0, 1]
        for c in out.outputs:
            assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 40 and c.text == engine.tokenizer.decode(c.token_ids)
    assert engine.kv.usage().used == 0


def _summary(output):
    return (output.request_id, output.finished, output.error, [
        (c.index, c.text, list(c.token_ids), c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
        for c in output.outputs])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["a", "e", "x"]),
], ids=["plain", "logprobs", "n-3", "stop"])
def test_cumulative_outputs_are_the_deltas_so_far(params):
    """Every CUMULATIVE output equals the DELTA outputs of the same step and the steps before it,
    folded (`OutputAccumulator`); the ones returned earlier never change; an abort ends with everything."""
    cumulative = dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
    delta_engine, engine = tiny_engine(), tiny_engine()
    ids = [f"r{i}" for i in range(4)]
    for rid, prompt in zip(ids, PROMPTS[:4]):
        delta_engine.add_request(list(prompt), params, rid)
        engine.add_request(list(prompt), cumulative, rid)
    whole, returned, steps = OutputAccumulator(), [], 0
    while delta_engine.has_unfinished_requests():
        if steps == 5:  # abort one request midway
            expected = [o for o in [delta_engine.abort("r3")] if o is not None]
            got = [o for o in [engine.abort("r3")] if o is not None]
        else:
            expected, got = delta_engine.step(), engine.step()
        steps += 1
        assert [_summary(o) for o in got] == [_summary(whole.add(d)) for d in expected]
        returned += [(o, _summary(o)) for o in got]
    assert not engine.has_unfinished_requests() and engine.kv.usage().used == 0
    assert all(_summary(o) == seen for o, seen in returned)  # later steps did not change them
    assert {o.request_id for o, _ in returned if o.finished} == set(ids)


@pytest.mark.parametrize("overrides", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_more_samples_than_batch_rows_queue_and_give_the_same_samples(overrides):
    """`n` above `max_num_seqs` is served as vLLM serves it: the samples that find no row wait for one;
    each sample is the one a roomy engine makes (its seed and index fix it)."""
    params = SamplingParams(temperature=1.0, seed=3, n=5, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[:2]
    expected = run_to_completion(tiny_engine(), prompts, params)
    engine = tiny_engine(max_num_seqs=2, **overrides)
    got = run_to_completion(engine, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    assert engine.kv.usage().used == 0


def test_abort_frees_every_block():
    engine = tiny_engine()
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
        engine.check_kv_invariants()
    for rid in ids:
        engine.abort(rid)
    engine.check_kv_invariants()
    assert engine.kv.usage().used == 0 and not engine.has_unfinished_requests()
    assert engine.abort(ids[0]) is None


def test_too_long_request_is_refused_and_harms_nobody():
    """A prompt that leaves no room in max_model_len (128) is refused; one whose max_tokens would pass
    it stops there, finish reason "length" (vLLM's engine caps it; its OpenAI server refuses it, as
    ours does: tests/test_server.py)."""
    engine = tiny_engine()
    good = engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RequestError, match="maximum context length is 128 tokens"):
        engine.add_request(list(range(3, 131)), SamplingParams(max_tokens=20))
    capped = engine.add_request(list(range(3, 120)), SamplingParams(max_tokens=20, ignore_eos=True))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request([100000], GREEDY)
    out, capped_out = drain(engine, [good, capped])
    assert out.outputs[0].finish_reason == "length" and engine.kv.usage().used == 0
    assert capped_out.outputs[0].finish_reason == "length" and len(capped_out.outputs[0].token_ids) == 128 - 117


@pytest.mark.parametrize("prompt", [[5.7, 6.2], ["12"], [True, 5], {"prompt": "x"}, 7, [np.int64(5), 2.0]])
def test_a_prompt_of_non_integer_ids_is_refused(prompt):
    """Token ids are integers (numpy's too): a float, a string or a bool is refused, not turned into an id."""
    engine = tiny_engine()
    with pytest.raises(RequestError, match="sequence of integer token ids") as refused:
        engine.add_request(prompt, GREEDY)
    assert refused.value.param == "prompt" and not engine.has_unfinished_requests()
    with pytest.raises(RequestError, match="params must be a SamplingParams"):
        engine.add_request([5, 6], {"max_tokens": 3})
    [out] = run_to_completion(engine, [np.array([5, 6, 7], np.int32)])
    assert out.prompt_token_ids == [5, 6, 7] and out.outputs[0].finish_reason == "length"


def test_a_request_that_can_outgrow_the_pool_is_refused():
    """A pool smaller than max_model_len (128 tokens here; 10 usable blocks of 8 hold 80): a request
    whose prompt and max_tokens need more, or with max_tokens unset (it may grow to max_model_len),
    is refused at once; one that fits (81 tokens: its last is sampled, never written) runs beside
    them to the end, alone in the pool, synchronously and with asynchronous scheduling."""
    for async_scheduling in (False, True):
        engine = tiny_engine(kv_cache_memory_bytes=11 * 8 * engine_bytes_per_token("tiny-gqa"),
                             async_scheduling=async_scheduling)
        assert engine.num_blocks - 1 == 10
        good = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=81 - len(PROMPTS[0]),
                                                             ignore_eos=True))
        with pytest.raises(RequestError, match="can reach 82 tokens .its prompt and max_tokens.") as refused:
            engine.add_request([5] * 5, SamplingParams(max_tokens=77))
        assert refused.value.param == "max_tokens"
        with pytest.raises(RequestError, match="can reach 128 tokens .max_model_len."):
            engine.add_request([5] * 5, SamplingParams(max_tokens=None, ignore_eos=True))
        [out] = drain(engine, [good])
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 81 - len(PROMPTS[0])
        assert out.metrics.num_preemptions == 0


def test_second_run_compiles_nothing():
    engine = tiny_engine(enable_prefix_caching=False)  # with caching on, a rerun hits the cache: other shapes
    first = run_to_completion(engine, PROMPTS)
    compiles = engine.runner.num_compiles
    assert compiles <= 24  # bounded by the buckets (0 when earlier tests compiled them)
    second = run_to_completion(engine, PROMPTS)
    assert engine.runner.num_compiles == compiles
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def test_config_dtype_must_match_the_loaded_model():
    from llmjax.config import ConfigError, EngineConfig
    from llmjax.engine import LLMEngine
    from llmjax.models.loader import load_model
    from llmjax.tokenizer import load_tokenizer

    loaded = load_model("tiny-gqa", dtype=np.float32)
    tokenizer = load_tokenizer(loaded.source, loaded.config.eos_token_ids)
    with pytest.raises(ConfigError, match="bfloat16"):
        LLMEngine(loaded, tokenizer, EngineConfig(dtype="bfloat16", max_num_batched_tokens=64, max_num_seqs=8,
                                                  kv_cache_memory_bytes=2 << 20))


def test_max_model_len_beyond_the_models_context():
    """A `max_model_len` set above the model's context is refused; the default is capped at it, and
    so is the default token budget without chunked prefill, which follows it."""
    from llmjax.config import ConfigError, EngineConfig
    from llmjax.engine import LLMEngine
    from llmjax.models.loader import load_model
    from llmjax.tokenizer import load_tokenizer

    loaded = load_model("tiny-gqa", dtype=np.float32)
    loaded = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, max_position_embeddings=96))
    tokenizer = load_tokenizer(loaded.source, loaded.config.eos_token_ids)
    small = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=8, kv_cache_memory_bytes=2 << 20)
    for hand_set in (128, 2048):  # 2048 equals the default, set by hand all the same
        with pytest.raises(ConfigError, match="96 tokens"):
            LLMEngine(loaded, tokenizer, EngineConfig(max_model_len=hand_set, **small))
    assert LLMEngine(loaded, tokenizer, EngineConfig(max_model_len=96, **small)).config.max_model_len == 96
    engine = LLMEngine(loaded, tokenizer, EngineConfig(**small))
    assert EngineConfig().max_model_len > 96 and engine.config.max_model_len == 96
    assert engine.scheduler.config.max_model_len == 96
    unchunked = LLMEngine(loaded, tokenizer, EngineConfig(enable_chunked_prefill=False, max_num_seqs=8, block_size=8,
                                                          kv_cache_memory_bytes=2 << 20))
    assert unchunked.config.max_num_batched_tokens == 512 and unchunked.config.max_model_len == 96
    # a budget set by hand is checked against the capped context, as vLLM resolves the context first
    budget_96 = dict(enable_chunked_prefill=False, max_num_batched_tokens=96, max_num_seqs=8, block_size=8,
                     kv_cache_memory_bytes=2 << 20)
    assert LLMEngine(loaded, tokenizer, EngineConfig(**budget_96)).config.max_num_batched_tokens == 96
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(95\) < max_model_len \(96\)"):
        LLMEngine(loaded, tokenizer, EngineConfig(**{**budget_96, "max_num_batched_tokens": 95}))
    with pytest.raises(RequestError, match="maximum context length is 96"):
        engine.add_request([5] * 96, SamplingParams(max_tokens=10))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_narrower_kv_cache_than_the_weights(kv_dtype):
    """`kv_cache_dtype` below the weights' float32: the same budget holds twice the blocks, and greedy
    outputs follow the dense float32 reference up to the cache's rounding (near-ties within 0.05)."""
    wide = tiny_engine()
    narrow = tiny_engine(kv_cache_dtype=kv_dtype)
    assert {x.dtype.itemsize for x in jax.tree.leaves(narrow.runner.cache)} == {2}  # (bfloat16 may be held as bits)
    assert abs(narrow.num_blocks - 2 * wide.num_blocks) <= 1
    prompts = [RNG.integers(3, 250, size=n).tolist() for n in (5, 19, 33)]
    outputs = run_to_completion(narrow, prompts)
    for prompt, out in zip(prompts, outputs):
        expected, logits = dense_greedy(narrow, prompt, GREEDY.max_tokens)
        assert_greedy_matches(out.outputs[0].token_ids, expected, logits, margin=0.05)


def _deltas(engine, prompts, params) -> list[list]:
    """Every delta output of each prompt's request, stepping until all finished."""
    ids = [engine.add_request(list(p), params) for p in prompts]
    deltas: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
        engine.check_kv_invariants()
    return [deltas[i] for i in ids]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),  # the plain stream's own path
    SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["a", "e", "x"]),
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=7, ignore_eos=True),
], ids=["plain", "logprobs", "stop", "n-2"])
def test_stream_interval_outputs_the_first_token_then_every_interval_tokens_then_the_rest(params):
    prompts = PROMPTS[:3]
    every_token = _deltas(tiny_engine(), prompts, params)
    by_four = _deltas(tiny_engine(stream_interval=4), prompts, params)
    for want, got in zip(every_token, by_four):
        whole = [OutputAccumulator(), OutputAccumulator()]
        for acc, deltas in zip(whole, (want, got)):
            for delta in deltas:
                acc.add(delta)
        [expected], [actual] = (acc.outputs.values() for acc in whole)
        assert [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in actual.outputs] == \
            [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in expected.outputs]
        assert got[-1].finished and not any(d.finished for d in got[:-1])
        assert len(actual.metrics.token_times) == len(expected.metrics.token_times)  # every step's time kept
        if params.n > 1:  # an output every step, as without an interval
            assert len(got) == len(want)
        else:  # the first token, then full intervals, then what is left when it finishes
            rest = len(expected.outputs[0].token_ids) - 1
            counts = [len(d.outputs[0].token_ids) for d in got]
            assert counts == [1] + [4] * (rest // 4) + ([rest % 4] if rest % 4 else [])


def _assert_batches(engine: LLMEngine, requests: dict[str, SamplingParams], batches: list[set[str]]) -> None:
    """Run `requests` (request id -> params, prompts from PROMPTS) to completion; assert that each
    step ran samples of one of `batches` (request ids) only, the batches one after another, each
    whole."""
    steps: list[set[str]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        if not out.empty:
            steps.append({r.owner.request_id for r in out.requests})
        return out

    engine.scheduler.schedule = recorded
    for (request_id, params), prompt in zip(requests.items(), PROMPTS):
        engine.add_request(prompt, params, request_id)
    drain(engine, list(requests))
    assert engine.kv.usage().used == 0
    batch, seen = 0, [set() for _ in batches]
    for step in steps:
        while not step <= batches[batch]:
            assert seen[batch] == batches[batch], (steps, batches)
            batch += 1
            assert batch < len(batches), (steps, batches)
        seen[batch] |= step
    assert seen == batches, (steps, batches)


@pytest.mark.parametrize("policy, prefix_caching", [(dict(scheduling_policy="static"), True),
                                                    (dict(scheduling_policy="dynamic", max_delay=0.0), False)],
                         ids=["static-held-samples", "dynamic-all-samples-queued"])
def test_a_static_batch_holds_whole_requests_and_counts_their_samples(policy, prefix_caching):
    """`batch_size` counts sequences (n samples count n) and a batch takes whole requests in queue
    order: with 3 sequences a batch, a (n=2) runs alone, then b (n=2) and c (n=1) together; in a
    batch {d (n=2, one token), e}, d's held-back sample still runs in d's batch, before f's."""
    engine = tiny_engine(max_num_seqs=4, batch_size=3, enable_prefix_caching=prefix_caching, **policy)
    two, one = SamplingParams(n=2, max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)
    _assert_batches(engine, {"a": two, "b": two, "c": one}, [{"a"}, {"b", "c"}])
    first_token = SamplingParams(n=2, max_tokens=1, ignore_eos=True)
    _assert_batches(engine, {"d": first_token, "e": one, "f": one}, [{"d", "e"}, {"f"}])
    with pytest.raises(RequestError, match=r"n \(4\) is more than the batch size \(3\)"):
        engine.add_request(PROMPTS[0], SamplingParams(n=4))
    assert not engine.has_unfinished_requests()


def test_a_requests_later_samples_keep_its_place_in_the_queue():
    """With prefix caching, samples 1..n-1 wait for sample 0's first token (its prompt's pages are then
    cached); released, they go before the requests that arrived after theirs (FCFS), not behind them."""
    engine = tiny_engine(max_num_seqs=1, max_num_batched_tokens=64)
    engine.add_request(list(range(10, 30)), SamplingParams(n=2, max_tokens=3, ignore_eos=True), request_id="A")
    engine.add_request(list(range(40, 60)), SamplingParams(max_tokens=3, ignore_eos=True), request_id="B")
    engine.add_request(list(range(70, 90)), SamplingParams(max_tokens=3, ignore_eos=True), request_id="C")
    order = []
    while engine.has_unfinished_requests():
        engine.step()
        order += [r.request_id for r in engine.scheduler.running if r.request_id not in order]
    assert order == ["A#0", "A#1", "B", "C"]
