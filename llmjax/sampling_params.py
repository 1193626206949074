"""`SamplingParams`: vLLM's field names and meanings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """An invalid sampling value; `param` names the field (the API reports it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy; top_k 0 or -1 disables top-k; top_p 1 and min_p 0 disable theirs.
    `seed` makes a request's samples reproducible whatever else shares its batch.
    `stop` strings end generation and are cut from the text (unless `include_stop_str_in_output`).
    `logprobs`: None for none, 0 for the sampled token's logprob, k for it plus the top k.
    `max_tokens` None means "up to max_model_len".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._check("n", self.n == 1, "only n=1 is supported")
        self._check("temperature", self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        self._check("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        self._check("top_k", self.top_k >= -1, f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        self._check("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        self._check("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
                    f"max_tokens must be at least 1, got {self.max_tokens}")
        self._check("min_tokens", self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        self._check("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                    f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        self._check("stop", all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        self._check("seed", self.seed is None or self.seed >= 0, f"seed must be >= 0, got {self.seed}")

    @staticmethod
    def _check(param: str, ok: bool, message: str) -> None:
        if not ok:
            raise SamplingParamsError(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
