"""What the engine returns, in vLLM's shape: `RequestOutput` holding one `CompletionOutput` per
sample (`n` of them), and the request's timings under `metrics`.

`LLMEngine.step()` returns DELTAS by default (vLLM's `RequestOutputKind.DELTA`): each output
carries only what that step added (new text, new token ids, new logprobs) for the samples that
changed, so a step costs O(new tokens), not O(tokens so far). Consumers that want whole outputs
accumulate them with `OutputAccumulator`, or ask (`SamplingParams.output_kind`) for
`RequestOutputKind.CUMULATIVE` (vLLM's default: every step, a copy of all the output so far) or
`FINAL_ONLY` (the offline API and the server's non-streamed responses do), which builds no output
until the request has finished and then returns all of it in one output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """A token's entry in a logprobs dict (vLLM's `Logprob`): its logprob under the model's raw
    distribution, its rank there (1 for the most probable; the sampled or prompt token's counts the
    tokens at least as probable, a top token's is its place in the top list) and its text alone
    (`Tokenizer.token_to_text`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. In a delta: the text, token ids and logprobs this step added;
    `cumulative_logprob` is the running total (None unless logprobs were requested, as in vLLM)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the sampled token's entry first, then the top ones
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """The request's timings (`time.monotonic()` seconds), one live object per request: every delta
    refers to it (nothing is copied per step), so it is complete once the request has finished.
    `token_times`: when each step that sampled any of its tokens finished."""

    arrival_time: float  # when the caller got it (the server: before tokenizing)
    queued_time: float | None = None  # when the engine queued it, after tokenizing (vLLM's queued_ts)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_generation_tokens: int = 0  # over all samples, so far
    token_times: list[float] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)  # per sample, once finished


@dataclass(slots=True)
class RequestOutput:
    """A request's outputs after a step. `finished` when every sample has finished. `error` is set
    (and every unfinished sample ends with finish_reason "error") when the engine failed the request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    # with `SamplingParams.prompt_logprobs`: per prompt token, None for the first, then {token id: Logprob},
    # the prompt's token first, then the top ones. In one output only: the first once they are all
    # computed (a DELTA request's first token), or the final one
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, delta: RequestOutput) -> None:
        """Append a later delta of the same request to this (accumulated) output."""
        by_index = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(_copy(new))
                continue
            old.text += new.text
            old.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if old.logprobs is None:
                    old.logprobs = []
                old.logprobs.extend(new.logprobs)
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished, self.metrics = delta.finished, delta.metrics
        self.num_cached_tokens, self.error = delta.num_cached_tokens, delta.error
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


def _copy(c: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(c, token_ids=list(c.token_ids),
                               logprobs=None if c.logprobs is None else list(c.logprobs))


def snapshot(output: RequestOutput) -> RequestOutput:
    """A copy of `output` that later `add`s to it do not change (its samples sorted by index)."""
    return dataclasses.replace(output, outputs=sorted(map(_copy, output.outputs), key=lambda c: c.index))


class RequestFailedError(RuntimeError):
    """The engine failed a request while serving it (its output's `error`); a server error, not the client's."""


class OutputAccumulator:
    """Whole outputs from deltas, by request id. The deltas it is given are never mutated."""

    def __init__(self) -> None:
        self.outputs: dict[str, RequestOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput:
        """Fold `delta` in; returns the request's accumulated output so far. A delta of an id whose
        output has finished starts a new output (the id was used again, by a new request)."""
        whole = self.outputs.get(delta.request_id)
        if whole is None or whole.finished:
            whole = self.outputs[delta.request_id] = snapshot(delta)
        else:
            whole.add(delta)
        return whole
