"""The model runner: pads a scheduled batch into a `StepInput`, runs one jitted step, returns tokens.

Owns the KV cache arrays, the logits-processing tables (`PenaltyState`: one row per running
request that uses penalties, logit bias or min_tokens; see `llmjax.sampler`) and the jitted step.
The step is a pure function of (parameters, cache, penalty tables, StepInput, SamplingInput); the
cache and the tables are donated, so the KV write and the token counts happen in place and no
step copies the cache. Shapes are bucketed (powers of two) for tokens T, requests S
and blocks per request B; `decode_only` and the logprob count are static. A counter in the traced
body counts compilations: serving a workload twice compiles nothing the second time.

Bucket floors keep the number of compiled steps small where padding is (nearly) free: attention's
work follows the traced context lengths and request counts (loop bounds), not B or padded requests,
so B starts at `MIN_BLOCK_TOKENS` tokens of table; and a mixed step pads S to at least
T / `MIXED_TOKENS_PER_SEQ` (the padded rows cost only LM-head rows: < 4% of such a step).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from llmjax import parallel
from llmjax.attention.backend import get_attention_backend
from llmjax.config import EngineConfig
from llmjax.models.loader import LoadedModel
from llmjax.models.transformer import init_cache
from llmjax.request import Request
from llmjax.sampler import PenaltyState, SamplingInput, sample
from llmjax.sampling_params import MAX_LOGPROBS
from llmjax.scheduler import SchedulerOutput
from llmjax.step_input import StepInput

MIN_TOKEN_BUCKET = 8
MIN_BLOCK_BUCKET = 8
MIN_BLOCK_TOKENS = 1024  # block tables are at least this many tokens wide (capped by max_model_len)
MIXED_TOKENS_PER_SEQ = 8  # a mixed step (some request has > 1 token) has S >= T / 8


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at `hi`."""
    size = lo
    while size < n:
        size *= 2
    return min(size, hi)


def enable_compilation_cache(path: str | None = None) -> None:
    """Turn on JAX's persistent compilation cache (default: ~/.cache/llmjax/jax)."""
    path = path or os.environ.get("LLMJAX_COMPILATION_CACHE", str(Path.home() / ".cache" / "llmjax" / "jax"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclass
class StepResult:
    """Per scheduled request (in `SchedulerOutput.scheduled` order): sampled token and logprobs."""

    token_ids: np.ndarray  # [n] int32
    logprobs: np.ndarray  # [n] float32, the sampled token's logprob
    top_ids: np.ndarray  # [n, k]
    top_logprobs: np.ndarray  # [n, k]


_STEP_FUNCTIONS: dict[tuple, tuple] = {}


def _make_step_function(graphdef, backend, block_size: int, layout: parallel.Layout | None):
    """The jitted step for one model structure (and mesh); shared by runners of equal structure (so
    tests and experiments that build several engines compile each bucket once per process).
    With a `layout` the step is partitioned over its mesh, attention runs per device, and the
    shardings of every input and output are fixed, so they never trigger a recompilation.
    Returns (jitted function, a one-element list counting traces = compilations)."""
    traces = [0]
    if layout is not None:
        backend = parallel.sharded_attention(backend, layout.mesh)

    def step(params, cache, penalties: PenaltyState, step_input: StepInput, sampling: SamplingInput,
             decode_only: bool, num_top_logprobs: int):
        traces[0] += 1  # runs only while tracing
        model = nnx.merge(graphdef, params)
        logits, cache = model.forward_paged(cache, step_input, backend, block_size, decode_only)
        sampled, penalties = sample(logits, sampling, penalties, num_top_logprobs)
        return sampled, cache, penalties

    shardings = {}
    if layout is not None:  # the penalty tables are replicated, like the batch metadata
        (params, cache, *rest), (out, out_cache) = (layout.jit_shardings()[k] for k in ("in_shardings",
                                                                                         "out_shardings"))
        shardings = dict(in_shardings=(params, cache, layout.replicated, *rest),
                         out_shardings=(out, out_cache, layout.replicated))
    # static arguments by position: jit accepts no keyword arguments alongside in_shardings
    jitted = jax.jit(step, static_argnums=(5, 6), donate_argnums=(1, 2), **shardings)
    return jitted, traces


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_penalty_row(state: PenaltyState, row, counts, prompt_mask, logit_bias, min_tokens_mask) -> PenaltyState:
    """`state` with row `row` replaced (one compilation per vocabulary size)."""
    return PenaltyState(state.output_counts.at[row].set(counts), state.prompt_mask.at[row].set(prompt_mask),
                        state.logit_bias.at[row].set(logit_bias), state.min_tokens_mask.at[row].set(min_tokens_mask))


class ModelRunner:
    """Builds inputs and runs the jitted step. Not thread-safe (the engine loop owns it).

    With `config.tensor_parallel_size` > 1 the parameters and cache live sharded on a mesh
    (`self.layout`, see `llmjax.parallel`); `model` must then have passed `parallel.prepare_model`.
    """

    def __init__(self, model: LoadedModel, config: EngineConfig, num_blocks: int, kv_dtype,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.model_config = model.config
        self.config = config
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.backend = get_attention_backend(config.attention_backend)
        self.graphdef = model.graphdef
        tp = config.tensor_parallel_size
        self.layout = parallel.Layout.create(model, parallel.make_mesh(tp)) if tp > 1 else None
        self.num_blocks, self.kv_dtype = num_blocks, kv_dtype
        if self.layout is None:
            self.params = jax.device_put(model.params)
        else:
            self.params = self.layout.place_params(model.params)
        self.cache = self._empty_cache()
        self.eos_token_ids = eos_token_ids
        self.penalties = self._empty_penalties()
        self._penalty_rows: dict[str, int] = {}  # request id -> its row in `penalties`
        self._free_penalty_rows = list(range(config.max_num_seqs))  # row max_num_seqs is scratch
        self.num_compiles = 0
        self.time_prepare = 0.0
        self.time_device = 0.0
        mesh = None if self.layout is None else self.layout.mesh
        key = (model.config, str(jax.tree.leaves(model.params)[0].dtype), self.backend.name, self.block_size, mesh)
        if key not in _STEP_FUNCTIONS:
            _STEP_FUNCTIONS[key] = _make_step_function(model.graphdef, self.backend, self.block_size, self.layout)
        self._step_fn, self._traces = _STEP_FUNCTIONS[key]

    def _step(self, *args, decode_only: bool, num_top_logprobs: int):
        traces_before = self._traces[0]
        result = self._step_fn(*args, decode_only, num_top_logprobs)
        self.num_compiles += self._traces[0] - traces_before
        return result

    # --- input building ------------------------------------------------------------------------
    def shapes_for(self, num_tokens: int, num_reqs: int, max_blocks: int) -> tuple[int, int, int]:
        """Bucket (T, S, B) of a step of `num_tokens` tokens in `num_reqs` requests (mixed when
        `num_tokens > num_reqs`), the longest block table `max_blocks` long."""
        t = bucket(num_tokens, MIN_TOKEN_BUCKET, max(self.config.max_num_batched_tokens, MIN_TOKEN_BUCKET))
        s = bucket(num_reqs, self._min_seqs(t) if num_tokens > num_reqs else 1, self.config.max_num_seqs)
        b = bucket(max_blocks, self._min_blocks(), self.max_blocks_per_seq)
        return t, s, b

    def _min_seqs(self, t: int) -> int:
        """The smallest S bucket of a mixed step of T = t."""
        return max(1, t // MIXED_TOKENS_PER_SEQ)

    def _min_blocks(self) -> int:
        return max(MIN_BLOCK_BUCKET, MIN_BLOCK_TOKENS // self.block_size)

    def prepare(self, out: SchedulerOutput, block_tables: list[list[int]]) -> tuple[StepInput, SamplingInput, bool, int]:
        """Pad the scheduled batch into device arrays. Vectorised over tokens; loops over requests only."""
        sched = out.scheduled
        n_new = np.array([s.num_new_tokens for s in sched], np.int32)
        starts = np.array([s.start for s in sched], np.int32)
        total = int(n_new.sum())
        t, s, b = self.shapes_for(total, len(sched), max(len(bt) for bt in block_tables))

        tables = np.zeros((s, b), np.int32)
        for i, bt in enumerate(block_tables):
            tables[i, : len(bt)] = bt
        qsl = np.zeros(s + 1, np.int32)
        np.cumsum(n_new, out=qsl[1 : len(sched) + 1])
        qsl[len(sched) + 1 :] = total
        req_of_token = np.repeat(np.arange(len(sched)), n_new)
        positions = np.zeros(t, np.int32)
        positions[:total] = starts[req_of_token] + np.arange(total) - qsl[req_of_token]
        slots = np.zeros(t, np.int32)
        slots[:total] = tables[req_of_token, positions[:total] // self.block_size] * self.block_size + (
            positions[:total] % self.block_size
        )
        tokens = np.zeros(t, np.int32)
        tokens[:total] = np.concatenate(
            [s_.request.token_slice(s_.start, s_.start + s_.num_new_tokens) for s_ in sched]
        )
        seq_lens = np.zeros(s, np.int32)
        seq_lens[: len(sched)] = starts + n_new
        logits_idx = np.zeros(s, np.int32)
        logits_idx[: len(sched)] = qsl[1 : len(sched) + 1] - 1
        step = StepInput(
            token_ids=tokens, positions=positions, slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=tables, logits_indices=logits_idx, num_decodes=np.int32(out.num_decodes),
        )
        sampling = self._sampling_input(out, s)
        decode_only = out.num_decodes == len(sched)
        want_top = any((r.request.sampling_params.logprobs or 0) > 0 for r in sched)
        return step, sampling, decode_only, MAX_LOGPROBS if want_top else 0

    def _sampling_input(self, out: SchedulerOutput, s: int) -> SamplingInput:
        """Per-request sampling arrays; gives each request that uses logits processing its penalty row."""
        temp = np.zeros(s, np.float32)
        top_k = np.zeros(s, np.int32)
        top_p = np.ones(s, np.float32)
        min_p = np.zeros(s, np.float32)
        seeds = np.zeros(s, np.uint64)
        sample_index = np.zeros(s, np.int32)
        index = np.zeros(s, np.int32)
        rows = np.full(s, self.config.max_num_seqs, np.int32)
        processed, keep, in_min_tokens = np.zeros(s, bool), np.zeros(s, bool), np.zeros(s, bool)
        presence, frequency, repetition = np.zeros(s, np.float32), np.zeros(s, np.float32), np.ones(s, np.float32)
        for i, sr in enumerate(out.scheduled):
            p, r = sr.request.sampling_params, sr.request
            temp[i] = 0.0 if p.greedy else p.temperature
            top_k[i], top_p[i], min_p[i] = max(p.top_k, 0), p.top_p, p.min_p
            seeds[i], sample_index[i], index[i] = r.seed % 2**64, r.sample_index, len(r.output_token_ids)
            keep[i] = sr.samples
            if p.uses_logits_processing:
                rows[i], processed[i] = self._penalty_row(r), True
                in_min_tokens[i] = len(r.output_token_ids) < p.min_tokens
                presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        return SamplingInput(temp, top_k, top_p, min_p, (seeds >> 32).astype(np.uint32),
                             (seeds & 0xFFFFFFFF).astype(np.uint32), sample_index, index, rows, processed, keep,
                             in_min_tokens, presence, frequency, repetition)

    # --- device state ----------------------------------------------------------------------------------
    def _empty_cache(self):
        if self.layout is None:
            return init_cache(self.model_config, self.num_blocks, self.block_size, self.kv_dtype)
        return self.layout.init_cache(self.model_config, self.num_blocks, self.block_size, self.kv_dtype)

    def recover(self) -> bool:
        """After a failed step: whether the cache and penalty tables were lost (donated to a step that
        failed, or computed by it); if so they are rebuilt empty, and every row assignment is dropped,
        so the caller must recompute every running request and drop the prefix cache."""
        try:
            leaves = jax.tree.leaves((self.cache, self.penalties))
            if any(x.is_deleted() for x in leaves):
                raise RuntimeError("deleted")
            jax.block_until_ready(leaves)
            return False
        except Exception:
            self.cache, self.penalties = self._empty_cache(), self._empty_penalties()
            self._penalty_rows.clear()
            self._free_penalty_rows = list(range(self.config.max_num_seqs))
            return True

    # --- penalty rows --------------------------------------------------------------------------------
    def _empty_penalties(self) -> PenaltyState:
        rows, vocab = self.config.max_num_seqs + 1, self.model_config.vocab_size
        state = PenaltyState(np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), bool),
                             np.zeros((rows, vocab), np.float32), np.zeros((rows, vocab), bool))
        return jax.device_put(state, None if self.layout is None else self.layout.replicated)

    def _penalty_row(self, request: Request) -> int:
        """The request's row, assigned and filled from its tokens (vectorised) on first use."""
        row = self._penalty_rows.get(request.request_id)
        if row is not None:
            return row
        row = self._free_penalty_rows.pop()
        self._penalty_rows[request.request_id] = row
        p, vocab = request.sampling_params, self.model_config.vocab_size
        counts = np.bincount(np.asarray(request.output_token_ids, np.int64), minlength=vocab).astype(np.int32)
        prompt_mask = np.bincount(np.asarray(request.prompt_token_ids, np.int64), minlength=vocab) > 0
        bias = np.zeros(vocab, np.float32)
        for token, value in (p.logit_bias or {}).items():
            bias[token] = value
        stops = [t for t in p.stop_token_ids if t < vocab] + ([] if p.ignore_eos else list(self.eos_token_ids))
        min_tokens_mask = np.zeros(vocab, bool)
        min_tokens_mask[stops] = True
        self.penalties = _write_penalty_row(self.penalties, np.int32(row), counts, prompt_mask, bias,
                                            min_tokens_mask)
        return row

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted request's penalty row (a re-admitted one gets it rebuilt)."""
        row = self._penalty_rows.pop(request_id, None)
        if row is not None:
            self._free_penalty_rows.append(row)

    # --- execution ---------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepResult:
        t0 = time.perf_counter()
        step, sampling, decode_only, num_top = self.prepare(out, block_tables)
        t1 = time.perf_counter()
        (tokens, logprobs, top_ids, top_lp), self.cache, self.penalties = self._step(
            self.params, self.cache, self.penalties, step, sampling, decode_only=decode_only, num_top_logprobs=num_top
        )
        n = len(out.scheduled)
        result = StepResult(np.asarray(tokens)[:n], np.asarray(logprobs)[:n], np.asarray(top_ids)[:n],
                            np.asarray(top_lp)[:n])
        self.time_prepare += t1 - t0
        self.time_device += time.perf_counter() - t1
        return result

    def warmup(self, shapes: list[tuple[int, int, int, bool]]) -> None:
        """Compile the step for each (T, S, B, decode_only) bucket ahead of serving, with a progress bar.

        Runs on all-padding inputs (every write lands in the null block), so the cache is unchanged.
        """
        for t, s, b, decode_only in tqdm(shapes, desc="compiling step buckets", unit="bucket"):
            _, self.cache, self.penalties = self._step(self.params, self.cache, self.penalties,
                                                       *self.padding_inputs(t, s, b), decode_only=decode_only,
                                                       num_top_logprobs=0)
        jax.block_until_ready(self.cache)

    def padding_inputs(self, t: int, s: int, b: int) -> tuple[StepInput, SamplingInput]:
        """All-padding inputs of bucket (T, S, B): every write lands in the null block."""
        step = StepInput(
            token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), slot_mapping=np.zeros(t, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32), seq_lens=np.zeros(s, np.int32),
            block_tables=np.zeros((s, b), np.int32), logits_indices=np.zeros(s, np.int32),
            num_decodes=np.int32(0),
        )
        return step, self._sampling_input(SchedulerOutput(), s)

    def lower(self, t: int, s: int, b: int, decode_only: bool = False) -> jax.stages.Lowered:
        """The step of bucket (T, S, B) lowered for inspection (`.compile().as_text()` is its HLO); runs nothing."""
        return self._step_fn.lower(self.params, self.cache, self.penalties, *self.padding_inputs(t, s, b),
                                   decode_only, 0)

    def warmup_shapes(self, max_context: int | None = None) -> list[tuple[int, int, int, bool]]:
        """The common buckets for contexts up to `max_context` tokens (default: the smallest
        block-table bucket, `MIN_BLOCK_TOKENS`; longer contexts compile on first use): for each
        block-table bucket B, decode-only steps at each request-count bucket S, and mixed steps at
        each token bucket T with the fewest requests such a step pads to and with the most (a busy
        server). 20 shapes for T=512, S=64."""
        cfg = self.config
        min_blocks = bucket(1, self._min_blocks(), self.max_blocks_per_seq)
        max_blocks = min_blocks if max_context is None else -(-max_context // self.block_size)
        seq_buckets = _powers(1, cfg.max_num_seqs)
        token_buckets = _powers(MIN_TOKEN_BUCKET, max(cfg.max_num_batched_tokens, MIN_TOKEN_BUCKET))
        shapes: list[tuple[int, int, int, bool]] = []
        for b in _powers(min_blocks, bucket(max_blocks, min_blocks, self.max_blocks_per_seq)):
            for s in seq_buckets:
                t, s_, _ = self.shapes_for(s, s, b)
                shapes.append((t, s_, b, True))
            for t in token_buckets:
                for n in (self._min_seqs(t), min(t - 1, cfg.max_num_seqs)):  # n < t: mixed
                    t_, s_, _ = self.shapes_for(t, n, b)
                    shapes.append((t_, s_, b, False))
        return list(dict.fromkeys(shapes))


def _powers(lo: int, hi: int) -> list[int]:
    """The buckets `bucket` can return for lo..hi: lo, 2*lo, ... below hi, then hi."""
    out = [min(lo, hi)]
    while out[-1] < hi:
        out.append(min(out[-1] * 2, hi))
    return out
