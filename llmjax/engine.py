"""`LLMEngine`: add requests, step, abort; stop conditions, detokenization and outputs.

One step = schedule (scheduler + KV manager), execute (runner: one jitted forward + sampling),
then append the sampled tokens, check stops, stream text deltas and free finished requests.
Not thread-safe: a single loop owns the engine (the server runs it in one thread).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import jax.numpy as jnp
import numpy as np

from llmjax import parallel
from llmjax.config import EngineConfig
from llmjax.kv.manager import KVCacheManager
from llmjax.kv.sizing import num_blocks_from_budget
from llmjax.models.loader import LoadedModel, default_dtype, load_model
from llmjax.request import Request, RequestStatus
from llmjax.runner import ModelRunner, enable_compilation_cache
from llmjax.sampling_params import SamplingParams
from llmjax.scheduler import Scheduler
from llmjax.tokenizer import CharTokenizer, IncrementalDetokenizer, Tokenizer, load_tokenizer

CPU_KV_BUDGET_BYTES = 1 << 30


class RequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (the API reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class RequestOutput:
    """A request's state after a step. `delta_text`/`delta_token_ids` are what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    emitted_tokens: int = 0


class LLMEngine:
    def __init__(self, model: LoadedModel, tokenizer: Tokenizer | CharTokenizer, config: EngineConfig):
        model = parallel.prepare_model(model, config.tensor_parallel_size)
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(model.config.eos_token_ids) | tokenizer.eos_token_ids
        dtype = jnp.dtype(config.dtype or default_dtype())
        kv_dtype = jnp.dtype(config.kv_cache_dtype) if config.kv_cache_dtype else dtype
        budget = config.kv_cache_memory_bytes or CPU_KV_BUDGET_BYTES
        bytes_per_token = parallel.kv_bytes_per_token_per_device(model.config, kv_dtype.itemsize,
                                                                 config.tensor_parallel_size)
        self.num_blocks = num_blocks_from_budget(budget, config.block_size, bytes_per_token)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(model, config, self.num_blocks, kv_dtype, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.time_schedule = 0.0
        self.time_update = 0.0
        self.num_steps = 0

    @classmethod
    def from_config(cls, model: str | None = None, config: EngineConfig | None = None, seed: int = 0) -> LLMEngine:
        config = config or EngineConfig()
        parallel.initialize_distributed(config)
        enable_compilation_cache(config.compilation_cache_dir)
        dtype = jnp.dtype(config.dtype or default_dtype())
        loaded = load_model(model, dtype=dtype, seed=seed)
        tokenizer = load_tokenizer(loaded.source, loaded.config.eos_token_ids)
        if loaded.config.max_position_embeddings < config.max_model_len:
            config = config.replace(max_model_len=loaded.config.max_position_embeddings)
        return cls(loaded, tokenizer, config)

    # --- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        namespace: Hashable | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request (text or token ids). Raises `RequestError`; nothing is queued then."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) else None
        if text == "":
            raise RequestError("the prompt is empty", "prompt")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._validate(ids, params)
        max_len = self.config.max_model_len
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max_len - len(ids))
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**31))
        request = Request(request_id, ids, params, seed, namespace, text)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.requests[request_id] = request
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self._text[request_id] = _TextState(detokenizer)
        self.scheduler.add(request)
        return request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if params.top_k > vocab:
            raise RequestError(f"top_k must be at most the vocabulary size {vocab} (or -1/0 to disable), "
                               f"got {params.top_k}", "top_k")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}",
                               "logit_bias")
        max_len = self.config.max_model_len
        wanted = len(ids) + (params.max_tokens or 1)
        if len(ids) >= max_len or wanted > max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested {wanted} "
                f"tokens ({len(ids)} in the prompt, {params.max_tokens or 1} for the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                "max_tokens" if len(ids) < max_len else "prompt",
            )
        if self.kv.num_blocks_for(wanted) > self.num_blocks - 1:
            raise RequestError(
                f"the request needs {self.kv.num_blocks_for(wanted)} KV blocks but the pool holds only "
                f"{self.num_blocks - 1}; raise the KV cache memory budget", "max_tokens",
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request and free its blocks; None if it is unknown or finished."""
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return self._output(request, finished=True)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for each request that sampled a token or finished."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.time_schedule += time.perf_counter() - t0
        for request in out.preempted:
            self.runner.release(request.request_id)
        if out.empty:
            return []
        tables = [self.kv.block_table(s.request.request_id) for s in out.scheduled]
        result = self.runner.execute(out, tables)
        t1 = time.perf_counter()
        self.scheduler.after_step(out)
        now = time.monotonic()
        outputs = []
        for i, scheduled in enumerate(out.scheduled):
            if not scheduled.samples:
                continue
            request = scheduled.request
            token = int(result.token_ids[i])
            request.output_token_ids.append(token)
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
                self.num_prompt_tokens += len(request.prompt_token_ids)  # counted once prefilled, as vLLM does
            if request.sampling_params.logprobs is not None:
                entry = {token: float(result.logprobs[i])}
                k = request.sampling_params.logprobs
                entry.update(zip(result.top_ids[i, :k].tolist(), result.top_logprobs[i, :k].tolist()))
                request.output_logprobs.append(entry)
            self.num_generation_tokens += 1
            status = self._check_stop(request, token)
            if status is not None:
                self._finish(request, status)
            outputs.append(self._output(request, finished=status is not None))
        self.num_steps += 1
        self.time_update += time.perf_counter() - t1
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        self.runner.release(request.request_id)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """Stop conditions, in vLLM's order. Also advances the request's text (stop strings need it)."""
        params = request.sampling_params
        state = self._text[request.request_id]
        state.text += state.detokenizer.add(token)
        n_out = len(request.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            for stop in params.stop:
                idx = state.text.find(stop, max(0, len(state.text) - len(stop) - 64))
                if idx >= 0:
                    state.text = state.text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
                    request.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request, finished: bool) -> RequestOutput:
        state = self._text[request.request_id]
        held = 0 if finished or not request.sampling_params.stop else max(map(len, request.sampling_params.stop)) - 1
        end = max(state.emitted, len(state.text) - held)
        delta = state.text[state.emitted : end]
        state.emitted = end
        new_tokens = request.output_token_ids[state.emitted_tokens :]
        state.emitted_tokens = len(request.output_token_ids)
        if finished:
            del self._text[request.request_id]
            del self.requests[request.request_id]
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            text=state.text[:end], token_ids=list(request.output_token_ids), delta_text=delta,
            delta_token_ids=new_tokens, finished=finished, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens, arrival_time=request.arrival_time,
            first_token_time=request.first_token_time, finish_time=request.finish_time,
            token_times=list(request.token_times), num_preemptions=request.num_preemptions,
        )

    # --- introspection -----------------------------------------------------------------------------
    def check_kv_invariants(self) -> None:
        self.kv.check_invariants()

    def warmup(self) -> None:
        self.runner.warmup(self.runner.warmup_shapes())
