"""`LLMEngine`: add requests, step, abort; stop conditions, detokenization and outputs.

One step = schedule (scheduler + KV manager), dispatch (runner: one jitted forward + sampling),
fetch its tokens, let the scheduler apply them (`update_from_output`: tokens appended, EOS / stop
ids / lengths, finished requests freed), then detokenize, check stop strings and return delta
outputs (`llmjax.outputs`). With `EngineConfig.async_scheduling` each `step()` dispatches the next
step before it waits for the previous one, so the host's scheduling, input building and output
processing overlap the device's work; it returns the previous step's outputs.
Not thread-safe: a single loop owns the engine (the server runs it in one thread).

A request with `n` > 1 is n scheduler requests ("samples", ids `<id>#<i>`) under one parent id; with
prefix caching on, the engine holds samples 1..n-1 back until sample 0 has sampled its first token,
so they find the prompt's full pages in the prefix cache and the prompt is computed once (off: all
samples start at once and each computes the prompt).

Fault isolation: an exception while preparing a request (in `add_request`) reaches only its
caller, with nothing queued; one inside a step fails only the requests in that step (finished
outputs with `error` set, blocks freed); one while appending a request's token fails that request.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llmjax import parallel
from llmjax.attention.cache_dtype import value_dtype
from llmjax.config import DEFAULT_GPU_MEMORY_UTILIZATION, ConfigError, Default, EngineConfig
from llmjax.kv.manager import KVCacheManager
from llmjax.kv.sizing import check_fits_host_memory, device_memory_stats, kv_budget_bytes, num_blocks_from_budget
from llmjax.models.loader import LoadedModel, default_dtype, load_model
from llmjax.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, snapshot
from llmjax.request import MAX_NAMESPACE_CHARS, Request, RequestStatus
from llmjax.runner import InFlight, ModelRunner, PromptLogprobs, StepResult, enable_compilation_cache
from llmjax.sampling_params import RequestOutputKind, SamplingParams
from llmjax.scheduler import Scheduler, SchedulerOutput
from llmjax.tokenizer import CharTokenizer, IncrementalDetokenizer, TextTooLong, Tokenizer, load_tokenizer

CPU_KV_BUDGET_BYTES = 1 << 30
DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY
_RUNNING = RequestStatus.RUNNING

log = logging.getLogger(__name__)


def freeze_gc_heap() -> None:
    """Collect, then exempt every object alive now from Python's cyclic garbage collector
    (`gc.freeze`). Called once a serving process has built and warmed up its engine: the objects of
    the model, JAX and flax then no longer make each full collection walk them, which otherwise
    costs a step several milliseconds every few hundred steps (measured: `tiny-gqa`, 256 decodes with
    delta outputs, 4.9 ms a step over the 30 steps that held one, against 2.1 ms). Objects frozen
    are still freed by reference counting; only garbage cycles among them stay. Not for a process
    that goes on building and dropping engines (a test suite)."""
    gc.collect()
    gc.freeze()


def _fit_max_model_len(config: EngineConfig, context: int) -> EngineConfig:
    """`config` with `max_model_len` at most the model's `context`: the default is capped (as vLLM
    derives its default from the model); a larger value set by hand is refused, since positions past
    the model's context would run on untrained RoPE angles. Then, without chunked prefill, a whole
    prompt must fit a step (`EngineConfig.check_prompts_fit_a_step`)."""
    if config.max_model_len > context:
        if not isinstance(config.max_model_len, Default):
            raise ConfigError(f"max_model_len ({config.max_model_len}) is larger than the model's context length "
                              f"({context} tokens): set it to at most {context}")
        log.info("max_model_len capped at the model's context length, %d tokens", context)
        config = config.replace(max_model_len=Default(context))
    config.check_prompts_fit_a_step()
    return config


class RequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (the API reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def prompt_too_long(exc: TextTooLong, max_model_len: int, param: str = "prompt") -> RequestError:
    """The refusal of a prompt text that `encode(..., at_most=max_model_len)` found too long to encode."""
    return RequestError(f"This model's maximum context length is {max_model_len} tokens. However, the prompt has "
                        f"at least {exc.min_num_tokens} tokens ({exc.num_chars} characters). Please reduce the "
                        "length of the prompt.", param)


def check_fits_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                       max_tokens_field: str = "max_tokens", prompt_field: str = "prompt") -> None:
    """`RequestError` (vLLM's messages) for a prompt that leaves no room to generate in `max_model_len`
    tokens, or, with `max_tokens` given, a prompt plus `max_tokens` beyond it: the OpenAI server's
    rule (the engine itself caps such a request at `max_model_len`, finish reason "length", as
    vLLM's engine does). `max_tokens_field`, `prompt_field`: the names the client gave them
    (`messages` for a chat)."""
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens. Please reduce the length of the input {prompt_field}.", prompt_field)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_field}, {max_tokens} for "
            f"the completion). Please reduce the length of the {prompt_field} or {max_tokens_field}.",
            max_tokens_field,
        )


def _token_ids(prompt) -> list[int]:
    """A prompt given as token ids, as a list of ints: integers only (numpy's too), never a float, a
    string or a bool, which `int()` would quietly turn into ids."""
    try:
        ids = [None if isinstance(t, (bool, np.bool_)) else operator.index(t) for t in prompt]
    except TypeError:  # not iterable, or an item that is no integer
        ids = [None]
    if None in ids:
        raise RequestError(f"a prompt is a string or a sequence of integer token ids, got {prompt!r:.80}", "prompt")
    return ids


@dataclass(slots=True)
class _SequenceState:
    """Per sample: its text not yet returned (held back while it may start a stop string), how
    many of its output tokens the detokenizer has seen, and how many tokens (and logprob entries)
    were returned.

    Text is made when it is needed: every step for a request that streams (DELTA, CUMULATIVE) or has stop
    strings, otherwise (FINAL_ONLY without stop strings: the offline API, non-streamed responses)
    once, when the request finishes, so a decode step does not touch its detokenizer."""

    detokenizer: IncrementalDetokenizer
    unreturned: str = ""
    detokenized: int = 0
    returned_tokens: int = 0
    cumulative_logprob: float = 0.0

    def detokenize(self, output_ids: list[int], skip_last: bool = False) -> int:
        """Feed the output tokens the detokenizer has not seen; their text joins `unreturned`.
        Returns its length. `skip_last`: the last token (an EOS or stop id that ended the request)
        counts as seen but adds no text. Should the detokenizer raise, those tokens count as seen
        (the caller fails the request; its output keeps the text made before)."""
        seen, n = self.detokenized, len(output_ids)
        self.detokenized = n
        if skip_last:
            output_ids, n = output_ids[:-1], n - 1
        if n == seen + 1:  # the usual case: this step's token
            text = self.detokenizer.add(output_ids[-1])
        else:
            text = "".join(map(self.detokenizer.add, output_ids[seen:n]))
        if text:
            self.unreturned += text
        return len(text)


@dataclass(eq=False, slots=True)
class _Parent:
    """A request as the caller sees it: its n samples (`children`, sample i at index i, each with
    this as its `owner`) and their text states (`texts[i]`).

    `quiet`: one sample, FINAL_ONLY, no logprobs, no stop strings. Once it has its first token, a
    step that gives it a token and does not end it only records the token's time (`token_times`),
    so a steady decode step touches nothing else of it. `plain_stream`: one sample, DELTA, no
    logprobs, no stop strings: such a step makes its text and its delta output directly
    (`LLMEngine._plain_delta`), the general path's result without its checks; with a
    `stream_interval` above 1, a step that owes it no output only records its token's time."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    texts: list[_SequenceState]
    metrics: RequestMetrics  # live: every delta output refers to it; complete once the request finishes
    held: list[Request] = field(default_factory=list)  # samples not yet given to the scheduler
    quiet: bool = False
    plain_stream: bool = False
    finished: bool = False  # its final output is out (it left `LLMEngine._parents`)
    prompt_logprobs_sent: bool = False  # its prompt logprobs were in an output
    whole: RequestOutput | None = None  # CUMULATIVE: its deltas so far, folded (`LLMEngine._output`)


def _generation_defaults(model: LoadedModel, config: EngineConfig) -> dict:
    """The model's sampling defaults under `config.generation_config` (logged when there are any);
    ConfigError for values no request could take."""
    if config.generation_config != "auto" or not model.generation_defaults:
        return {}
    try:
        SamplingParams(**model.generation_defaults)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"the model's generation_config.json: {exc}") from None
    log.warning("the model's generation_config.json sets the default sampling parameters %s (a request's own "
                "values win; generation_config='vllm' ignores the file)", model.generation_defaults)
    return dict(model.generation_defaults)


class LLMEngine:
    def __init__(self, model: LoadedModel, tokenizer: Tokenizer | CharTokenizer, config: EngineConfig):
        """Raises `ConfigError` when `config` cannot run this model (a `max_model_len` set above the
        model's context, a dtype the weights were not loaded in, ...). The default `max_model_len`
        is capped at the model's context (logged). `generation_defaults`: the sampling defaults of the
        model's generation_config.json (SamplingParams field -> value) under
        `config.generation_config` "auto", {} under "vllm"."""
        config = _fit_max_model_len(config, model.config.max_position_embeddings)
        self.generation_defaults = _generation_defaults(model, config)
        model = parallel.prepare_model(model, config.tensor_parallel_size)
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(model.config.eos_token_ids) | tokenizer.eos_token_ids
        weights_dtype = value_dtype(jax.tree.leaves(model.params)[0].dtype)
        if config.dtype is not None and jnp.dtype(config.dtype) != weights_dtype:
            raise ConfigError(f"EngineConfig.dtype is {config.dtype} but the model was loaded in {weights_dtype}: "
                              f"load it with load_model(..., dtype={config.dtype!r}) or use LLMEngine.from_config")
        kv_dtype = jnp.dtype(config.kv_cache_dtype) if config.kv_cache_dtype else jnp.dtype(weights_dtype)
        budget = config.kv_cache_memory_bytes
        if budget is None and device_memory_stats() is not None:  # an accelerator: vLLM's rule
            profiler = ModelRunner(model, config, 2, kv_dtype, self.eos_token_ids)  # weights resident
            budget = kv_budget_bytes(config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
                                     device_memory_stats, lambda: profiler.warmup(profiler.buckets.largest()))
            del profiler
        elif config.gpu_memory_utilization is not None:
            raise ConfigError("gpu_memory_utilization sizes the KV cache from an accelerator's memory, and "
                              f"{jax.default_backend()} reports none: size it with kv_cache_memory_bytes "
                              "(--kv-cache-memory)")
        budget = budget or CPU_KV_BUDGET_BYTES
        bytes_per_token = parallel.kv_bytes_per_token_per_device(model.config, kv_dtype.itemsize,
                                                                 config.tensor_parallel_size)
        self.num_blocks = num_blocks_from_budget(budget, config.block_size, bytes_per_token)
        if device_memory_stats() is None:  # the cache lives in host memory, one copy per (virtual) device
            check_fits_host_memory(self.num_blocks * config.block_size * bytes_per_token
                                   * config.tensor_parallel_size)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, eos_token_ids=self.eos_token_ids, build_step_inputs=True)
        self.runner = ModelRunner(model, config, self.num_blocks, kv_dtype, self.eos_token_ids)
        self._parents: dict[str, _Parent] = {}  # the unfinished requests, by id
        self.num_held_samples = 0  # samples of n > 1 requests waiting for their first sample's prompt
        self._inflight: tuple[SchedulerOutput, InFlight] | None = None  # dispatched, not yet processed
        self._ids = itertools.count()
        self._keys = itertools.count()  # the samples' names in the KV manager
        self._seed_rng = np.random.default_rng(config.seed)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # host seconds by phase (the runner adds time_prepare, time_dispatch and time_device, its wait for results)
        self.time_schedule = 0.0
        self.time_update = 0.0  # the scheduler's update_from_output
        self.time_output = 0.0  # text, stop strings, delta outputs
        self.num_steps = 0  # steps dispatched (or failed to)
        # called with a request's metrics when its first token is sampled, on the thread running `step`
        # (the server's time-to-first-token histogram); it must not raise
        self.on_first_token: Callable[[RequestMetrics], None] | None = None

    @classmethod
    def from_config(cls, model: str | None = None, config: EngineConfig | None = None, seed: int = 0) -> LLMEngine:
        config = config or EngineConfig()
        parallel.initialize_distributed(config)
        enable_compilation_cache(config.compilation_cache_dir)
        dtype = jnp.dtype(config.dtype or default_dtype())
        loaded = load_model(model, dtype=dtype, seed=seed)
        tokenizer = load_tokenizer(loaded.source, loaded.config.eos_token_ids)
        return cls(loaded, tokenizer, config)

    # --- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        namespace: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request (text or token ids) with its `params.n` samples (`params`
        None: SamplingParams' defaults over the model's `generation_defaults`).

        Raises `RequestError` for a request the engine refuses, or whatever preparing it raised (the
        tokenizer, say); either way nothing is queued and no other request is affected.
        """
        params = params or SamplingParams(**self.generation_defaults)
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
        if request_id is None:
            request_id = next(i for i in map("req-{}".format, self._ids) if i not in self._parents)
        elif not isinstance(request_id, str) or not request_id:
            raise RequestError(f"a request id is a non-empty string, got {request_id!r}", "request_id")
        if request_id in self._parents:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        if namespace is not None and not (isinstance(namespace, str) and 0 < len(namespace) <= MAX_NAMESPACE_CHARS):
            # as vLLM's cache_salt (1, 1.0 and True would be one tenant as dict keys); the radix tree keeps
            # the string while the tenant's pages stay cached, so its length is bounded
            raise RequestError(f"a namespace (cache_salt) is a non-empty string of at most {MAX_NAMESPACE_CHARS} "
                               f"characters, or None; got {namespace!r:.80}", "cache_salt")
        if arrival_time is not None and not (isinstance(arrival_time, (int, float)) and math.isfinite(arrival_time)):
            raise RequestError(f"arrival_time must be a finite number of seconds, got {arrival_time!r}", "arrival_time")
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        text = prompt if isinstance(prompt, str) else None
        if text == "":
            raise RequestError("the prompt is empty", "prompt")
        if text is None:
            ids = _token_ids(prompt)
        else:
            try:
                ids = self.tokenizer.encode(text, at_most=self.config.max_model_len)
            except TextTooLong as exc:
                raise prompt_too_long(exc, self.config.max_model_len) from None
        self._validate(ids, params)
        if params.max_tokens is None:  # up to max_model_len (a min_tokens beyond it stops there, as max_tokens does)
            room = self.config.max_model_len - len(ids)
            params = dataclasses.replace(params, max_tokens=max(room, params.min_tokens))
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        keys = [next(self._keys) for _ in child_ids]
        children = [Request(child_id, ids, params, seed, namespace, text, sample_index=i, key=key, group=keys[0],
                            arrival_time=arrival) for i, (child_id, key) in enumerate(zip(child_ids, keys))]
        states = [_SequenceState(IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens))
                  for _ in children]
        if params.prompt_logprobs is not None:
            children[0].prompt_logprobs = [None]  # collected by the first sample (the prompt is the same)
        # nothing above changed the engine; from here on nothing raises
        plain = params.n == 1 and params.logprobs is None and params.prompt_logprobs is None and not params.stop
        parent = _Parent(request_id, text, ids, params, children, states, RequestMetrics(arrival, time.monotonic()),
                         quiet=plain and params.output_kind is FINAL_ONLY,
                         plain_stream=plain and params.output_kind is DELTA)
        for child in children:
            child.owner = parent
        self._parents[request_id] = parent
        # The other samples wait until the first one's prompt is computed, then find its full pages in
        # the prefix cache: the prompt is computed once. With prompt logprobs they wait in any case, so
        # the request's first output is the first sample's, which carries them.
        wait = self.config.enable_prefix_caching or params.prompt_logprobs is not None
        released = children[:1] if wait else children
        parent.held = children[len(released):]
        self.num_held_samples += len(parent.held)
        for child in released:
            self.scheduler.add(child)
        return request_id

    def add_requests(self, requests: Sequence[tuple[str | Sequence[int], SamplingParams, str | None, str | None]],
                     arrival_time: float | None = None) -> list[str]:
        """`add_request` for each (prompt, params, request id or None, namespace or None), all or none:
        should one raise, the ones added are aborted and the seeds drawn for them go back to the engine's
        generator, so a refused batch changes nothing a later request samples; the exception propagates
        (with a note naming the request that raised, by its place in `requests`). Their ids."""
        seeds = self._seed_rng.bit_generator.state
        added: list[str] = []
        try:
            for prompt, params, request_id, namespace in requests:
                added.append(self.add_request(prompt, params, request_id, namespace, arrival_time))
        except BaseException as exc:
            for request_id in added:
                self.abort(request_id)
            self._seed_rng.bit_generator.state = seeds
            if len(requests) > 1 and isinstance(exc, Exception):
                exc.add_note(f"request {len(added)} of the {len(requests)} given (from 0); none of them was added")
            raise
        return added

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}",
                               "logit_bias")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:  # no token could ever match it
            raise RequestError(f"stop_token_ids must be in [0, {vocab}), got {max(params.stop_token_ids)}",
                               "stop_token_ids")
        batch_size = self.config.batch_size
        if batch_size is not None and params.n > batch_size:
            raise RequestError(f"n ({params.n}) is more than the batch size ({batch_size}): a static or dynamic "
                               "batch holds all of a request's samples", "n")
        max_len = self.config.max_model_len
        check_fits_context(len(ids), None, max_len)  # a longer request stops at max_model_len ("length")
        # the most tokens it can reach: without max_tokens, or with more than fit, max_model_len; all but
        # the last (sampled, never fed back) take KV slots
        longest = min(max_len, len(ids) + (params.max_tokens or max_len))
        blocks = self.kv.num_blocks_for(longest - 1)
        if blocks > self.num_blocks - 1:
            reach = "its prompt and max_tokens" if longest < max_len else "max_model_len"
            raise RequestError(
                f"the request can reach {longest} tokens ({reach}), whose KV ({longest - 1} tokens; the last is "
                f"never fed back) needs {blocks} KV blocks, but the pool holds only {self.num_blocks - 1}; lower "
                "max_tokens or raise the KV cache memory budget", "max_tokens",
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples) and free its blocks; None if it is unknown or finished."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        return self._end(parent, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        """Samples waiting to run: the scheduler's queue and the held samples of n > 1 requests (vLLM
        queues each sample as a request of its own)."""
        return len(self.scheduler.waiting) + self.num_held_samples

    # --- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. Returns a DELTA output (see `llmjax.outputs`; CUMULATIVE: all of
        it so far) for each request that sampled a token or finished (a `FINAL_ONLY` request: one
        whole output once all its samples finished): this step's, or with asynchronous scheduling
        the previous step's (this one stays in flight; a call that schedules nothing completes it).

        If a step itself fails (the runner raises), only the requests in it fail: each gets a
        finished output with `error` set, its blocks are freed, and later steps run as usual.
        """
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.time_schedule += time.perf_counter() - t0
        outputs: list[RequestOutput] = []
        dispatched = failed = None
        if not out.empty:
            self.num_steps += 1
            previous = self._inflight[1] if self._inflight else None
            try:
                dispatched = (out, self.runner.dispatch(out, previous))
            except Exception as exc:
                log.exception("engine step failed; failing its %d requests", len(out.requests))
                self._forget_unwritten_kv(out)  # before the step in flight frees and caches any of them
                failed = (out, exc)
            except BaseException:  # interrupted (Ctrl-C): the caller aborts; none of this KV may be cached
                self._forget_unwritten_kv(out)
                raise
        if self.config.async_scheduling:
            completing, self._inflight = self._inflight, dispatched
        else:
            completing = dispatched
        if completing is not None:
            outputs += self._complete(*completing)
        if failed is not None:  # after the step before it, whose tokens (and stops) stand
            outputs += self._fail_step(*failed)
        return outputs

    @property
    def has_step_in_flight(self) -> bool:
        """Whether asynchronous scheduling left a dispatched step whose results the next `step()` applies."""
        return self._inflight is not None

    def wait_in_flight(self) -> None:
        """Block until the step left in flight by asynchronous scheduling has computed (its results
        are applied by the next `step()`); a no-op without one. For measurements that must not leave
        device work running past their end."""
        if self._inflight is not None:
            jax.block_until_ready(self._inflight[1].packed)

    def _complete(self, out: SchedulerOutput, inflight: InFlight) -> list[RequestOutput]:
        """Fetch a dispatched step's tokens and apply them; its delta outputs."""
        try:
            result = self.runner.fetch(inflight)
        except Exception as exc:
            log.exception("engine step failed; failing its %d requests", len(out.requests))
            return self._fail_step(out, exc)
        return self.apply_step(out, result)

    def apply_step(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Apply a step's results (the scheduler's update, then text, stop strings and outputs); its
        delta outputs. `step()` calls it once the device has returned them."""
        t1 = time.perf_counter()
        now = time.monotonic()  # the step's tokens' time: before the update stamps the finished requests
        if result.prompt_logprobs is not None:
            self._collect_prompt_logprobs(out, result.prompt_logprobs)
        indices, appended = self.scheduler.update_from_output(out, result.token_ids)
        t2 = time.perf_counter()
        self.time_update += t2 - t1
        outputs: list[RequestOutput] = []
        grouped: dict[_Parent, list[Request]] = {}  # parents with n > 1: their samples that changed, in order
        self.num_generation_tokens += len(appended)
        interval = self.config.stream_interval
        for i, request in zip(indices, appended):
            parent: _Parent = request.owner
            if parent.quiet and request.status is _RUNNING:  # see `_Parent`
                times = parent.metrics.token_times
                if times:
                    times.append(now)
                    continue
            if parent.finished:  # its request failed earlier in this step
                continue
            try:
                if parent.plain_stream and request.status is _RUNNING and parent.metrics.token_times:
                    if interval > 1 and not self._output_due(parent.texts[0], len(request.output_token_ids), interval):
                        parent.metrics.token_times.append(now)  # no output due: its text waits for the next one
                        continue
                    outputs.append(self._plain_delta(parent, request, now))
                    continue
                self._after_token(request, parent, result, i, now)
            except Exception as exc:  # e.g. the detokenizer on this request's token: fail it alone
                log.exception("request %s failed", parent.request_id)
                if request.status.finished:  # the token that failed also ended it: it failed all the same
                    request.status = RequestStatus.FINISHED_ERROR
                outputs.append(self._end(parent, RequestStatus.FINISHED_ERROR, f"{type(exc).__name__}: {exc}",
                                         [*grouped.pop(parent, ()), request]))
                continue
            if len(parent.children) > 1:
                if parent in grouped:
                    grouped[parent].append(request)
                else:
                    grouped[parent] = [request]
            elif request.status.finished or (parent.params.output_kind is not FINAL_ONLY and (
                    interval == 1 or self._output_due(parent.texts[0], len(request.output_token_ids), interval))):
                outputs.append(self._output(parent, (request,)))
        for parent, samples in grouped.items():
            if parent.finished:
                continue
            if parent.params.output_kind is not FINAL_ONLY:
                outputs.append(self._output(parent, samples))
            elif all(c.status.finished for c in parent.children):
                outputs.append(self._output(parent, parent.children))
        self.time_output += time.perf_counter() - t2
        return outputs

    def _logprob_entry(self, token: int, logprob: float, rank: int, top_ids: np.ndarray,
                       top_logprobs: np.ndarray) -> dict[int, Logprob]:
        """A token's logprobs entry as vLLM builds it: its own `Logprob` first, then the top ones (ranks
        1, 2, ...; a top token that is the token itself replaces its entry)."""
        text = self.tokenizer.token_to_text
        entry = {token: Logprob(logprob, rank, text(token))}
        for rank, (top, top_logprob) in enumerate(zip(top_ids.tolist(), top_logprobs.tolist()), 1):
            entry[top] = Logprob(top_logprob, rank, text(top))
        return entry

    def _collect_prompt_logprobs(self, out: SchedulerOutput, prompt: PromptLogprobs) -> None:
        """Append the step's prompt logprobs to the requests collecting them: new token j of request i
        (at position `out.num_computed[i] + j`) gives the entry of the prompt token after it. A request
        recomputing its prompt after a preemption skips the entries it already has."""
        offsets = np.cumsum(out.num_new_tokens) - out.num_new_tokens
        for i, request in enumerate(out.requests):
            entries = request.prompt_logprobs
            if entries is None or not request.collecting_prompt_logprobs:
                continue
            ids, k = request.prompt_token_ids, request.sampling_params.prompt_logprobs
            start = int(out.num_computed[i])
            first, end = len(entries) - 1 - start, min(int(out.num_new_tokens[i]), len(ids) - 1 - start)
            if first < 0:  # cannot happen: a collecting request never skips prompt tokens
                continue
            for row in range(int(offsets[i]) + first, int(offsets[i]) + end):
                entries.append(self._logprob_entry(ids[len(entries)], float(prompt.logprobs[row]),
                                                   int(prompt.ranks[row]), prompt.top_ids[row, :k],
                                                   prompt.top_logprobs[row, :k]))

    def _after_token(self, request: Request, parent: _Parent, result, i: int, now: float) -> None:
        """The engine's part of a new token (the scheduler appended it and checked EOS, stop ids and
        lengths): logprobs, text and stop strings (see `_SequenceState` for when text is made),
        counts; releases held siblings after the first token."""
        output_ids = request.output_token_ids
        token = output_ids[-1]
        metrics = parent.metrics
        times = metrics.token_times
        if not times:
            metrics.first_token_time = now
            times.append(now)
            if self.on_first_token is not None:
                self.on_first_token(metrics)
        elif times[-1] != now:
            times.append(now)
        if len(output_ids) == 1 and request.sample_index == 0:
            self.num_prompt_tokens += len(request.prompt_token_ids)  # counted once prefilled, as vLLM does
        params = request.sampling_params
        # An EOS or stop id that ended it (the scheduler's stops: stop strings come below) adds no
        # text unless `include_stop_str_in_output`, as in vLLM; its id stays in the token ids.
        stop_token = request.status is RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output
        if params.logprobs is not None:
            state = parent.texts[request.sample_index]
            logprob = float(result.logprobs[i])
            request.output_logprobs.append(self._logprob_entry(token, logprob, int(result.ranks[i]),
                                                               result.top_ids[i, :params.logprobs],
                                                               result.top_logprobs[i, :params.logprobs]))
            state.cumulative_logprob += logprob
        if params.stop:
            state = parent.texts[request.sample_index]
            new_chars = state.detokenize(output_ids, stop_token)
            if new_chars and request.status is not RequestStatus.FINISHED_STOPPED:
                self._check_stop_strings(request, state, new_chars)
        elif params.output_kind is not FINAL_ONLY or request.status.finished:
            parent.texts[request.sample_index].detokenize(output_ids, stop_token)
        if parent.held:  # the prompt is computed and its full pages cached
            for sibling in parent.held:
                self.scheduler.add(sibling, by_arrival=True)
            self.num_held_samples -= len(parent.held)
            parent.held = []

    @staticmethod
    def _output_due(state: _SequenceState, num_output_tokens: int, interval: int) -> bool:
        """Whether a one-sample stream gets a delta output now: its first token, or `interval` tokens
        not yet returned (`EngineConfig.stream_interval`)."""
        return state.returned_tokens == 0 or num_output_tokens - state.returned_tokens >= interval

    @staticmethod
    def _plain_delta(parent: _Parent, request: Request, now: float) -> RequestOutput:
        """The delta output of a `plain_stream` request that got a token and goes on, past its first
        token: what `_after_token` then `_output` make of it, without their checks."""
        output_ids = request.output_token_ids
        n = len(output_ids)
        metrics, state = parent.metrics, parent.texts[0]
        metrics.token_times.append(now)
        metrics.num_generation_tokens = n
        if state.detokenized == n - 1 and not state.unreturned:  # the usual case: `detokenize` inlined
            state.detokenized, text = n, state.detokenizer.add(output_ids[-1])
        else:
            state.detokenize(output_ids)
            text, state.unreturned = state.unreturned, ""
        start, state.returned_tokens = state.returned_tokens, n
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             [CompletionOutput(0, text, output_ids[start:])], False, metrics,
                             request.num_cached_tokens)

    def _check_stop_strings(self, request: Request, state: _SequenceState, new_chars: int) -> None:
        """A stop string that ends in the new text (its last `new_chars` characters) ends the request
        (vLLM checks them before the length limits, so one found in a request the scheduler just ended
        by length makes it a stop). Only one that ends in the text of a token after the first
        `min_tokens` (as vLLM's: the tokens that cannot be EOS cannot complete a stop string either)."""
        params = request.sampling_params
        if len(request.output_token_ids) <= params.min_tokens:
            return
        text = state.unreturned  # text held back is at most the longest stop string less one character
        for stop in params.stop:
            idx = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if idx >= 0:
                state.unreturned = text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
                request.stop_reason = stop
                if request.status.finished:
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                return

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Fail every request of a step that raised; if the runner lost its device state, recompute
        the others (their KV is gone; a step still in flight computed on it and is dropped) and drop
        the prefix cache."""
        message = f"the engine step failed: {type(exc).__name__}: {exc}"
        self._forget_unwritten_kv(out)
        # by the record, not the id: a request of this step that finished meanwhile may have left its
        # id to a new request, which was never in this step
        parents = dict.fromkeys(r.owner for r in out.requests if not r.owner.finished)
        outputs = [self._end(parent, RequestStatus.FINISHED_ERROR, message) for parent in parents]
        if self.runner.recover():
            log.error("the runner's device state was lost; running requests are recomputed")
            if self._inflight is not None:
                for request in self._inflight[0].requests:
                    request.num_pending = 0
                self._inflight = None
            self.scheduler.preempt_all()
            self.kv.reset_prefix_cache()
        return outputs

    @staticmethod
    def _forget_unwritten_kv(out: SchedulerOutput) -> None:
        """A failed step wrote no KV: its requests' computed tokens go back to where it started, so
        none of that KV is ever cached."""
        for request, start in zip(out.requests, out.num_computed.tolist()):
            request.num_computed_tokens = min(request.num_computed_tokens, start)

    def _end(self, parent: _Parent, status: RequestStatus, error: str | None = None,
             changed: Sequence[Request] = ()) -> RequestOutput:
        """End every unfinished sample of `parent` with `status`; returns the final delta output (of
        those samples and of `changed`, samples whose new tokens were not returned yet)."""
        unfinished = [c for c in parent.children if not c.status.finished]
        if parent.params.output_kind is not FINAL_ONLY:
            reported = [c for c in parent.children if c in changed or c in unfinished]
        else:  # nothing was returned yet
            reported = parent.children
        held = set(map(id, parent.held))
        self.num_held_samples -= len(held)
        parent.held = []
        for child in unfinished:
            if id(child) in held:  # never queued: nothing to free
                child.status, child.finish_time = status, time.monotonic()
            else:
                self.scheduler.finish(child, status)
        output = self._output(parent, reported)
        output.error = error
        return output

    @staticmethod
    def _completion_delta(request: Request, state: _SequenceState) -> CompletionOutput:
        """What `request` added since its last output (text held back while it may start a stop string)."""
        params = request.sampling_params
        output_ids = request.output_token_ids
        finish_reason = request.finish_reason
        try:
            if state.detokenized < len(output_ids):  # ended (aborted, failed) before its text was made
                state.detokenize(output_ids)
            if finish_reason is not None and not isinstance(request.stop_reason, str):
                state.unreturned += state.detokenizer.finish()  # e.g. a character the last token left incomplete
        except Exception:
            log.exception("request %s: its text could not be made", request.request_id)
        text = state.unreturned
        if text and params.stop and finish_reason is None:
            cut = max(0, len(text) - max(map(len, params.stop)) + 1)
            text, state.unreturned = text[:cut], text[cut:]
        else:
            state.unreturned = ""
        start = state.returned_tokens
        state.returned_tokens = len(output_ids)
        if params.logprobs is None:
            return CompletionOutput(request.sample_index, text, output_ids[start:], None, None, finish_reason,
                                    request.stop_reason)
        return CompletionOutput(request.sample_index, text, output_ids[start:], state.cumulative_logprob,
                                request.output_logprobs[start:], finish_reason, request.stop_reason)

    def _output(self, parent: _Parent, children: Sequence[Request]) -> RequestOutput:
        """The delta output of `parent` for its samples `children` (CUMULATIVE: a copy of all its
        outputs so far, every sample that has had one); forgets a finished parent."""
        texts, completions = parent.texts, []
        for c in children:  # usually one: a loop, not a comprehension's extra frame
            completions.append(self._completion_delta(c, texts[c.sample_index]))
        kids = parent.children
        first = kids[0]
        finished = first.status.finished if len(kids) == 1 else all(c.status.finished for c in kids)
        metrics = parent.metrics
        metrics.first_scheduled_time = first.scheduled_time
        metrics.num_generation_tokens = len(first.output_token_ids) if len(kids) == 1 else \
            sum(len(c.output_token_ids) for c in kids)
        if finished:
            metrics.finish_time = max(c.finish_time for c in kids)
            metrics.num_preemptions = sum(c.num_preemptions for c in kids)
            metrics.finish_reasons = [c.finish_reason for c in kids]
            del self._parents[parent.request_id]
            parent.finished = True
        prompt_logprobs = None
        if first.prompt_logprobs is not None and not parent.prompt_logprobs_sent and \
                (finished or not first.collecting_prompt_logprobs):
            prompt_logprobs, parent.prompt_logprobs_sent = first.prompt_logprobs, True
        output = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions, finished,
                               metrics, first.num_cached_tokens, prompt_logprobs=prompt_logprobs)
        if parent.params.output_kind is not CUMULATIVE:
            return output
        if parent.whole is None:
            parent.whole = snapshot(output)
        else:
            parent.whole.add(output)
        return snapshot(parent.whole)

    # --- introspection -----------------------------------------------------------------------------
    def check_kv_invariants(self) -> None:
        self.kv.check_invariants()

    def warmup(self) -> None:
        self.runner.warmup(self.runner.buckets.warmup_shapes())
