"""Shared helpers for engine tests: tiny engines and an independent dense greedy reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llmjax.config import PRESETS, EngineConfig
from llmjax.engine import LLMEngine
from llmjax.outputs import OutputAccumulator, RequestOutput
from llmjax.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
REF_LEN = 128  # the dense reference pads every sequence to this length (one compilation)


def tiny_engine(preset: str = "tiny-gqa", **overrides) -> LLMEngine:
    cfg = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=8, max_model_len=REF_LEN,
               kv_cache_memory_bytes=2 << 20, attention_backend="xla", dtype="float32")
    cfg.update(overrides)
    return LLMEngine.from_config(preset, EngineConfig(**cfg), seed=0)


def engine_bytes_per_token(preset: str) -> int:
    """KV bytes per token of a preset in float32 (the tiny engines' dtype): sizes a pool in blocks."""
    return PRESETS[preset].kv_bytes_per_token(4)


def run_to_completion(engine: LLMEngine, prompts, params=GREEDY, check_invariants: bool = True):
    """Submit all prompts at once, step until done; returns the whole (accumulated) outputs in
    submission order."""
    ids = [engine.add_request(list(p), params) for p in prompts]
    return drain(engine, ids, check_invariants)


def drain(engine: LLMEngine, ids: list[str], check_invariants: bool = True) -> list[RequestOutput]:
    """Step until nothing is unfinished; the accumulated outputs of requests `ids`, in that order."""
    engine.scheduler.input_closed = True
    done = OutputAccumulator()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            done.add(delta)
        if check_invariants:
            engine.check_kv_invariants()
    engine.scheduler.input_closed = False
    assert all(done.outputs[i].finished for i in ids)
    return [done.outputs[i] for i in ids]


@functools.lru_cache(maxsize=4)
def _dense_logits_fn(graphdef):
    @jax.jit
    def logits(params, tokens):
        return nnx.merge(graphdef, params)(tokens[None])[0]

    return logits


def dense_greedy(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy continuation with the dense (no cache) forward: tokens and the logits behind each."""
    tokens, all_logits = list(prompt), []
    for _ in range(max_tokens):
        logits = dense_logits(engine, tokens)[-1]
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], all_logits


def assert_greedy_matches(got: list[int], expected: list[int], logits: list[np.ndarray], margin: float = 1e-4):
    """Equal, or diverging only where the reference scores both tokens within `margin` (a float near-tie)."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            gap = float(logits[i][b] - logits[i][a])
            assert gap < margin, f"token {i}: got {a}, expected {b}; the reference prefers {b} by {gap}"
            return
    assert len(got) == len(expected)


def dense_logits(engine: LLMEngine, tokens: list[int]) -> np.ndarray:
    """The dense (no cache) forward's logits `[len(tokens), V]` at every position of `tokens`
    (row i scores the token after tokens[: i + 1])."""
    assert len(tokens) <= REF_LEN
    padded = np.zeros(REF_LEN, np.int32)
    padded[: len(tokens)] = tokens
    logits = _dense_logits_fn(engine.runner.graphdef)(engine.runner.params, jnp.asarray(padded))
    return np.asarray(logits)[: len(tokens)]


def assert_logprob_ranks_and_texts(engine, entry, row: np.ndarray, k: int, atol: float) -> None:
    """vLLM's ranks against the reference logprobs `row`: each entry's is between 1 + the number of
    logprobs above its own and the number at least its own (up to `atol`), and the k top entries take
    1, 2, ..., k; each entry's text is its token's alone."""
    for t, e in entry.items():
        assert int((row > row[t] + atol).sum()) + 1 <= e.rank <= int((row >= row[t] - atol).sum()), (t, e)
        assert e.decoded_token == engine.tokenizer.token_to_text(t), (t, e)
    assert set(range(1, k + 1)) <= {e.rank for e in entry.values()}, entry
