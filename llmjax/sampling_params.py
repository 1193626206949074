"""`SamplingParams`: vLLM's field names and meanings, validated on construction.

Every field is type-checked and bounded here, so the offline API and the server refuse the same
values with the same `SamplingParamsError` (which names the field). What needs the model
(`logit_bias` ids against the vocabulary) is checked by the engine (`RequestError`).
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any, Mapping

MAX_LOGPROBS = 20
MAX_N = 64  # parallel samples per request
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_END = -(2**63), 2**64  # any signed or unsigned 64-bit integer
MAX_PENALTY = 2.0  # presence / frequency in [-2, 2]
# repetition: any float32 above 0, as in vLLM; a smaller one than float32's smallest normal number is 0 on
# the device, a larger one than its largest is infinite
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 2.0 ** -126, (2 - 2.0 ** -23) * 2.0 ** 127
MAX_LOGIT_BIAS = 100.0
_TOKEN_ID_TEXT = re.compile(r"[0-9]{1,10}")  # a logit_bias key as OpenAI's JSON sends it; ASCII digits only
FLOAT32_MAX = 3.4028234663852886e38  # the sampler's temperatures are float32: a larger one would be inf
MIN_TEMPERATURE = 0.01  # a smaller positive temperature is raised to it (as vLLM does): logits / T would overflow

log = logging.getLogger(__name__)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request (vLLM's names): `DELTA`, what each step added
    (streams; O(new tokens) a step); `CUMULATIVE`, everything so far, every step (vLLM's default:
    each output is a fresh copy, so a step costs O(tokens so far) a request); `FINAL_ONLY`, one
    whole output when the request finishes (the offline API and non-streamed responses: no
    per-step output is built)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class SamplingParamsError(ValueError):
    """An invalid sampling value; `param` names the field (the API reports it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy; a positive one below 0.01 is raised to 0.01 (with a warning, as vLLM
    does: dividing logits by a smaller one overflows float32); top_k 0 or -1 disables top-k (so does one at least the
    vocabulary size, which vLLM clamps to it); top_p 1 and min_p 0 disable theirs.
    `seed` (any 64-bit integer) makes a request's samples reproducible whatever else shares its
    batch, up to float rounding (see `llmjax.sampler`); with `n` > 1 each of the n samples draws from
    its own stream derived from it. -1 means no seed (None), as in vLLM.
    `stop` strings end generation and are cut from the text (unless `include_stop_str_in_output`),
    as is the text of an EOS or `stop_token_ids` token that ends it (its id stays in the token ids).
    `logprobs`: None for none, 0 for the sampled token's logprob, k for it plus the top k.
    `prompt_logprobs` (vLLM's): the same for each prompt token after the first, from the model's
    raw distribution (no temperature, penalties or bias) at the token before it; the request then
    computes its whole prompt (no prefix-cache hit) until every prompt token has its entry.
    `max_tokens` None means "up to max_model_len". Until `min_tokens` tokens are generated, EOS
    and `stop_token_ids` cannot be sampled and no stop condition applies.
    Penalties (vLLM's): `presence_penalty` and `frequency_penalty` subtract from the logit of each
    token already in the output (once / per occurrence); `repetition_penalty` divides the positive
    logits (multiplies the negative ones) of tokens in the prompt or the output. `logit_bias` adds
    a bias to a token id's logit (keys may be ints or decimal strings, as in OpenAI's JSON).
    `output_kind`: deltas every step (the default), all the output so far every step, or one final
    output (`RequestOutputKind`).
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
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        self._check("stop", isinstance(self.stop, (list, tuple)) or self.stop is None,
                    "stop must be a string or a list of strings")
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        self._check("stop_token_ids", isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None,
                    "stop_token_ids must be a list of integers")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            self._check(name, isinstance(value, bool), f"{name} must be true or false, got {value!r}")
        self._int("n", self.n, 1, MAX_N)
        self._real("temperature", self.temperature)
        self._check("temperature", self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        self._check("temperature", self.temperature <= FLOAT32_MAX,
                    f"temperature must be at most {FLOAT32_MAX:.4g} (float32's largest), got {self.temperature}")
        self._real("top_p", self.top_p)
        self._check("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        self._int("top_k", self.top_k, -1, INT32_MAX)
        self._real("min_p", self.min_p)
        self._check("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self._check("seed", _is_int(self.seed) and SEED_MIN <= int(self.seed) < SEED_END,
                        f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
            if self.seed == -1:  # vLLM's "no seed"
                object.__setattr__(self, "seed", None)
        if self.max_tokens is not None:
            self._int("max_tokens", self.max_tokens, 1, INT32_MAX)
        self._int("min_tokens", self.min_tokens, 0, INT32_MAX)
        self._check("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
                    f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            self._int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self._int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self._check("stop", all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        self._check("stop_token_ids", all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
                    "stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._real(name, value)
            self._check(name, -MAX_PENALTY <= value <= MAX_PENALTY, f"{name} must be in [-2, 2], got {value}")
        self._real("repetition_penalty", self.repetition_penalty)
        self._check("repetition_penalty",
                    MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                    f"repetition_penalty must be a finite float32 above 0 (in [{MIN_REPETITION_PENALTY:.2g}, "
                    f"{MAX_REPETITION_PENALTY:.4g}]), got {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", self._checked_logit_bias(self.logit_bias))
        self._check("output_kind", isinstance(self.output_kind, RequestOutputKind),
                    f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        # numbers as Python's own types from here on (a NumPy scalar would overflow or wrap in arithmetic)
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature %g is below %g, which overflows the logits divided by it; it is raised to %g",
                        self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        object.__setattr__(self, "stop_token_ids", tuple(map(int, self.stop_token_ids)))

    def _checked_logit_bias(self, bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        self._check("logit_bias", isinstance(bias, Mapping), "logit_bias must map token ids to biases")
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and _TOKEN_ID_TEXT.fullmatch(key.strip()) else key
            self._check("logit_bias", _is_int(token) and 0 <= token <= INT32_MAX,
                        f"logit_bias keys must be token ids (non-negative integers), got {reprlib.repr(key)}")
            self._check("logit_bias", _is_real(value) and abs(value) <= MAX_LOGIT_BIAS,
                        f"logit_bias values must be in [-100, 100], got {value!r} for token {key!r}")
            out[int(token)] = float(value)
        return out or None

    @staticmethod
    def _check(param: str, ok: bool, message: str) -> None:
        if not ok:
            raise SamplingParamsError(param, message)

    def _int(self, param: str, value: Any, lo: int, hi: int) -> None:
        self._check(param, _is_int(value) and lo <= value <= hi,
                    f"{param} must be an integer in [{lo}, {hi}], got {value!r}")

    def _real(self, param: str, value: Any) -> None:
        self._check(param, _is_real(value), f"{param} must be a finite number, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_logits_processing(self) -> bool:
        """Whether the sampler must adjust this request's logits (penalties, bias, min_tokens)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.logit_bias is not None or self.min_tokens > 0)
