"""`Request`: one generation request as the scheduler and engine track it.

Ownership: the engine creates it and gives it to the scheduler, which from then on owns its
per-step state (queues, progress, batch row, sampled tokens, stops); the engine reads it to build
outputs and may finish it (a stop string, an abort, a failure) through the scheduler.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

from llmjax.outputs import Logprob
from llmjax.sampling_params import SamplingParams

# a tenant's name is kept (in the radix tree) while its pages stay cached, so it is bounded: the
# engine refuses a longer namespace, the server a longer `cache_salt`
MAX_NAMESPACE_CHARS = 1024


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed while serving it

    @property
    def finished(self) -> bool:
        return self is not _WAITING and self is not _RUNNING


_WAITING, _RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING  # read per request per step: plain globals


@dataclass(eq=False, slots=True)
class Request:
    """Prompt and output token ids, progress, status, timings.

    `num_computed_tokens`: tokens whose KV is in the cache or being written by a dispatched step
    (a prefix hit counts). `num_pending`: tokens sampled by a dispatched step that have not reached
    the host yet (0 or 1; asynchronous scheduling), the last at `inflight_index` in that step's
    sampled tokens. The request needs `num_tokens + num_pending - num_computed_tokens` more tokens
    computed before it can sample. `num_cached_tokens`: the prompt tokens the prefix cache served when
    it was first admitted (a re-admission after preemption finds its own blocks: no hit).
    `row`: its batch row while running (-1 otherwise).
    `prompt_logprobs`: None unless this sample collects its prompt's logprobs
    (`SamplingParams.prompt_logprobs`, the first sample only); then one entry per prompt token
    computed so far, None for the first token. The engine appends them; until they are complete the
    scheduler admits the request without prefix-cache hits (`collecting_prompt_logprobs`).
    `namespace` is the prefix-cache tenant (None: the shared default). `seed` may be any 64-bit
    integer (the sampler folds it into the PRNG key as two 32-bit words). `owner`: the engine's
    record of the request it is one sample of (opaque to the scheduler). `key`: its name in the
    KV manager, unique among live requests (default: `request_id`; the engine numbers its samples,
    as the ids callers give may clash with a sample's `<id>#<i>`). `group`: shared by the samples
    of one request (default: `key`), so a static or dynamic batch takes all of them.
    Compared and hashed by identity.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    namespace: Hashable | None = None
    prompt: str | None = None
    sample_index: int = 0  # which of its parent request's n samples this is
    owner: Any = None
    key: Hashable = None
    group: Hashable = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_pending: int = 0
    inflight_index: int = -1
    row: int = -1
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None  # set by the simulator (the engine keeps `RequestMetrics`)
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # the simulator's step times of its tokens

    def __post_init__(self) -> None:
        if self.key is None:
            self.key = self.request_id
        if self.group is None:
            self.group = self.key

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

    def token_at(self, i: int) -> int:
        """`all_token_ids[i]` without building the list."""
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    @property
    def collecting_prompt_logprobs(self) -> bool:
        """Whether some prompt token still lacks its logprobs entry."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens known on the host (pending ones excluded)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        status = self.status  # no enum hashing (a Python-level __hash__) per request per step
        return None if status is _RUNNING or status is _WAITING else status._value_
