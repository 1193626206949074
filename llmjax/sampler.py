"""Sampling inside the jitted step: logits processing (logit bias, min_tokens, vLLM's penalties),
temperature, top-k, top-p, min-p, per-request PRNG keys, logprobs.

Keys: a request's 64-bit seed is split into two 32-bit words, and its key is
`fold_in(fold_in(fold_in(fold_in(key(0), seed_hi), seed_lo), sample_index), output_index)`, so a
seeded request draws the same random numbers whatever else shares its batch, and the n samples of
one request (`sample_index` 0..n-1) draw from distinct streams. The tokens are the same up to float
rounding: the logits of a row can differ in their last bits with the batch's shape (XLA picks its
matmul tiling by shape), so a draw that lands within that rounding of a token's CDF boundary, or a
token at the top-k / top-p / min-p cut, can go either way (as in vLLM without batch-invariant kernels).

Logits processing, in vLLM's order: logit bias, then min_tokens (EOS and stop ids at -inf while
fewer than min_tokens tokens are out), then the repetition penalty (tokens in the prompt or the
output: positive logits divided by it, negative ones multiplied), frequency (times the token's
count in the output) and presence (once if in the output) penalties. It reads `PenaltyState`, a
device-resident table with one row per request that uses any of this (the runner assigns rows),
and the step adds each kept sampled token to its row's counts on the device. When no request of
the step has a row, the processing is skipped at run time (`lax.cond`).

Greedy rows (temperature 0) take the argmax of the processed logits; when every row is greedy the
random-sampling work is skipped at run time, and so is the filtering when no row uses top-k, top-p
or min-p. A sampled token is drawn by inverse CDF with one uniform number per row (`inverse_cdf`:
a Gumbel draw per vocabulary entry costs ~35 ms a step on `[64, 49152]` on CPU); top-k / top-p /
min-p keep every token at least as probable as a per-row threshold (`keep_threshold`; top-p is
measured on what top-k and min-p keep, renormalised, as in vLLM), found by bisection, never by
sorting the vocabulary. Logprobs are of the model's raw distribution (before any processing,
temperature and filtering), as vLLM reports by default; the sampled tokens' logprobs (a pass of
`exp` over every row's vocabulary) are computed only when a row asks for them (`want_logprob`),
otherwise they are 0;
likewise the MAX_LOGPROBS most probable ids and their logprobs (`want_top`; a request takes the first
`logprobs` of them), so one compiled step serves requests with and without top logprobs.

The argmax is taken in two stages (`first_argmax`): the maximum of each chunk of the vocabulary,
then the first index of the maximum within the first chunk that holds it. Same result as
`jnp.argmax` (the first index of the maximum); XLA:CPU runs `jnp.argmax` over a long row as one
serial variadic reduction, about 10x slower than this on `[64, 49152]` logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingInput:
    """Per-request sampling arrays, `[S]` each (padded rows are greedy and ignored)."""

    temperature: jax.Array  # f32; 0 = greedy
    top_k: jax.Array  # i32; <= 0 = off
    top_p: jax.Array  # f32; 1 = off
    min_p: jax.Array  # f32; 0 = off
    seed_hi: jax.Array  # u32: the seed's high 32 bits
    seed_lo: jax.Array  # u32: its low 32 bits
    sample_index: jax.Array  # i32: which of the request's n samples this row is
    output_index: jax.Array  # i32: how many tokens the row has sampled so far
    penalty_row: jax.Array  # i32: the row's `PenaltyState` row; rows without processing: the scratch row
    processed: jax.Array  # bool: the row uses logits processing (has a real penalty row)
    keep: jax.Array  # bool: the row's sampled token is kept (counted into its penalty row)
    in_min_tokens: jax.Array  # bool: fewer than min_tokens tokens out: EOS and stop ids are masked
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    repetition_penalty: jax.Array  # f32; 1 = off
    want_logprob: jax.Array  # bool: the row's request asked for logprobs (its sampled token's logprob is returned)
    want_top: jax.Array  # bool: the row's request asked for top logprobs (`logprobs` >= 1)


SAMPLING_DTYPES = dict(temperature=np.float32, top_k=np.int32, top_p=np.float32, min_p=np.float32,
                       seed_hi=np.uint32, seed_lo=np.uint32, sample_index=np.int32, output_index=np.int32,
                       penalty_row=np.int32, processed=np.bool_, keep=np.bool_, in_min_tokens=np.bool_,
                       presence_penalty=np.float32, frequency_penalty=np.float32, repetition_penalty=np.float32,
                       want_logprob=np.bool_, want_top=np.bool_)  # each `SamplingInput` field's dtype on the host


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    """Per-request logits-processing tables, `[R, V]` each: one row per request using processing,
    the last row scratch (written by padding, never read with effect). Owned by the runner,
    donated to the step, which returns it with the kept tokens counted."""

    output_counts: jax.Array  # i32: occurrences of each token in the row's output
    prompt_mask: jax.Array  # bool: token occurs in the prompt
    logit_bias: jax.Array  # f32: added to the logits
    min_tokens_mask: jax.Array  # bool: EOS and stop ids, masked while `in_min_tokens`


def process_logits(logits: jax.Array, s: SamplingInput, state: PenaltyState) -> jax.Array:
    """Logit bias, penalties and min_tokens mask on the rows that use them; logits `[S, V]`.
    (`sample` skips it when no row uses processing.) A penalized logit stays finite (a repetition
    penalty may scale it past float32's range); only the mask makes -inf."""
    counts = state.output_counts[s.penalty_row]
    out = logits + state.logit_bias[s.penalty_row]
    seen = state.prompt_mask[s.penalty_row] | (counts > 0)
    rep = s.repetition_penalty[:, None]
    out = jnp.where(seen, jnp.where(out > 0, out / rep, out * rep), out)
    out = out - s.frequency_penalty[:, None] * counts - s.presence_penalty[:, None] * (counts > 0)
    largest = jnp.finfo(out.dtype).max
    out = jnp.clip(out, -largest, largest)
    out = jnp.where(s.in_min_tokens[:, None] & state.min_tokens_mask[s.penalty_row], -jnp.inf, out)
    return jnp.where(s.processed[:, None], out, logits)


def count_tokens(state: PenaltyState, tokens: jax.Array, s: SamplingInput) -> PenaltyState:
    """Add each kept sampled token of a processed row to its row's output counts (other rows add 0
    to the scratch row): `S` scattered adds into the donated table, in place."""
    inc = (s.processed & s.keep).astype(jnp.int32)
    return replace(state, output_counts=state.output_counts.at[s.penalty_row, tokens].add(inc))


CHUNK = 1024  # vocabulary entries per chunk of the two-stage reductions (argmax, inverse CDF)
_SEARCH_STEPS = 32  # bisection steps over a probability's bit pattern (at most 2^30 values)


def _chunks(x: jax.Array, fill: float) -> jax.Array:
    """`[S, V]` -> `[S, ceil(V / CHUNK), CHUNK]`, the tail padded with `fill`."""
    rows, vocab = x.shape
    n = -(-vocab // CHUNK)
    return jnp.pad(x, ((0, 0), (0, n * CHUNK - vocab)), constant_values=fill).reshape(rows, n, CHUNK)


def _row_sums(values: jax.Array) -> jax.Array:
    """`values` `[S, V]` summed over each row, chunk by chunk (`_chunks`)."""
    return _chunks(values, 0.0).sum(axis=-1).sum(axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` of `[S, V]` (the first index of each row's maximum) as int32, in two
    stages: per chunk the maximum (a plain reduction XLA parallelises and vectorises), then the
    argmax within the first chunk holding the row's maximum."""
    if x.shape[-1] <= CHUNK:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = _chunks(x, -jnp.inf)
    chunk = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)  # first chunk holding the maximum
    within = jnp.take_along_axis(blocks, chunk[:, None, None], axis=1)[:, 0]
    return (chunk * CHUNK + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def keep_threshold(probs: jax.Array, s: SamplingInput) -> jax.Array:
    """Per row of `probs` `[S, V]` (a distribution), the smallest probability that top-k, min-p and
    top-p keep, in vLLM's order: top-k and min-p first (in the order of decreasing probability a
    token is kept while its rank is below top_k and it is at least min_p times the largest), then
    top-p on what they keep, renormalised (a token is kept while the renormalised mass before it is
    below top_p); the first token always; then every token at least as probable as the last kept
    one (ties).

    Without sorting (XLA:CPU sorts `[64, 49152]` float32 values in about 0.55 s, their int32 bit
    patterns in 0.12 s; this takes ~45 ms): probabilities are >= 0, so their int32 bit patterns
    order like their values. A token of pattern b is kept by top-k iff fewer than top_k tokens
    have a larger pattern, and by top-p iff the kept mass of tokens with a larger pattern is below
    top_p times the kept mass; both are monotone in b, so each keeps the patterns from some B on,
    found exactly by bisection (one pass over the vocabulary a step, skipped when no row of the
    step uses that filter); min-p keeps those from min_p * max on."""
    vocab = probs.shape[-1]
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    largest = jnp.max(bits, axis=-1)
    none = jnp.full_like(largest, -1)

    def first_kept(values: jax.Array, limit: jax.Array) -> jax.Array:
        """The smallest pattern B such that `values` summed over the tokens above B stay below
        `limit` (inf: no limit, B = -1, every token)."""
        def step(_, bounds):  # invariant: B lies in (lo, hi]; hi satisfies the condition
            lo, hi = bounds
            mid = lo + (hi - lo) // 2
            above = _row_sums(jnp.where(bits > mid[:, None], values, 0.0))
            ok = above < limit
            return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

        return jax.lax.fori_loop(0, _SEARCH_STEPS, step, (none, largest))[1]

    def when_used(limit: jax.Array, bound) -> jax.Array:
        """`bound()` if some row has a finite `limit` (its filter on), else -1 (keep every token)."""
        return jax.lax.cond(jnp.any(jnp.isfinite(limit)), bound, lambda: none)

    # 1 and the vocabulary size are "off" (a sum that rounds above 1 must not cut the tail)
    k_limit = jnp.where((s.top_k > 0) & (s.top_k < vocab), s.top_k, jnp.inf)
    from_k = when_used(k_limit, lambda: first_kept(jnp.ones_like(probs), k_limit))
    from_min = jax.lax.bitcast_convert_type(s.min_p * jax.lax.bitcast_convert_type(largest, jnp.float32), jnp.int32)
    first = jnp.maximum(from_k, from_min)

    def from_p() -> jax.Array:
        kept = jnp.where(bits >= first[:, None], probs, 0.0)
        return first_kept(kept, jnp.where(s.top_p < 1, s.top_p * _row_sums(kept), jnp.inf))

    first = jnp.maximum(first, when_used(jnp.where(s.top_p < 1, s.top_p, jnp.inf), from_p))
    return jax.lax.bitcast_convert_type(jnp.maximum(first, 0), jnp.float32)


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Per row of `probs` `[S, V]` (non-negative, not necessarily normalised) and `u` `[S]` in
    [0, 1): the first index whose cumulative sum exceeds u times the row's sum, as int32, so index i
    is drawn with probability probs[i] / sum; never an index of probability 0 (rounding clamps to
    the last positive one); -1 for a row whose sum is not a positive number (NaN, from a temperature
    beyond float32's range with a masked token; 0, with every token masked), so a row never draws
    one of the padding indices past the vocabulary. Two stages: the chunk, from the chunks' sums,
    then the index within it."""
    blocks = _chunks(probs, 0.0)
    sums = blocks.sum(axis=-1)  # [S, C]
    cum = jnp.cumsum(sums, axis=-1)
    target = u * cum[:, -1]
    chunks = sums.shape[-1]
    last_chunk = chunks - 1 - jnp.argmax((sums > 0)[:, ::-1], axis=-1)
    chunk = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), last_chunk)
    before = jnp.where(chunk > 0, jnp.take_along_axis(cum, jnp.maximum(chunk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    within = jnp.take_along_axis(blocks, chunk[:, None, None], axis=1)[:, 0]  # [S, CHUNK]
    last = CHUNK - 1 - jnp.argmax((within > 0)[:, ::-1], axis=-1)
    index = jnp.minimum(jnp.sum(jnp.cumsum(within, axis=-1) <= (target - before)[:, None], axis=-1), last)
    drawable = cum[:, -1] > 0  # False for NaN too
    return jnp.where(drawable, chunk * CHUNK + index, -1).astype(jnp.int32)


def _row_key(hi: jax.Array, lo: jax.Array, sample_index: jax.Array, output_index: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), hi), lo)
    return jax.random.fold_in(jax.random.fold_in(key, sample_index), output_index)


def _random_sample(logits: jax.Array, s: SamplingInput) -> jax.Array:
    """Temperature rows: a draw from softmax(logits / temperature) restricted to what top-k, top-p
    and min-p keep (`keep_threshold`, skipped when no row filters), by `inverse_cdf` with one
    uniform number from the row's key; greedy rows, and a row with nothing to draw from (see
    `inverse_cdf`): the argmax, an id of the vocabulary whatever the logits."""
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    # less the row's largest (finite: `process_logits`), at most 0: a small temperature cannot make
    # them +inf, whose softmax is NaN
    probs = jax.nn.softmax((logits - jnp.max(logits, axis=-1, keepdims=True)) / temp, axis=-1)
    filters = (s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0)
    probs = jax.lax.cond(jnp.any(filters),
                         lambda: jnp.where(probs >= keep_threshold(probs, s)[:, None], probs, 0.0),
                         lambda: probs)
    keys = jax.vmap(_row_key)(s.seed_hi, s.seed_lo, s.sample_index, s.output_index)
    u = jax.vmap(lambda key: jax.random.uniform(key, ()))(keys)
    drawn = inverse_cdf(probs, u)
    return jnp.where((s.temperature > 0) & (drawn >= 0), drawn, first_argmax(logits))


def top_logprobs(logits: jax.Array, none: bool = False) -> tuple[jax.Array, jax.Array]:
    """The MAX_LOGPROBS largest log-softmax values of each row of `logits` `[S, V]`, largest first, and
    their ids: `[S, MAX_LOGPROBS]` each; past the vocabulary (V < MAX_LOGPROBS), and everywhere with
    `none`, -inf and id 0."""
    rows, vocab = logits.shape
    k = 0 if none else min(MAX_LOGPROBS, vocab)
    if k:  # the largest logits are the largest log-softmax values (a pass less than top_k of log_softmax)
        top, ids = jax.lax.top_k(logits, k)
        lp = top - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    else:
        lp, ids = jnp.zeros((rows, 0), jnp.float32), jnp.zeros((rows, 0), jnp.int32)
    pad = ((0, 0), (0, MAX_LOGPROBS - k))
    return jnp.pad(lp, pad, constant_values=-jnp.inf), jnp.pad(ids, pad)


def ranks(logits: jax.Array, chosen: jax.Array) -> jax.Array:
    """vLLM's rank of each row's chosen token, given its logit `chosen` `[S]`: how many of the row's
    logits `[S, V]` are at least as large (1 for the most probable), int32 `[S]`."""
    return jnp.sum(logits >= chosen[:, None], axis=-1, dtype=jnp.int32)


def sample(logits: jax.Array, s: SamplingInput, state: PenaltyState):
    """logits `[S, V]` float32 -> ((tokens `[S]`, logprob of each token `[S]`, its rank `[S]` (`ranks`),
    top ids `[S, MAX_LOGPROBS]`, top logprobs `[S, MAX_LOGPROBS]`), the updated `state`). Logprobs and
    ranks are of the raw distribution (vLLM's default); they are 0 and the top ids and logprobs 0 and
    -inf unless a row asks for them (`want_logprob`, `want_top`)."""
    def choose(scores: jax.Array) -> jax.Array:
        return jax.lax.cond(jnp.all(s.temperature == 0), lambda: first_argmax(scores),
                            lambda: _random_sample(scores, s))

    # Branches return only the tokens: a branch returning the [S, V] logits unchanged would copy them.
    tokens = jax.lax.cond(jnp.any(s.processed), lambda: choose(process_logits(logits, s, state)),
                          lambda: choose(logits))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    token_logprobs, token_ranks = jax.lax.cond(
        jnp.any(s.want_logprob), lambda: (chosen - jax.nn.logsumexp(logits, axis=-1), ranks(logits, chosen)),
        lambda: (jnp.zeros_like(chosen), jnp.zeros_like(tokens)))
    top_lp, top_ids = jax.lax.cond(jnp.any(s.want_top), lambda: top_logprobs(logits),
                                   lambda: top_logprobs(logits, none=True))
    return (tokens, token_logprobs, token_ranks, top_ids, top_lp), count_tokens(state, tokens, s)


PROMPT_LOGPROB_ROWS = 64  # rows of `prompt_logprobs` whose logits exist at once ([64, V] float32)


def prompt_logprobs(logits_of, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs of a step's tokens: row t of `hidden` `[T, D]` (a final hidden state, to which
    `logits_of` applies the LM head) predicts `targets[t]` (the next prompt token; -1: none wanted).
    Returns (the target's logprob `[T]` (0 where none), its rank `[T]` (`ranks`; 0 where none), top ids
    `[T, MAX_LOGPROBS]`, their logprobs `[T, MAX_LOGPROBS]`), of the raw distribution. The logits are
    made `PROMPT_LOGPROB_ROWS` rows at a time, so a long chunk never holds `[T, V]` of them."""

    def rows(block):
        h, target = block
        logits = logits_of(h)
        chosen = jnp.take_along_axis(logits, jnp.maximum(target, 0)[:, None], axis=-1)[:, 0]
        lp = jnp.where(target >= 0, chosen - jax.nn.logsumexp(logits, axis=-1), 0.0)
        rank = jnp.where(target >= 0, ranks(logits, chosen), 0)
        top_lp, top_ids = top_logprobs(logits)
        return lp, rank, top_ids, top_lp

    t, b = hidden.shape[0], min(PROMPT_LOGPROB_ROWS, hidden.shape[0])
    pad = -t % b
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, b, hidden.shape[1])
    targets = jnp.pad(targets, (0, pad), constant_values=-1).reshape(-1, b)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:t], jax.lax.map(rows, (hidden, targets)))
