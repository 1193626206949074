"""Sampling inside the jitted step: temperature, top-k, top-p, min-p, per-request PRNG keys, logprobs.

Each request's key is `fold_in(key(seed), output_index)`, so a seeded request draws the same
tokens whatever else shares its batch. Greedy rows (temperature 0) take the argmax; when every
row is greedy the sort/filter work is skipped at run time (`lax.cond`).
Logprobs are of the model's raw distribution (before temperature and filtering), as vLLM reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingInput:
    """Per-request sampling arrays, `[S]` each (padded rows are greedy and ignored)."""

    temperature: jax.Array  # f32; 0 = greedy
    top_k: jax.Array  # i32; <= 0 = off
    top_p: jax.Array  # f32; 1 = off
    min_p: jax.Array  # f32; 0 = off
    seeds: jax.Array  # u32
    output_index: jax.Array  # i32: how many tokens the request has sampled so far


def _filtered_logits(logits: jax.Array, s: SamplingInput) -> jax.Array:
    """Scale by temperature and mask tokens outside top-k / top-p / min-p with -inf."""
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    scaled = logits / temp
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    ranks = jnp.arange(vocab)[None, :]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)[:, None]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (ranks < k) & (mass_before < s.top_p[:, None]) & (probs >= s.min_p[:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _random_sample(logits: jax.Array, s: SamplingInput) -> jax.Array:
    filtered = _filtered_logits(logits, s)
    keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(s.seeds, s.output_index)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[-1],)))(keys)
    sampled = jnp.argmax(filtered + gumbel, axis=-1)
    return jnp.where(s.temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def sample(logits: jax.Array, s: SamplingInput, num_top_logprobs: int = 0):
    """logits `[S, V]` float32 -> (tokens `[S]`, logprob of each token `[S]`,
    top ids `[S, num_top_logprobs]`, top logprobs `[S, num_top_logprobs]`)."""
    tokens = jax.lax.cond(
        jnp.all(s.temperature == 0),
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
        lambda: _random_sample(logits, s),
    )
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    token_logprobs = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_top_logprobs:
        top_lp, top_ids = jax.lax.top_k(logprobs, num_top_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, token_logprobs, top_ids, top_lp
