"""`LLMEngine`: add requests, step, abort; stop conditions, detokenization and outputs.

One step = schedule (scheduler + KV manager), execute (runner: one jitted forward + sampling),
then append the sampled tokens, check stops, and return delta outputs (`llmjax.outputs`).
Not thread-safe: a single loop owns the engine (the server runs it in one thread).

A request with `n` > 1 is n scheduler requests ("samples", ids `<id>#<i>`) under one parent id; the
engine holds samples 1..n-1 back until sample 0 has sampled its first token, so they find the
prompt's full pages in the prefix cache and the prompt is computed once.

Fault isolation: an exception while preparing a request (in `add_request`) reaches only its
caller, with nothing queued; one inside a step fails only the requests in that step (finished
outputs with `error` set, blocks freed); one while appending a request's token fails that request.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llmjax import parallel
from llmjax.cpu_flags import apply_cpu_flags
from llmjax.config import EngineConfig
from llmjax.kv.manager import KVCacheManager
from llmjax.kv.sizing import device_memory_stats, kv_budget_bytes, largest_step_shapes, num_blocks_from_budget
from llmjax.models.loader import LoadedModel, default_dtype, load_model
from llmjax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmjax.request import Request, RequestStatus
from llmjax.runner import ModelRunner, enable_compilation_cache
from llmjax.sampling_params import SamplingParams
from llmjax.scheduler import Scheduler, SchedulerOutput
from llmjax.tokenizer import CharTokenizer, IncrementalDetokenizer, Tokenizer, load_tokenizer

CPU_KV_BUDGET_BYTES = 1 << 30

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (the API reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class _SequenceState:
    """Per sample: its text so far and what of it was already returned."""

    parent_id: str
    detokenizer: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already returned
    emitted_tokens: int = 0  # tokens (and logprob entries) already returned
    cumulative_logprob: float = 0.0


@dataclass(eq=False)
class _Parent:
    """A request as the caller sees it: its n samples (`children`, sample i at index i)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    arrival_time: float
    held: list[Request] = field(default_factory=list)  # samples not yet given to the scheduler
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per step that sampled any of its tokens


class LLMEngine:
    def __init__(self, model: LoadedModel, tokenizer: Tokenizer | CharTokenizer, config: EngineConfig):
        model = parallel.prepare_model(model, config.tensor_parallel_size)
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(model.config.eos_token_ids) | tokenizer.eos_token_ids
        weights_dtype = jax.tree.leaves(model.params)[0].dtype
        kv_dtype = jnp.dtype(config.kv_cache_dtype) if config.kv_cache_dtype else jnp.dtype(weights_dtype)
        budget = config.kv_cache_memory_bytes
        if budget is None and device_memory_stats() is not None:  # an accelerator: vLLM's rule
            profiler = ModelRunner(model, config, 2, kv_dtype, self.eos_token_ids)  # weights resident
            budget = kv_budget_bytes(config.gpu_memory_utilization, device_memory_stats,
                                     lambda: profiler.warmup(largest_step_shapes(profiler)))
            del profiler
        budget = budget or CPU_KV_BUDGET_BYTES
        bytes_per_token = parallel.kv_bytes_per_token_per_device(model.config, kv_dtype.itemsize,
                                                                 config.tensor_parallel_size)
        self.num_blocks = num_blocks_from_budget(budget, config.block_size, bytes_per_token)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(model, config, self.num_blocks, kv_dtype, self.eos_token_ids)
        self.requests: dict[str, Request] = {}  # every sample's id -> its Request
        self._parents: dict[str, _Parent] = {}
        self._sequences: dict[str, _SequenceState] = {}  # every sample's id -> its text state
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
        apply_cpu_flags()  # before anything starts JAX's backend
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
        """Validate and queue a request (text or token ids) with its `params.n` samples.

        Raises `RequestError` for a request the engine refuses, or whatever preparing it raised (the
        tokenizer, say); either way nothing is queued and no other request is affected.
        """
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self._parents or any(c in self.requests for c in child_ids):
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) else None
        if text == "":
            raise RequestError("the prompt is empty", "prompt")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._validate(ids, params)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.config.max_model_len - len(ids))
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = [Request(child_id, ids, params, seed, namespace, text, sample_index=i, arrival_time=arrival)
                    for i, child_id in enumerate(child_ids)]
        states = [_SequenceState(request_id, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens))
                  for _ in children]
        # nothing above changed the engine; from here on nothing raises
        parent = _Parent(request_id, text, ids, params, children, arrival)
        self._parents[request_id] = parent
        for child, state in zip(children, states):
            self.requests[child.request_id] = child
            self._sequences[child.request_id] = state
        # The other samples wait until the first one's prompt is computed, then find its full pages in
        # the prefix cache: the prompt is computed once.
        released = children if not self.config.enable_prefix_caching else children[:1]
        parent.held = children[len(released):]
        for child in released:
            self.scheduler.add(child)
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
        if params.n > self.config.max_num_seqs:
            raise RequestError(f"n ({params.n}) must be at most max_num_seqs ({self.config.max_num_seqs})", "n")
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
        """Abort a request (all its samples) and free its blocks; None if it is unknown or finished."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        return self._end(parent, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. Returns a DELTA output (see `llmjax.outputs`) for each request
        that sampled a token or finished.

        If the step itself fails (the runner raises), only the requests in it fail: each gets a
        finished output with `error` set, its blocks are freed, and later steps run as usual.
        """
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.time_schedule += time.perf_counter() - t0
        for request in out.preempted:
            self.runner.release(request.request_id)
        if out.empty:
            return []
        try:
            tables = [self.kv.block_table(s.request.request_id) for s in out.scheduled]
            result = self.runner.execute(out, tables)
        except Exception as exc:
            log.exception("engine step failed; failing its %d requests", len(out.scheduled))
            return self._fail_step(out, exc)
        t1 = time.perf_counter()
        self.scheduler.after_step(out)
        now = time.monotonic()
        changed: dict[str, list[Request]] = {}  # parent id -> its samples that changed, in order
        failed: list[RequestOutput] = []
        for i, scheduled in enumerate(out.scheduled):
            request = scheduled.request
            if not scheduled.samples or request.status.finished:  # finished: its request failed in this step
                continue
            parent = self._parents[self._sequences[request.request_id].parent_id]
            try:
                self._append_token(request, parent, result, i, now)
            except Exception as exc:  # e.g. the detokenizer on this request's token: fail it alone
                log.exception("request %s failed", parent.request_id)
                done_in_step = changed.pop(parent.request_id, [])
                failed.append(self._end(parent, RequestStatus.FINISHED_ERROR, f"{type(exc).__name__}: {exc}",
                                        done_in_step))
                continue
            changed.setdefault(parent.request_id, []).append(request)
        outputs = [self._output(self._parents[pid], children) for pid, children in changed.items()
                   if pid in self._parents]
        self.num_steps += 1
        self.time_update += time.perf_counter() - t1
        return outputs + failed

    def _append_token(self, request: Request, parent: _Parent, result, i: int, now: float) -> None:
        """Append the sampled token to `request`, check its stops; release held siblings after the first token."""
        token = int(result.token_ids[i])
        request.output_token_ids.append(token)
        request.token_times.append(now)
        if request.first_token_time is None:
            request.first_token_time = now
            if request.sample_index == 0:
                self.num_prompt_tokens += len(request.prompt_token_ids)  # counted once prefilled, as vLLM does
        if parent.first_token_time is None:
            parent.first_token_time = now
        if not parent.token_times or parent.token_times[-1] != now:
            parent.token_times.append(now)
        state = self._sequences[request.request_id]
        params = request.sampling_params
        if params.logprobs is not None:
            entry = {token: float(result.logprobs[i])}
            entry.update(zip(result.top_ids[i, :params.logprobs].tolist(),
                             result.top_logprobs[i, :params.logprobs].tolist()))
            request.output_logprobs.append(entry)
            state.cumulative_logprob += float(result.logprobs[i])
        self.num_generation_tokens += 1
        status = self._check_stop(request, token)
        if status is not None:
            self._finish(request, status)
        for sibling in parent.held:  # the prompt is computed and its full pages cached
            self.scheduler.add(sibling)
        parent.held = []

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Fail every request of a step that raised; if the runner lost its device state, recompute
        the others (their KV is gone) and drop the prefix cache."""
        message = f"the engine step failed: {type(exc).__name__}: {exc}"
        parent_ids = dict.fromkeys(self._sequences[s.request.request_id].parent_id for s in out.scheduled)
        outputs = [self._end(self._parents[pid], RequestStatus.FINISHED_ERROR, message) for pid in parent_ids]
        if self.runner.recover():
            log.error("the runner's device state was lost; running requests are recomputed")
            self.scheduler.preempt_all()
            self.kv.reset_prefix_cache()
        self.num_steps += 1
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """End one sample: free its blocks and penalty row."""
        self.scheduler.finish(request, status)
        self.runner.release(request.request_id)

    def _end(self, parent: _Parent, status: RequestStatus, error: str | None = None,
             changed: Sequence[Request] = ()) -> RequestOutput:
        """End every unfinished sample of `parent` with `status`; returns the final delta output (of
        those samples and of `changed`, samples whose new tokens were not returned yet)."""
        unfinished = [c for c in parent.children if not c.status.finished]
        reported = [c for c in parent.children if c in changed or c in unfinished]
        held = set(map(id, parent.held))
        parent.held = []
        for child in unfinished:
            if id(child) in held:  # never queued: nothing to free
                child.status, child.finish_time = status, time.monotonic()
            else:
                self._finish(child, status)
        output = self._output(parent, reported)
        output.error = error
        return output

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """Stop conditions, in vLLM's order. Also advances the request's text (stop strings need it)."""
        params = request.sampling_params
        state = self._sequences[request.request_id]
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

    def _completion_delta(self, request: Request) -> CompletionOutput:
        """What `request` added since its last output (text held back while it may start a stop string)."""
        state = self._sequences[request.request_id]
        params = request.sampling_params
        finished = request.status.finished
        held = 0 if finished or not params.stop else max(map(len, params.stop)) - 1
        end = max(state.emitted, len(state.text) - held)
        text = state.text[state.emitted : end]
        state.emitted = end
        start, state.emitted_tokens = state.emitted_tokens, len(request.output_token_ids)
        want_logprobs = params.logprobs is not None
        return CompletionOutput(
            index=request.sample_index, text=text, token_ids=request.output_token_ids[start:],
            cumulative_logprob=state.cumulative_logprob if want_logprobs else None,
            logprobs=request.output_logprobs[start:] if want_logprobs else None,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
        )

    def _output(self, parent: _Parent, children: list[Request]) -> RequestOutput:
        """The delta output of `parent` for its samples `children`; forgets a finished parent."""
        completions = [self._completion_delta(c) for c in children]
        finished = all(c.status.finished for c in parent.children)
        first = parent.children[0]
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time, first_scheduled_time=first.scheduled_time,
            first_token_time=parent.first_token_time,
            finish_time=max(c.finish_time for c in parent.children) if finished else None,
            num_preemptions=sum(c.num_preemptions for c in parent.children),
            num_generation_tokens=sum(len(c.output_token_ids) for c in parent.children),
            token_times=list(parent.token_times) if finished else [],
        )
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                del self.requests[child.request_id]
                del self._sequences[child.request_id]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            outputs=completions, finished=finished, metrics=metrics, num_cached_tokens=first.num_cached_tokens,
        )

    # --- introspection -----------------------------------------------------------------------------
    def check_kv_invariants(self) -> None:
        self.kv.check_invariants()

    def warmup(self) -> None:
        self.runner.warmup(self.runner.warmup_shapes())
