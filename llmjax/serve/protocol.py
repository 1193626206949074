"""OpenAI-compatible request and response schemas (pydantic), with OpenAI's and vLLM's field names.

Requests: `CompletionRequest`, `ChatCompletionRequest`, `TokenizeRequest`, `DetokenizeRequest`.
They are strict: an unknown field (`response_format`, `tools`, `suffix`, guided decoding, ...) is
refused (pydantic `extra_forbidden`; the API answers 400 naming it), and types are not coerced
(`"yes"` is not a boolean, `"5"` not an integer, NaN and infinities are not numbers). Sampling
values are bounded by `SamplingParams` itself (its `SamplingParamsError` names the field); this
module checks shapes and what `SamplingParams` cannot see (prompt shapes, `best_of`, `max_tokens` 0
without `echo`, `top_logprobs` without `logprobs`, `stream_options` without `stream`).
OpenAI's `presence_penalty`, `frequency_penalty`, `logit_bias` (string token-id keys), `seed`
and `n` map onto `SamplingParams` fields of the same names; vLLM extensions: `top_k`, `min_p`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, chat's `add_generation_prompt` and `continue_final_message`, and
`cache_salt` (the prefix-cache tenant: requests with different salts never share cached blocks).
"""

from __future__ import annotations

import time
import uuid
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal, Mapping, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from llmjax.outputs import Logprob
from llmjax.request import MAX_NAMESPACE_CHARS
from llmjax.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError

Prompt = str | list[int]
MAX_PROMPTS = 1024  # prompts in one completion request (each becomes n engine requests)
MAX_STOP_STRINGS = 64  # every new token of a request is checked against each of its stop strings


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# --- requests ------------------------------------------------------------------------------------
def _check_unicode(text: str) -> str:
    """JSON can spell a lone UTF-16 surrogate (`"\\ud800"`); such a string has no UTF-8 form, so no
    tokenizer or response could carry it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the string is not valid Unicode (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_check_unicode)]


class StrictRequest(BaseModel):
    """Unknown fields are refused; values are not coerced; floats are finite; strings are valid
    Unicode. A known field given as `null` takes its default (OpenAI's schema marks the optional
    fields nullable; vLLM declares them `Optional`), except the fields in `NULL_IS_NONE`, for which
    `null` means what vLLM makes of it: no value (e.g. no limit)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    NULL_IS_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or k in cls.NULL_IS_NONE}
        return data


class StreamOptions(StrictRequest):
    """`continuous_usage_stats` (vLLM's): every chunk also carries the usage so far of its choice
    (its prompt's tokens and the tokens that choice generated); needs `include_usage`."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class _SamplingRequest(StrictRequest):
    """Fields both generation endpoints share."""

    model: Text | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # OpenAI's JSON: token id (a decimal string) -> bias
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Text | None = None

    @field_validator("cache_salt")
    @classmethod
    def _bounded_tenant(cls, salt: str | None):
        if salt is not None and not 0 < len(salt) <= MAX_NAMESPACE_CHARS:
            raise ValueError(f"must be a non-empty string of at most {MAX_NAMESPACE_CHARS} characters if given, "
                             f"got {len(salt)} characters")
        return salt

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, stop: str | list[str] | None):
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _sampling_params(self, defaults: Mapping[str, Any], max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises `SamplingParamsError` for a bad value. `defaults`: the model's sampling defaults
        (`LLMEngine.generation_defaults`) for the fields the client did not send; a default
        `max_tokens` caps the request's (as vLLM's server applies a generation config's
        `max_new_tokens`)."""
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options", "stream_options can only be given with stream: true")
        if self.continuous_usage and not self.include_usage:
            raise SamplingParamsError("stream_options", "stream_options.continuous_usage_stats needs include_usage")
        sampling = {name: defaults[name] if name in defaults and name not in self.model_fields_set else
                    getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        if defaults.get("max_tokens") is not None:
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
        return SamplingParams(
            n=self.n, **sampling,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=() if self.stop is None else self.stop,  # "" reaches SamplingParams, which refuses it
            stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class CompletionRequest(_SamplingRequest):
    """`max_tokens` defaults to 16 (OpenAI's default); `null` is no limit but `max_model_len` (as in vLLM).
    `echo` returns the prompt before the completion; with `logprobs` the prompt's tokens come with
    theirs too (the first token's are null), as lm-evaluation-harness's loglikelihood tasks read them.
    `max_tokens` 0 is allowed with `echo` only: the response is the prompt alone (`echo_only`; the
    engine generates one token, which the response leaves out, as vLLM does)."""

    NULL_IS_NONE = frozenset({"max_tokens"})
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, prompt: Any):
        """A string, a list of strings, token ids, or a list of token-id lists; nothing empty."""
        if isinstance(prompt, str) or _is_token_ids(prompt) and prompt:
            items = [prompt]
        elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                        or all(_is_token_ids(p) for p in prompt)):
            items = prompt
        else:
            raise ValueError("the prompt must be a non-empty string, list of strings, list of token ids "
                             "or list of token-id lists")
        if any(len(p) == 0 for p in items):
            raise ValueError("the prompt is empty")
        for p in items:
            if isinstance(p, str):
                _check_unicode(p)
        if len(items) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}")
        return prompt

    def prompts(self) -> list[Prompt]:
        """The prompts of this request, one engine request each."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def sampling_params(self, defaults: Mapping[str, Any] = MappingProxyType({})) -> SamplingParams:
        """This request's parameters over the model's `defaults` (see `_sampling_params`)."""
        if self.best_of not in (None, 1):
            raise SamplingParamsError("best_of", "only best_of=1 is supported")
        if self.best_of is not None and self.best_of < self.n:
            raise SamplingParamsError("best_of", f"best_of must be at least n ({self.n}), got {self.best_of}")
        if self.max_tokens == 0 and not self.echo:
            raise SamplingParamsError("max_tokens", "max_tokens must be at least 1 (0 only with echo), got 0")
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(defaults, 1 if self.echo_only else self.max_tokens, self.logprobs,
                                     prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        """The response is the echoed prompt alone (`echo` with `max_tokens` 0)."""
        return self.echo and self.max_tokens == 0


class TextPart(StrictRequest):
    type: Literal["text"]
    text: Text


class ChatContent(StrictRequest):
    """A chat message's content: a string or a list of OpenAI content parts, text parts only (an
    image or other part is refused; an empty list is empty text, as in vLLM). The server's
    `ChatMessage` and the offline `LLM.chat` check content with this one model."""

    content: Text | list[TextPart]

    def text(self) -> str:
        """The content as the chat template sees it: text parts joined by newlines (as vLLM does)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatMessage(ChatContent):
    """A conversation turn. `developer` is OpenAI's newer name for the `system` role: the chat template
    sees `system`. `name` (the participant's name) reaches the chat template as the message's `name`,
    as in vLLM; a template that has no use for it leaves it out (SmolLM2's does)."""

    role: Literal["system", "developer", "user", "assistant"]
    name: Text | None = None

    def as_dict(self) -> dict[str, str]:
        """The message as the chat template sees it (`ChatContent.text`)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant turn's header
    # vLLM's: the reply goes on with the last message's text (with add_generation_prompt false)
    continue_final_message: bool = False

    def sampling_params(self, defaults: Mapping[str, Any] = MappingProxyType({})) -> SamplingParams:
        """This request's parameters over the model's `defaults` (see `_sampling_params`)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        try:
            return self._sampling_params(defaults, max_tokens, logprobs)
        except SamplingParamsError as exc:  # report the fields the client sent
            param, message = exc.param, str(exc)
            if param == "logprobs":
                param, message = "top_logprobs", message.replace("logprobs", "top_logprobs")
            if self.max_completion_tokens is not None:  # also in another field's message (min_tokens)
                param = "max_completion_tokens" if param == "max_tokens" else param
                message = message.replace("max_tokens", "max_completion_tokens")
            if (param, message) == (exc.param, str(exc)):
                raise
            raise SamplingParamsError(param, message) from exc


class TokenizeRequest(StrictRequest):
    """Exactly one of `prompt` and `messages`. `add_special_tokens`: the tokenizer's own special
    tokens (BOS), by default with a prompt and not with messages, whose chat template writes its
    own (vLLM's defaults); `add_generation_prompt` and `continue_final_message` only with messages."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class DetokenizeRequest(StrictRequest):
    model: Text | None = None
    tokens: list[int]


# --- responses -------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    def add(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        self.prompt_tokens_details.cached_tokens += cached_tokens


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Also each streamed chunk (`choices` holds the deltas; the usage chunk has no choices)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_fields(self, delta: DeltaMessage) -> dict[str, str]:
        return delta.model_dump(exclude_none=True)  # as OpenAI: only the fields this chunk sets


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """vLLM's model card: `root` is the model served under `id`; no fine-tune parent."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "llmjax"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _is_type_tag(part: Any) -> bool:
    """Pydantic names each member of a union it tried in an error's location ("str", "list[int]",
    "TextPart"); field names are lower-case identifiers and indices are ints."""
    return isinstance(part, str) and (not part.isidentifier() or part[:1].isupper() or part in ("str", "int",
                                                                                                "float", "bool"))


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """The message reporting pydantic validation `errors` (each `loc` taken from the request's
    root), and the dotted path of the parameter it names (None for the root). A union (`content`:
    a string or a list of parts) reports a failure per member; the member that got deepest into the
    value is the one the client meant, so the deepest error is reported and the others counted."""
    first = max(errors, key=lambda e: len(e["loc"]))
    param = ".".join(str(part) for part in first["loc"] if not _is_type_tag(part)) or None
    if first["type"] == "extra_forbidden":
        message = f"unsupported parameter: `{param}` is not supported by llmjax"
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; `code` is the HTTP status (as vLLM sends it; a stream's error event
    carries the status the request would have had)."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()


# --- logprobs ---------------------------------------------------------------------------------------
def completion_logprobs(token_text, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """Legacy-completions logprobs of `token_ids`; each entry maps the token, then the top `logprobs`
    ids, to their logprobs, and all of it is returned (OpenAI: "the logprob of the sampled token, so
    there may be up to logprobs+1 elements", as vLLM does); an entry None (an echoed prompt's first
    token) gives null. `token_text(id)` renders a token; offsets count the tokens' text from
    `text_offset`. Returns the logprobs and the offset after the last token."""
    result = CompletionLogprobs()
    for token, entry in zip(token_ids, entries, strict=True):
        text = token_text(token)
        result.tokens.append(text)
        result.token_logprobs.append(None if entry is None else entry[token].logprob)
        result.top_logprobs.append(None if entry is None else {token_text(t): e.logprob for t, e in entry.items()})
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result, text_offset


def chat_logprobs(token_text, token_bytes, token_ids: list[int], entries: list[dict[int, Logprob]],
                  k: int) -> ChatLogprobs:
    """Chat-completions logprobs of `token_ids` with the top `k` alternatives of each; `token_text(id)`
    renders a token, `token_bytes(id)` gives its bytes (part of a character's, for a token that
    splits one)."""

    def top_k(entry: dict[int, Logprob]) -> list[tuple[int, float]]:  # the sampled token only if it ranks
        return sorted(((t, e.logprob) for t, e in entry.items()), key=lambda item: -item[1])[:k]

    def top(token: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=token_text(token), logprob=logprob, bytes=list(token_bytes(token)))

    content = [
        ChatTokenLogprob(**top(token, entry[token].logprob).model_dump(),
                         top_logprobs=[top(t, lp) for t, lp in top_k(entry)])
        for token, entry in zip(token_ids, entries)
    ]
    return ChatLogprobs(content=content)
