"""The model runner: writes a `SchedulerOutput`, padded to its bucket, into a step's input buffer,
dispatches one jitted step, fetches its sampled tokens.

Owns the KV cache arrays, the per-row sampling parameters and logits-processing tables
(`PenaltyState`, see `llmjax.sampler`; one row per batch row, i.e. per running request, plus a
scratch row) and the jitted step. It never reads `Request` objects: everything comes from the
scheduler's arrays and its `RowInit`s.

The step is a pure function of (parameters, cache, penalty tables, the previous step's sampled
tokens, StepInput, SamplingInput); the last two are written on the host into one int32 buffer
laid out per bucket (`llmjax.step_input.HostInputs`: one host-to-device transfer a step, no
packing pass, and a static layout argument that costs a lookup). The cache and the tables are
donated, so the KV write and the token counts happen in place and no step copies the cache. A
new token still on the device (the scheduler's `token_source`) is read from the previous step's
sampled tokens inside the step, so step N+1 can be dispatched before step N's tokens reach the
host (asynchronous scheduling).
Shapes are the scheduler's buckets (`llmjax.buckets`); the input layout (one per bucket) and
`decode_only` are static arguments. A step with prompt logprobs to compute (`SchedulerOutput.prompt_targets`) is a variant of
its bucket compiled on first use (warm-up leaves it out): it also applies the LM head to every new
token, `PROMPT_LOGPROB_ROWS` rows at a time, and returns their logprobs. A counter in the traced
body counts compilations: serving a workload twice compiles nothing the second time. A step's results come back in one device-to-host transfer.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from llmjax import parallel
from llmjax.attention.backend import get_attention_backend
from llmjax.buckets import Shape, StepBuckets
from llmjax.config import ConfigError, EngineConfig
from llmjax.models.loader import LoadedModel
from llmjax.models.transformer import init_cache
from llmjax.sampler import PenaltyState, prompt_logprobs, sample
from llmjax.sampling_params import MAX_LOGPROBS
from llmjax.scheduler import RowInit, SchedulerOutput
from llmjax.step_input import HostInputs, InputLayout, input_layout, unpack

log = logging.getLogger(__name__)


def enable_compilation_cache(path: str | None = None) -> None:
    """Turn on JAX's persistent compilation cache (default: ~/.cache/llmjax/jax). A `path` given
    that cannot be a writable directory is a ConfigError (JAX would only warn, and compile anew in
    every process)."""
    if path is not None:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"compilation_cache_dir {path!r} cannot be a directory: {exc}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"compilation_cache_dir {path!r} is not a writable directory")
    path = path or os.environ.get("LLMJAX_COMPILATION_CACHE", str(Path.home() / ".cache" / "llmjax" / "jax"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class PromptLogprobs(NamedTuple):
    """Per new token of a step (flat, as `SchedulerOutput.token_ids`): the logprob and rank of the prompt
    token after it (`SchedulerOutput.prompt_targets`; 0 where it has none), the MAX_LOGPROBS most
    probable ids there and their logprobs."""

    logprobs: np.ndarray  # [N] float32
    ranks: np.ndarray  # [N] int32
    top_ids: np.ndarray  # [N, k] int32
    top_logprobs: np.ndarray  # [N, k] float32


@dataclass
class StepResult:
    """Per scheduled request (in `SchedulerOutput.requests` order): sampled token and logprobs; and the
    prompt logprobs of a step that had prompt targets."""

    token_ids: np.ndarray  # [n] int32
    logprobs: np.ndarray  # [n] float32, the sampled token's logprob
    ranks: np.ndarray  # [n] int32, the sampled token's rank (`sampler.ranks`)
    top_ids: np.ndarray  # [n, k]
    top_logprobs: np.ndarray  # [n, k]
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class InFlight:
    """A dispatched step: its device outputs, not yet waited for. `tokens` ([max_num_seqs] int32) feeds
    the next step; `packed` ([S, 3 + 2 * MAX_LOGPROBS] int32: token, logprob bits, rank, top ids, top
    logprob bits) is what `fetch` brings to the host; `prompt` ([T, 2 + 2 * MAX_LOGPROBS] int32: logprob
    bits, rank, top ids, top logprob bits) the prompt logprobs of a step with prompt targets, for its
    `num_tokens` tokens."""

    num_requests: int
    tokens: jax.Array
    packed: jax.Array
    num_tokens: int = 0
    prompt: jax.Array | None = None


_STEP_FUNCTIONS: dict[tuple, tuple] = {}


def release_compiled_steps() -> None:
    """Forget every compiled step of this process (the shared step functions and JAX's caches).

    Each XLA:CPU executable keeps its machine code in memory mappings of its own, and Linux caps a
    process's mappings (`vm.max_map_count`, 65530 by default); past the cap XLA aborts the process
    while compiling or loading an executable. A process that builds many differently shaped engines
    one after the other (a test suite, a sweep of configurations) calls this between them. Engines
    still in use stay correct: their next step compiles again."""
    _STEP_FUNCTIONS.clear()
    jax.clear_caches()


def _make_step_function(graphdef, param_tree, backend, block_size: int, layout: parallel.Layout | None,
                        max_num_seqs: int):
    """The jitted step for one model structure (config, parameter tree, shapes and dtypes) and mesh;
    shared by runners of equal structure (so tests and experiments that build several engines
    compile each bucket once per process). The parameters are passed as the flat leaves of
    `param_tree` (flattening flax's State on every call costs more than the rest of the arguments).
    With a `layout` the step is partitioned over its mesh, attention runs per device, and the
    shardings of every input and output are fixed, so they never trigger a recompilation.
    Returns (jitted function, a one-element list counting traces = compilations)."""
    traces = [0]
    if layout is not None:
        backend = parallel.sharded_attention(backend, layout.mesh)

    def step(params, cache, penalties: PenaltyState, prev_tokens, inputs, layout: InputLayout,
             decode_only: bool, prompt_targets):
        traces[0] += 1  # runs only while tracing
        step_input, sampling = unpack(inputs, layout)  # written on the host (`HostInputs`)
        params = jax.tree.unflatten(param_tree, params)
        src = step_input.token_source
        tokens = jnp.where(src >= 0, prev_tokens[jnp.clip(src, 0, max_num_seqs - 1)], step_input.token_ids)
        step_input = step_input.replace(token_ids=tokens)
        model = nnx.merge(graphdef, params)
        hidden, cache = model.forward_paged(cache, step_input, backend, block_size, decode_only)
        (ids, lp, rank, top_ids, top_lp), penalties = sample(model.logits(hidden[step_input.logits_indices]), sampling,
                                                       penalties)
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)  # noqa: E731
        packed = jnp.concatenate([ids[:, None], bits(lp)[:, None], rank[:, None], top_ids, bits(top_lp)], axis=1)
        padded = jnp.zeros(max_num_seqs, jnp.int32).at[: ids.shape[0]].set(ids[:max_num_seqs])
        prompt = None
        if prompt_targets is not None:  # a variant of its own: traced per None-ness of the argument
            p_lp, p_rank, p_ids, p_top = prompt_logprobs(model.logits, hidden, prompt_targets)
            prompt = jnp.concatenate([bits(p_lp)[:, None], p_rank[:, None], p_ids, bits(p_top)], axis=1)
        return padded, packed, cache, penalties, prompt

    shardings = {}
    if layout is not None:  # the penalty tables, tokens and batch metadata are replicated
        (params, cache, *_), (out, out_cache) = (layout.jit_shardings()[k] for k in ("in_shardings",
                                                                                      "out_shardings"))
        rep = layout.replicated
        shardings = dict(in_shardings=(tuple(jax.tree.leaves(params)), cache, rep, rep, rep, rep),
                         out_shardings=(rep, out, out_cache, rep, rep))
    # static arguments by position: jit accepts no keyword arguments alongside in_shardings
    jitted = jax.jit(step, static_argnums=(5, 6), donate_argnums=(1, 2), **shardings)
    return jitted, traces


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_penalty_row(state: PenaltyState, row, counts, prompt_mask, logit_bias, min_tokens_mask) -> PenaltyState:
    """`state` with row `row` replaced (one compilation per vocabulary size)."""
    return PenaltyState(state.output_counts.at[row].set(counts), state.prompt_mask.at[row].set(prompt_mask),
                        state.logit_bias.at[row].set(logit_bias), state.min_tokens_mask.at[row].set(min_tokens_mask))


class _RowParams:
    """Host copies of each batch row's sampling parameters, `[max_num_seqs]` arrays, set when a
    request takes the row (`RowInit`) and gathered by row every step."""

    def __init__(self, rows: int):
        self.temperature = np.zeros(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.top_p = np.ones(rows, np.float32)
        self.min_p = np.zeros(rows, np.float32)
        self.seed_hi = np.zeros(rows, np.uint32)
        self.seed_lo = np.zeros(rows, np.uint32)
        self.sample_index = np.zeros(rows, np.int32)
        self.processed = np.zeros(rows, bool)
        self.min_tokens = np.zeros(rows, np.int32)
        self.presence = np.zeros(rows, np.float32)
        self.frequency = np.zeros(rows, np.float32)
        self.repetition = np.ones(rows, np.float32)
        self.logprobs = np.full(rows, -1, np.int32)  # top logprobs asked for; -1: no logprobs at all

    def set(self, init: RowInit) -> None:
        p, r = init.params, init.row
        seed = init.seed % 2**64
        self.temperature[r] = 0.0 if p.greedy else p.temperature
        self.top_k[r], self.top_p[r], self.min_p[r] = max(p.top_k, 0), p.top_p, p.min_p
        self.seed_hi[r], self.seed_lo[r], self.sample_index[r] = seed >> 32, seed & 0xFFFFFFFF, init.sample_index
        self.processed[r], self.min_tokens[r] = p.uses_logits_processing, p.min_tokens
        self.presence[r], self.frequency[r], self.repetition[r] = p.presence_penalty, p.frequency_penalty, \
            p.repetition_penalty
        self.logprobs[r] = -1 if p.logprobs is None else p.logprobs


class _SamplingWritten(NamedTuple):
    """What `ModelRunner._write_sampling` wrote last: for the rows array `rows` and `samples` of a
    step, into `inputs`; whether a row uses logits processing."""

    rows: np.ndarray
    samples: np.ndarray
    inputs: HostInputs
    processing: bool


@functools.lru_cache(maxsize=256)
def _query_starts(n: int, s: int) -> np.ndarray:
    """`[S+1]`: the query start of each of n requests of one new token each, padded to S (read-only)."""
    starts = np.minimum(np.arange(s + 1, dtype=np.int32), n)
    starts.flags.writeable = False
    return starts


class ModelRunner:
    """Builds inputs and runs the jitted step. Not thread-safe (the engine loop owns it).

    With `config.tensor_parallel_size` > 1 the parameters and cache live sharded on a mesh
    (`self.layout`, see `llmjax.parallel`); `model` must then have passed `parallel.prepare_model`.
    """

    def __init__(self, model: LoadedModel, config: EngineConfig, num_blocks: int, kv_dtype,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.model_config = model.config
        self.config = config
        self.buckets = StepBuckets(config)
        self.block_size = config.block_size
        self.backend = get_attention_backend(config.attention_backend)
        self.backend.check(model.config, config.block_size, kv_dtype)
        self.graphdef = model.graphdef
        tp = config.tensor_parallel_size
        self.layout = parallel.Layout.create(model, parallel.make_mesh(tp)) if tp > 1 else None
        self.num_blocks, self.kv_dtype = num_blocks, kv_dtype
        if self.layout is None:
            self.params = jax.device_put(model.params)
        else:
            self.params = self.layout.place_params(model.params)
        self._param_leaves = tuple(jax.tree.leaves(self.params))
        self.cache = self._empty_cache()
        self.eos_token_ids = eos_token_ids
        self.penalties = self._empty_penalties()
        self._rows = _RowParams(config.max_num_seqs)
        self._last_sampling: _SamplingWritten | None = None
        self._scratch_row = config.max_num_seqs
        self._no_tokens = self._replicated(np.zeros(config.max_num_seqs, np.int32))  # no previous step
        self.num_compiles = 0  # step functions traced by this runner's calls (warm-up included)
        self.num_serving_compiles = 0  # of them, outside `warmup`: each one stalled the step that needed it
        self.serving_compile_seconds = 0.0  # the time those steps' jitted calls took (the compile in it)
        self._warming_up = False
        self._warmed_up = False  # `warmup` ran: a compile after it is a bucket warm-up missed (logged as a warning)
        self.time_prepare = 0.0  # host: building the step's inputs
        self.time_dispatch = 0.0  # host: the jitted call, which starts the step and returns
        self.time_device = 0.0  # host waiting for the device in `fetch`
        self.time_fetch = 0.0  # host copying the computed results in `fetch`
        mesh = None if self.layout is None else self.layout.mesh
        structure = (str(jax.tree.structure(model.params)),
                     tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(model.params)))  # e.g. packed or not
        key = (model.config, structure, self.backend.name, self.block_size, mesh, config.max_num_seqs)
        if key not in _STEP_FUNCTIONS:
            _STEP_FUNCTIONS[key] = _make_step_function(model.graphdef, jax.tree.structure(self.params), self.backend,
                                                       self.block_size, self.layout, config.max_num_seqs)
        self._step_fn, self._traces = _STEP_FUNCTIONS[key]

    def step_function(self, backend) -> tuple:
        """(jitted step, its trace counter) for this runner's model around another attention
        `backend`, not shared: tests and profiles swap it in as `_step_fn`, `_traces`."""
        return _make_step_function(self.graphdef, jax.tree.structure(self.params), backend, self.block_size,
                                   self.layout, self.config.max_num_seqs)

    def _replicated(self, x):
        return jax.device_put(x, None if self.layout is None else self.layout.replicated)

    def run(self, inputs: HostInputs, decode_only: bool, prev_tokens: jax.Array | None = None,
            prompt_targets: np.ndarray | None = None):
        """Run the jitted step on `inputs` and the runner's cache and tables (which it replaces);
        counts compilations. `prompt_targets`: `[T]` int32 (see `SchedulerOutput.prompt_targets`,
        padded with -1) or None. Returns (tokens [max_num_seqs] on the device, packed results
        [S, 3 + 2 * MAX_LOGPROBS] on the device, packed prompt logprobs [T, 2 + 2 * MAX_LOGPROBS] or None)."""
        traces_before = self._traces[0]
        t0 = time.perf_counter()
        prev = self._no_tokens if prev_tokens is None else prev_tokens
        tokens, packed, self.cache, self.penalties, prompt = self._step_fn(
            self._param_leaves, self.cache, self.penalties, prev, inputs.buffer, inputs.layout, decode_only,
            prompt_targets)
        compiled = self._traces[0] - traces_before
        if compiled:
            self.num_compiles += compiled
            if not self._warming_up:
                self._note_serving_compile(inputs.layout, decode_only, prompt_targets is not None,
                                           time.perf_counter() - t0)
        return tokens, packed, prompt

    def _note_serving_compile(self, layout: InputLayout, decode_only: bool, prompt: bool, seconds: float) -> None:
        """Count and log a step function compiled on first use (outside warm-up): every request of
        that step, and with it the whole engine, waited for the compiler. A warning once warm-up has
        run (it missed this bucket), debug before (an engine without warm-up compiles as it goes);
        the prompt-logprobs variants, which warm-up leaves out, are logged at info."""
        self.num_serving_compiles += 1
        self.serving_compile_seconds += seconds
        if prompt:
            log.info("compiled the prompt-logprobs step of bucket T=%d S=%d B=%d on first use: %.2f s",
                     *layout.bucket, seconds)
            return
        level = logging.WARNING if self._warmed_up else logging.DEBUG
        log.log(level, "compiled the step of bucket T=%d S=%d B=%d (%s) on first use: %.2f s, which the step waited "
                "for. Warm-up compiles the common buckets; with a persistent compilation cache "
                "(--compilation-cache-dir) a later compile of this bucket is fast.",
                *layout.bucket, "decode-only" if decode_only else "mixed", seconds)

    # --- input building ------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[HostInputs, bool]:
        """Write the scheduled batch, padded to its bucket, into a step's input buffer; vectorised
        (loops only over new rows). Returns (inputs, decode_only)."""
        for init in out.new_rows:
            self._take_row(init)
        n, total = len(out.requests), out.num_tokens
        t, s, b = out.bucket
        inputs = HostInputs(input_layout(t, s, b))
        field = inputs.field
        n_new, starts = out.num_new_tokens, out.num_computed
        tables = field("block_tables")
        tables[:n] = out.block_tables
        if total == n:  # one token each (decodes): their positions are their starts
            field("query_start_loc")[:] = _query_starts(n, s)
            req_of_token, positions = _query_starts(n, s)[:n], starts
            field("logits_indices")[:n] = req_of_token
        else:
            qsl = field("query_start_loc")
            np.cumsum(n_new, out=qsl[1 : n + 1])
            qsl[n + 1 :] = total
            field("logits_indices")[:n] = qsl[1 : n + 1] - 1
            req_of_token = np.repeat(np.arange(n), n_new)
            positions = starts[req_of_token] + np.arange(total, dtype=np.int32) - qsl[req_of_token]
        field("positions")[:total] = positions
        field("slot_mapping")[:total] = tables[req_of_token, positions // self.block_size] * self.block_size + \
            positions % self.block_size
        field("token_ids")[:total] = out.token_ids
        source = field("token_source")
        source[:total] = out.token_source
        source[total:] = -1
        field("seq_lens")[:n] = starts + n_new
        field("num_decodes")[...] = out.num_decodes
        self._write_sampling(inputs, out)
        return inputs, out.decode_only

    def _write_sampling(self, inputs: HostInputs, out: SchedulerOutput) -> None:
        """Write the per-request sampling arrays, gathered from the rows' parameters (padded rows:
        greedy, no processing). A step on the same
        rows array as the last one (the scheduler's steady decodes) copies the last step's sampling
        words: only the output counts (and the min_tokens masks of processed rows) change."""
        r, rows, n = self._rows, out.rows, len(out.requests)
        field, offset = inputs.field, inputs.layout.sampling_offset
        last = self._last_sampling
        if last is not None and last.rows is rows and last.samples is out.samples and \
                last.inputs.layout is inputs.layout:
            inputs.buffer[offset:] = last.inputs.buffer[offset:]
            field("output_index")[:n] = out.output_index
            if last.processing:
                field("in_min_tokens")[:n] = r.processed[rows] & (out.output_index < r.min_tokens[rows])
            self._last_sampling = last._replace(inputs=inputs)
            return
        processed = r.processed[rows]
        for name, values in (("temperature", r.temperature), ("top_k", r.top_k), ("top_p", r.top_p),
                             ("min_p", r.min_p), ("seed_hi", r.seed_hi), ("seed_lo", r.seed_lo),
                             ("sample_index", r.sample_index), ("presence_penalty", r.presence),
                             ("frequency_penalty", r.frequency), ("repetition_penalty", r.repetition)):
            field(name)[:n] = values[rows]
        field("top_p")[n:] = 1
        field("repetition_penalty")[n:] = 1
        field("output_index")[:n] = out.output_index
        penalty_row = field("penalty_row")
        penalty_row[:n] = np.where(processed, rows, self._scratch_row)
        penalty_row[n:] = self._scratch_row
        field("processed")[:n] = processed
        field("keep")[:n] = out.samples
        field("in_min_tokens")[:n] = processed & (out.output_index < r.min_tokens[rows])
        field("want_logprob")[:n] = r.logprobs[rows] >= 0
        field("want_top")[:n] = r.logprobs[rows] > 0
        self._last_sampling = _SamplingWritten(rows, out.samples, inputs, bool(processed.any()))

    def _take_row(self, init: RowInit) -> None:
        """A request took `init.row`: its sampling parameters, and its logits-processing table filled
        from its tokens (vectorised) when it uses processing."""
        self._rows.set(init)
        self._last_sampling = None
        p, vocab = init.params, self.model_config.vocab_size
        if not p.uses_logits_processing:
            return
        counts = np.bincount(np.asarray(init.output_token_ids, np.int64), minlength=vocab).astype(np.int32)
        prompt_mask = np.bincount(np.asarray(init.prompt_token_ids, np.int64), minlength=vocab) > 0
        bias = np.zeros(vocab, np.float32)
        for token, value in (p.logit_bias or {}).items():
            bias[token] = value
        # EOS too with ignore_eos, as in vLLM: until min_tokens it cannot be sampled, stop or not
        stops = [t for t in p.stop_token_ids if t < vocab] + list(self.eos_token_ids)
        min_tokens_mask = np.zeros(vocab, bool)
        min_tokens_mask[stops] = True
        self.penalties = _write_penalty_row(self.penalties, np.int32(init.row), counts, prompt_mask, bias,
                                            min_tokens_mask)

    # --- device state ----------------------------------------------------------------------------------
    def _empty_cache(self):
        if self.layout is None:
            return init_cache(self.model_config, self.num_blocks, self.block_size, self.kv_dtype)
        return self.layout.init_cache(self.model_config, self.num_blocks, self.block_size, self.kv_dtype)

    def _empty_penalties(self) -> PenaltyState:
        rows, vocab = self.config.max_num_seqs + 1, self.model_config.vocab_size
        state = PenaltyState(np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), bool),
                             np.zeros((rows, vocab), np.float32), np.zeros((rows, vocab), bool))
        return self._replicated(state)

    def recover(self) -> bool:
        """After a failed step: whether the cache and penalty tables were lost (donated to a step that
        failed, or computed by it); if so they are rebuilt empty, so the caller must recompute every
        running request (whose rows are re-initialised on re-admission) and drop the prefix cache."""
        try:
            leaves = jax.tree.leaves((self.cache, self.penalties))
            if any(x.is_deleted() for x in leaves):
                raise RuntimeError("deleted")
            jax.block_until_ready(leaves)
            return False
        except Exception:
            self.cache, self.penalties = self._empty_cache(), self._empty_penalties()
            return True

    # --- execution ---------------------------------------------------------------------------------
    def dispatch(self, out: SchedulerOutput, previous: InFlight | None = None) -> InFlight:
        """Build the inputs and start the step without waiting for it. `previous` is the step whose
        sampled tokens the scheduler's `token_source` points into (None: no token is on the device)."""
        t0 = time.perf_counter()
        inputs, decode_only = self.prepare(out)
        t1 = time.perf_counter()
        targets = None
        if out.prompt_targets is not None:
            targets = np.full(out.bucket[0], -1, np.int32)
            targets[: out.num_tokens] = out.prompt_targets
        tokens, packed, prompt = self.run(inputs, decode_only, None if previous is None else previous.tokens, targets)
        t2 = time.perf_counter()
        self.time_prepare += t1 - t0
        self.time_dispatch += t2 - t1
        return InFlight(len(out.requests), tokens, packed, out.num_tokens, prompt)

    def fetch(self, inflight: InFlight) -> StepResult:
        """Wait for a dispatched step and bring its results to the host (one transfer)."""
        t0 = time.perf_counter()
        jax.block_until_ready((inflight.packed, inflight.prompt))
        t1 = time.perf_counter()
        packed = np.asarray(inflight.packed)[: inflight.num_requests]
        prompt = None if inflight.prompt is None else np.asarray(inflight.prompt)[: inflight.num_tokens]
        self.time_device += t1 - t0
        self.time_fetch += time.perf_counter() - t1
        k = MAX_LOGPROBS
        if prompt is not None:
            prompt = PromptLogprobs(prompt[:, 0].view(np.float32), prompt[:, 1], prompt[:, 2 : 2 + k],
                                    prompt[:, 2 + k :].view(np.float32))
        return StepResult(packed[:, 0], packed[:, 1].view(np.float32), packed[:, 2], packed[:, 3 : 3 + k],
                          packed[:, 3 + k :].view(np.float32), prompt)

    def warmup(self, shapes: list[Shape]) -> None:
        """Compile the step for each (T, S, B, decode_only) bucket ahead of serving, with a progress bar.

        Runs on all-padding inputs (every write lands in the null block), so the cache is unchanged.
        Also compiles the write of a logits-processing row (on the scratch row, which only rows without
        processing read), so the first request with penalties compiles nothing either.
        """
        self._warming_up = True
        try:
            for t, s, b, decode_only in tqdm(shapes, desc="compiling step buckets", unit="bucket"):
                self.run(self.padding_inputs(t, s, b), decode_only)
            vocab = self.model_config.vocab_size
            self.penalties = _write_penalty_row(self.penalties, np.int32(self._scratch_row), np.zeros(vocab, np.int32),
                                                np.zeros(vocab, bool), np.zeros(vocab, np.float32),
                                                np.zeros(vocab, bool))
            jax.block_until_ready((self.cache, self.penalties))
        finally:
            self._warming_up = False
        self._warmed_up = True

    def padding_inputs(self, t: int, s: int, b: int) -> HostInputs:
        """All-padding inputs of bucket (T, S, B): every write lands in the null block; greedy."""
        return self.prepare(SchedulerOutput(block_tables=np.zeros((0, b), np.int32), bucket=(t, s, b)))[0]

    def lower(self, t: int, s: int, b: int, decode_only: bool = False) -> jax.stages.Lowered:
        """The step of bucket (T, S, B) lowered for inspection (`.compile().as_text()` is its HLO); runs nothing."""
        inputs = self.padding_inputs(t, s, b)
        return self._step_fn.lower(self._param_leaves, self.cache, self.penalties, self._no_tokens, inputs.buffer,
                                   inputs.layout, decode_only, None)
