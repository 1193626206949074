"""`Request`: one generation request as the scheduler and engine track it.

Ownership: the engine creates it; the scheduler moves it between queues and advances
`num_computed_tokens`; the engine appends sampled tokens and finishes it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Hashable

from llmjax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed while serving it

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    """Prompt and output token ids, progress, status, timings.

    `num_computed_tokens`: tokens whose KV is in the cache (a prefix hit counts). The request
    needs `len(all_token_ids) - num_computed_tokens` more tokens computed before it can sample.
    `namespace` is the prefix-cache tenant (None: the shared default). `seed` may be any 64-bit
    integer (the sampler folds it into the PRNG key as two 32-bit words).
    Compared and hashed by identity.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    namespace: Hashable | None = None
    prompt: str | None = None
    sample_index: int = 0  # which of its parent request's n samples this is
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without concatenating the whole sequence (a decode step's one
        token costs O(1), not O(length))."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - p)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
