"""Sampling against its definition: support and frequencies of top-k / top-p / min-p on a tiny vocabulary,
seeds, greedy rows, and validation of SamplingParams."""

import math
from dataclasses import replace

import jax
import numpy as np
import pytest

from llmjax import sampler
from llmjax.sampler import CHUNK, PenaltyState, SamplingInput, count_tokens, first_argmax, process_logits, sample
from llmjax.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

PROBS = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
N = 6000


def sampling_input(n: int, **fields) -> SamplingInput:
    """A `SamplingInput` of n rows: unprocessed, sampling at temperature 1, unless `fields` says otherwise."""
    defaults = dict(
        temperature=(1.0, np.float32), top_k=(0, np.int32), top_p=(1.0, np.float32), min_p=(0.0, np.float32),
        seed_hi=(0, np.uint32), seed_lo=(0, np.uint32), sample_index=(0, np.int32), output_index=(0, np.int32),
        penalty_row=(0, np.int32), processed=(False, bool), keep=(True, bool), in_min_tokens=(False, bool),
        presence_penalty=(0.0, np.float32), frequency_penalty=(0.0, np.float32), repetition_penalty=(1.0, np.float32),
        want_logprob=(True, bool), want_top=(False, bool),
    )
    arrays = {name: np.broadcast_to(np.asarray(fields.get(name, value), dtype), (n,)).copy()
              for name, (value, dtype) in defaults.items()}
    return SamplingInput(**arrays)


def empty_state(rows: int, vocab: int) -> PenaltyState:
    return PenaltyState(np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), bool),
                        np.zeros((rows, vocab), np.float32), np.zeros((rows, vocab), bool))


def draw(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3, seed_hi=0, sample_index=0):
    logits = np.tile(np.log(PROBS).astype(np.float32), (N, 1))
    s = sampling_input(N, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed_lo=seed,
                       seed_hi=seed_hi, sample_index=sample_index, output_index=np.arange(N))
    (tokens, logprobs, _, _, _), _ = jax.jit(sample)(logits, s, empty_state(1, len(PROBS)))
    return np.asarray(tokens), np.asarray(logprobs)


def expected_distribution(keep: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    p = np.where(keep, PROBS ** (1 / temperature), 0)
    return p / p.sum()


def assert_frequencies(tokens: np.ndarray, expected: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=len(PROBS))
    assert np.all(counts[expected == 0] == 0), f"tokens outside the support: {counts}"
    sigma = np.sqrt(N * expected * (1 - expected))
    assert np.all(np.abs(counts - N * expected) <= 5 * sigma + 1), f"{counts} vs {N * expected}"


@pytest.mark.parametrize(
    "kwargs, keep",
    [
        (dict(), [1, 1, 1, 1, 1, 1]),
        (dict(top_k=2), [1, 1, 0, 0, 0, 0]),
        (dict(top_k=-1), [1, 1, 1, 1, 1, 1]),
        (dict(top_p=0.7), [1, 1, 1, 0, 0, 0]),  # 0.40 + 0.25 < 0.7, so the third token is still needed
        (dict(top_p=0.65), [1, 1, 0, 0, 0, 0]),  # mass before the third token is 0.65: not < 0.65
        (dict(min_p=0.3), [1, 1, 1, 0, 0, 0]),  # keep p >= 0.3 * 0.40 = 0.12
        (dict(top_k=3, top_p=0.6), [1, 1, 0, 0, 0, 0]),
        # top-p measures what top-k and min-p keep, renormalised (vLLM's order): 0.40 / 0.65 >= 0.6
        (dict(top_k=2, top_p=0.6), [1, 0, 0, 0, 0, 0]),
        (dict(min_p=0.5, top_p=0.6), [1, 0, 0, 0, 0, 0]),
    ],
)
def test_filters_respect_their_support(kwargs, keep):
    tokens, _ = draw(**kwargs)
    assert_frequencies(tokens, expected_distribution(np.array(keep, bool)))


def reference_kept(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """One row, in float64 by sorting, in vLLM's order: (kept mask, each token's mass before it in
    sorted order among what top-k and min-p keep, renormalised). Top-k: ranks below top_k and ties of
    the last; min-p: at least min_p times the largest; then top-p on those: renormalised mass before
    below top_p; the first always; then ties of the last kept token."""
    order = np.argsort(-probs, kind="stable")
    srt = probs[order]
    by_k = srt >= srt[min(top_k, len(srt)) - 1] if top_k > 0 else np.ones(len(srt), bool)
    kept_k_min = by_k & (srt >= min_p * srt[0])
    kept_k_min[0] = True
    renormalised = np.where(kept_k_min, srt, 0.0) / srt[kept_k_min].sum()
    before = np.cumsum(renormalised) - renormalised
    keep = kept_k_min & (before < top_p)
    keep[0] = True
    mass_before = np.empty_like(before)
    mass_before[order] = before
    return probs >= srt[keep].min(), mass_before


def threshold_cases(rng, vocab):
    """Rows (probabilities, top_k, top_p, min_p): peaked and flat distributions, ties, each filter alone
    and together, small and large kept sets."""
    peaked = np.exp(rng.normal(0, 4, vocab))
    flat = np.exp(rng.normal(0, 0.3, vocab))
    ties = np.repeat(rng.random(vocab // 10 + 1), 10)[:vocab]
    rows = []
    for probs in (peaked, flat, ties):
        probs = (probs / probs.sum()).astype(np.float32)
        for top_k, top_p, min_p in [(0, 0.5, 0.0), (0, 0.9, 0.0), (0, 0.99, 0.0), (10, 1.0, 0.0), (64, 1.0, 0.0),
                                    (65, 1.0, 0.0), (700, 1.0, 0.0), (0, 1.0, 0.05), (0, 1.0, 0.9), (300, 0.95, 0.01),
                                    (40, 0.5, 0.0), (0, 0.7, 0.02), (200, 0.8, 0.05)]:
            rows.append((probs, top_k, top_p, min_p))
    return rows


def test_keep_threshold_matches_sorting():
    """`keep_threshold` keeps what sorting keeps; a token may differ only where the mass before it is
    within float32 rounding of top_p."""
    rng = np.random.default_rng(5)
    cases = threshold_cases(rng, 3000)
    probs = np.stack([c[0] for c in cases])
    s = sampling_input(len(cases), top_k=[c[1] for c in cases], top_p=[c[2] for c in cases],
                       min_p=[c[3] for c in cases])
    thresholds = np.asarray(jax.jit(sampler.keep_threshold)(probs, s))
    for row, (p, top_k, tp, mp) in enumerate(cases):
        expected, before = reference_kept(p.astype(np.float64), top_k, tp, mp)
        differ = (p >= thresholds[row]) != expected
        assert np.all(np.abs(before[differ] - tp) < 1e-5), (row, top_k, tp, mp, np.flatnonzero(differ)[:5])


def test_inverse_cdf_draws_in_proportion_across_chunks():
    vocab = 2 * CHUNK + 452  # a partial last chunk
    support = np.array([0, CHUNK - 1, CHUNK, CHUNK + 7, vocab - 1])
    weights = np.array([0.3, 0.1, 0.25, 0.05, 0.3], np.float32)
    probs = np.zeros((N, vocab), np.float32)
    probs[:, support] = 2 * weights  # not normalised: the draw divides by the row's sum
    u = np.random.default_rng(2).random(N).astype(np.float32)
    u[:3] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5]
    got = np.asarray(jax.jit(sampler.inverse_cdf)(probs, u))
    assert np.isin(got, support).all(), "drew a token of probability 0"
    assert got[0] == 0 and got[1] == vocab - 1
    counts = np.array([(got == i).sum() for i in support])
    sigma = np.sqrt(N * weights * (1 - weights))
    assert np.all(np.abs(counts - N * weights) <= 5 * sigma + 1), counts


@pytest.mark.parametrize("kwargs, kept", [(dict(top_k=2), 2), (dict(top_k=100), 100), (dict(top_p=0.999), None)])
def test_filters_on_a_large_vocabulary(kwargs, kept):
    """The sampler end to end on 300 tokens: six carry PROBS, the rest share a little mass; the
    support is what the filter keeps."""
    vocab = 300
    rng = np.random.default_rng(3)
    probs = rng.random(vocab) + 1  # distinct small masses: no ties at the top_k cut
    probs *= 0.002 / probs.sum()
    probs[rng.permutation(vocab)[:6]] = 0.998 * PROBS
    order = np.argsort(-probs, kind="stable")
    if kept is None:
        kept = int(((np.cumsum(probs[order]) - probs[order]) < kwargs["top_p"]).sum())
    logits = np.tile(np.log(probs).astype(np.float32), (N, 1))
    s = sampling_input(N, output_index=np.arange(N), **kwargs)
    (tokens, _, _, _, _), _ = jax.jit(sample)(logits, s, empty_state(1, vocab))
    tokens = np.asarray(tokens)
    assert np.isin(tokens, order[:kept]).all()
    main = order[:min(kept, 6)]
    expected = probs[main] / probs[order[:kept]].sum()
    counts = np.array([(tokens == i).sum() for i in main])
    assert np.all(np.abs(counts - N * expected) <= 5 * np.sqrt(N * expected * (1 - expected)) + 1), counts


def test_temperature_sharpens():
    tokens, _ = draw(temperature=0.5)
    assert_frequencies(tokens, expected_distribution(np.ones(6, bool), temperature=0.5))


def test_greedy_and_logprobs():
    tokens, logprobs = draw(temperature=0.0)
    assert np.all(tokens == 0)
    np.testing.assert_allclose(logprobs, np.log(PROBS[0]), rtol=1e-5)


@pytest.mark.parametrize("vocab", [7, CHUNK, 3 * CHUNK, 3 * CHUNK + 5])
def test_first_argmax_is_numpys_argmax_ties_included(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 4, (9, vocab)).astype(np.float32)  # few distinct values: many ties across chunks
    x[1] = -np.inf  # every entry the minimum
    x[2, -1] = 10.0  # the maximum in the (padded) last chunk
    x[3, 0] = 10.0
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(x)), np.argmax(x, axis=-1))


def test_token_logprobs_only_for_rows_that_ask():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (4, 3000)).astype(np.float32)
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    best = logits.argmax(-1)
    for want in ([False, True, False, True], [False] * 4):
        (tokens, logprobs, _, _, _), _ = jax.jit(sample)(
            logits, sampling_input(4, temperature=0.0, want_logprob=want), empty_state(1, 3000))
        np.testing.assert_array_equal(np.asarray(tokens), best)
        got = np.asarray(logprobs)
        for row in range(4):
            if want[row]:
                np.testing.assert_allclose(got[row], raw[row, best[row]], rtol=1e-5, atol=1e-5)
        if not any(want):  # no row asked: the logsumexp pass is skipped and the values are zeros
            np.testing.assert_array_equal(got, 0.0)


def numpy_log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_top_logprobs_are_the_top_k_of_the_raw_log_softmax():
    """A step in which a row wants top logprobs: per row the MAX_LOGPROBS most probable ids of the raw
    logits, most probable first, with their log-softmax values, and the sampled token's logprob; for
    greedy and sampled rows, on a vocabulary spanning several chunks, and on a processed row (its
    logit bias changes the draw, never the reported logprobs). A step in which no row wants them
    returns -inf and id 0; so does a vocabulary smaller than MAX_LOGPROBS past its end."""
    k = MAX_LOGPROBS
    rng = np.random.default_rng(k)
    rows, vocab = 6, 3 * CHUNK + 17
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    logits[4, vocab - 1] = 25.0  # a row whose maximum sits in the padded last chunk
    state = empty_state(rows + 1, vocab)
    bias = np.array(state.logit_bias)
    bias[5, np.argsort(-logits[5])[k + 3]] = 100.0  # row 5 samples a token outside its top k
    state = PenaltyState(state.output_counts, state.prompt_mask, bias, state.min_tokens_mask)
    s = sampling_input(rows, temperature=[0.0, 1.0, 0.7, 0.0, 1.3, 0.0], top_k=[0, 0, 5, 0, 0, 0],
                       seed_lo=np.arange(rows), penalty_row=np.arange(rows), processed=[False] * 5 + [True],
                       want_top=[False, True, False, False, False, False])
    (tokens, token_lp, ranks, top_ids, top_lp), _ = jax.jit(sample)(logits, s, state)
    tokens, token_lp, ranks, top_ids, top_lp = map(np.asarray, (tokens, token_lp, ranks, top_ids, top_lp))
    # vLLM's rank: how many raw logits are at least the sampled token's (row 5's bias is not in them)
    np.testing.assert_array_equal(ranks, (logits >= logits[np.arange(rows), tokens][:, None]).sum(-1))
    assert ranks[5] == k + 4 and (ranks[[0, 3]] == 1).all()
    ref = numpy_log_softmax(logits)
    order = np.argsort(-ref, axis=-1, kind="stable")[:, :k]
    assert top_ids.shape == top_lp.shape == (rows, k)
    np.testing.assert_array_equal(top_ids, order)
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(token_lp, ref[np.arange(rows), tokens], rtol=1e-5, atol=1e-5)
    assert tokens[5] == np.argsort(-logits[5])[k + 3]  # the bias decided the draw, not the reported logprobs
    np.testing.assert_array_equal(tokens[[0, 3]], logits[[0, 3]].argmax(-1))

    (same_tokens, _, _, top_ids, top_lp), _ = jax.jit(sample)(logits, replace(s, want_top=np.zeros(rows, bool)), state)
    np.testing.assert_array_equal(np.asarray(same_tokens), tokens)
    assert (np.asarray(top_lp) == -np.inf).all() and (np.asarray(top_ids) == 0).all()

    small = logits[:, :7]  # fewer ids than MAX_LOGPROBS: the rest of each row is padding
    (_, _, _, top_ids, top_lp), _ = jax.jit(sample)(small, s, empty_state(rows + 1, 7))
    order = np.argsort(-numpy_log_softmax(small), axis=-1, kind="stable")
    np.testing.assert_array_equal(np.asarray(top_ids)[:, :7], order)
    assert (np.asarray(top_lp)[:, 7:] == -np.inf).all() and (np.asarray(top_ids)[:, 7:] == 0).all()


def test_same_seed_same_draws_other_seed_differs():
    a, _ = draw(seed=11)
    b, _ = draw(seed=11)
    c, _ = draw(seed=12)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    high, _ = draw(seed=11, seed_hi=1)  # the high word of a 64-bit seed matters
    sibling, _ = draw(seed=11, sample_index=1)  # each of n samples has its own stream
    assert not np.array_equal(a, high) and not np.array_equal(a, sibling)
    extreme, _ = draw(seed=2**32 - 1, seed_hi=2**32 - 1)  # seed 2**64 - 1
    assert_frequencies(extreme, PROBS)


# --- logits processing against a per-token NumPy reference of vLLM's formulas -------------------------
def reference_processing(logits, prompt, output, bias, stop_ids, in_min_tokens, presence, frequency, repetition):
    """One row: logit bias, min_tokens, then repetition, frequency and presence penalties, token by token."""
    out = logits.astype(np.float64).copy()
    for token, value in bias.items():
        out[token] += value
    if in_min_tokens:
        for token in stop_ids:
            out[token] = -np.inf
    for token in range(len(out)):
        if token in prompt or token in output:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        count = output.count(token)
        out[token] -= frequency * count + (presence if count else 0.0)
    return out


def test_logits_processing_matches_the_reference():
    rng = np.random.default_rng(0)
    vocab, rows = 12, 5
    logits = rng.normal(0, 2, (rows, vocab)).astype(np.float32)
    cases = [  # (prompt, output, bias, stop ids, in_min_tokens, presence, frequency, repetition)
        ([1, 2, 3], [3, 3, 4], {}, [], False, 0.5, 0.0, 1.0),
        ([0, 5], [5, 6, 6, 6], {}, [], False, 0.0, 0.7, 1.0),
        ([1, 7, 8], [8, 9], {}, [], False, 0.0, 0.0, 1.8),
        ([2], [2, 3], {4: -100.0, 5: 3.5}, [0, 11], True, -1.5, -2.0, 0.4),
        ([4, 4], [], {}, [], False, 0.0, 0.0, 1.0),  # an unprocessed row: untouched
    ]
    state = empty_state(rows + 1, vocab)
    counts, prompt_mask = np.array(state.output_counts), np.array(state.prompt_mask)
    bias, stop_mask = np.array(state.logit_bias), np.array(state.min_tokens_mask)
    for row, (prompt, output, b, stops, *_) in enumerate(cases):
        counts[row] = np.bincount(output, minlength=vocab)
        prompt_mask[row] = np.bincount(prompt, minlength=vocab) > 0
        for token, value in b.items():
            bias[row, token] = value
        stop_mask[row, stops] = True
    state = PenaltyState(counts, prompt_mask, bias, stop_mask)
    s = sampling_input(rows, penalty_row=np.arange(rows), processed=[True] * 4 + [False],
                       in_min_tokens=[c[4] for c in cases], presence_penalty=[c[5] for c in cases],
                       frequency_penalty=[c[6] for c in cases], repetition_penalty=[c[7] for c in cases])
    got = np.asarray(jax.jit(process_logits)(logits, s, state))
    for row, (prompt, output, b, stops, in_min, pres, freq, rep) in enumerate(cases):
        if row == 4:
            expected = logits[row]
        else:
            expected = reference_processing(logits[row], prompt, output, b, stops, in_min, pres, freq, rep)
        np.testing.assert_allclose(got[row], expected, rtol=1e-5, atol=1e-5)
    # greedy sampling takes the argmax of the processed logits; logprobs stay those of the raw logits
    (tokens, logprobs, _, _, _), _ = jax.jit(sample)(logits, sampling_input(rows, temperature=0.0, **{
        f: getattr(s, f) for f in ("penalty_row", "processed", "in_min_tokens", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty")}), state)
    np.testing.assert_array_equal(np.asarray(tokens), got.argmax(-1))
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(logprobs), raw[np.arange(rows), got.argmax(-1)], rtol=1e-5, atol=1e-5)


def test_a_repetition_penalty_that_overflows_the_logits_draws_among_the_boosted_tokens():
    """The smallest valid repetition penalty scales the positive logits of seen tokens (2 and 3) past
    float32's range; each draw is one of them, never a token of probability 0 (a NaN softmax drew
    token 0)."""
    logits = np.array([[0.5, -1.0, 8.0, 6.0, 0.3, -0.2, 0.1, 0.0]], np.float32)
    state = replace(empty_state(2, 8), prompt_mask=np.isin(np.arange(8), [2, 3])[None].repeat(2, 0))
    penalty = SamplingParams(repetition_penalty=1.2e-38).repetition_penalty
    draws = set()
    for seed in range(16):
        s = sampling_input(1, processed=True, penalty_row=0, seed_lo=seed, repetition_penalty=penalty)
        (tokens, _, _, _, _), _ = jax.jit(sample)(logits, s, state)
        draws.add(int(np.asarray(tokens)[0]))
    assert draws == {2, 3}


def test_the_largest_repetition_penalty_keeps_the_order_of_logits_it_can_and_never_gives_nan():
    """Every token is in the prompt and its logit negative: the largest valid repetition penalty scales
    them all past float32's range. Row 0 (temperature 0.5) then draws among them all alike, never a
    NaN softmax's token; row 1's least negative logit (-0.5, scaled to about -1.7e38) still wins."""
    logits = np.array([[-5.0, -4.0, -9.0, -6.0], [-3.0, -0.5, -4.0, -2.0]], np.float32)
    state = replace(empty_state(3, 4), prompt_mask=np.ones((3, 4), bool))
    penalty = SamplingParams(repetition_penalty=3.4e38).repetition_penalty
    draws = [set(), set()]
    for seed in range(32):
        s = sampling_input(2, processed=True, penalty_row=[0, 1], seed_lo=seed, temperature=0.5,
                           repetition_penalty=penalty)
        (tokens, _, _, _, _), _ = jax.jit(sample)(logits, s, state)
        for row, token in enumerate(np.asarray(tokens).tolist()):
            draws[row].add(token)
    assert draws == [{0, 1, 2, 3}, {1}]


@pytest.mark.parametrize("top_k", [0, 5])  # 5: a row of the step filters, so `keep_threshold` runs
def test_a_row_with_nothing_to_draw_from_takes_an_id_of_the_vocabulary(top_k):
    """Row 0 has every token masked (min_tokens with every id a stop id): its probabilities are NaN.
    Row 1 runs at float32's largest temperature with one token masked: -inf / 3.4e38 is -inf, and
    every other logit scaled to about 0, a distribution without NaN. Row 0 takes its argmax (id 0:
    every logit -inf), never a padding index past the vocabulary (the inverse CDF's chunks are padded
    to CHUNK ids), and row 2's draw is the one it makes alone."""
    vocab = CHUNK + 100
    logits = np.random.default_rng(0).normal(size=(3, vocab)).astype(np.float32)
    mask = np.zeros((4, vocab), bool)
    mask[0], mask[1, 7] = True, True
    state = replace(empty_state(4, vocab), min_tokens_mask=mask)
    temperature = SamplingParams(temperature=3.4028234663852886e38).temperature
    s = sampling_input(3, processed=[True, True, False], penalty_row=[0, 1, 3], in_min_tokens=[True, True, False],
                       temperature=[1.0, temperature, 1.0], top_k=[0, 0, top_k], seed_lo=[1, 2, 3])
    (tokens, _, _, _, _), _ = jax.jit(sample)(logits, s, state)
    tokens = np.asarray(tokens).tolist()
    (alone, _, _, _, _), _ = jax.jit(sample)(logits[2:], sampling_input(1, top_k=top_k, seed_lo=3), state)
    assert tokens[0] == 0 and 0 <= tokens[1] < vocab and tokens[1] != 7 and tokens[2] == int(np.asarray(alone)[0])


def test_only_kept_tokens_of_processed_rows_are_counted():
    state = empty_state(4, 6)
    s = sampling_input(3, penalty_row=[0, 1, 3], processed=[True, True, False], keep=[True, False, True])
    counts = np.asarray(jax.jit(count_tokens)(state, np.array([2, 4, 5], np.int32), s).output_counts)
    expected = np.zeros((4, 6), np.int32)
    expected[0, 2] = 1  # row 1's token was not kept (a prefill chunk's); row 3 is unprocessed
    np.testing.assert_array_equal(counts, expected)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=99), "logprobs"), (dict(stop=[""]), "stop"),
        (dict(top_k=2**31), "top_k"), (dict(top_k=1.5), "top_k"), (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"), (dict(seed=1.0), "seed"), (dict(temperature=math.inf), "temperature"),
        (dict(temperature=math.nan), "temperature"), (dict(temperature=3.5e38), "temperature"),
        (dict(top_p=math.nan), "top_p"), (dict(n=0), "n"),
        (dict(n=65), "n"), (dict(max_tokens=2**31), "max_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=True), "logprobs"), (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(skip_special_tokens=1), "skip_special_tokens"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=3.5e38), "repetition_penalty"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(repetition_penalty=1e-39), "repetition_penalty"),  # 0 as a float32
        (dict(logit_bias={1: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"abc": 1.0}), "logit_bias"), (dict(logit_bias=[1, 2]), "logit_bias"),
    ],
)
def test_invalid_values_name_their_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ("END",)


def test_extreme_valid_values_are_accepted():
    for seed in (2**64 - 1, -(2**63), 1099511627776, -2):
        assert SamplingParams(seed=seed).seed == seed
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
    assert SamplingParams(logit_bias={"5": 1, 7: -100}).logit_bias == {5: 1.0, 7: -100.0}
    assert SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize("temperature", [1e-30, 1e-9, 0.005])
def test_a_positive_temperature_below_a_hundredth_is_raised_to_it_as_in_vllm(temperature, caplog):
    params = SamplingParams(temperature=temperature)
    assert (params.temperature, params.greedy) == (0.01, False)
    assert "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=0.01).temperature == 0.01
