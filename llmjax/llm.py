"""The offline API, as vLLM's: `LLM(model, **engine_args).generate(prompts, sampling_params)` and
`LLM.chat(conversations, sampling_params)`.

Prompts take vLLM's forms: a string, a list of token ids, `{"prompt": str}`, `{"prompt_token_ids":
[int, ...]}`, or a list of those; either mapping may also hold vLLM's `"cache_salt"` (the request's prefix-cache
tenant: requests of different salts never share cached pages). A chat conversation (a list of
`{"role", "content"}` messages) goes through `chat`, which renders it with the model's chat
template; a message's content is a string or a list of OpenAI text parts, as the server takes it.
Both return one finished `RequestOutput` per prompt, in input order (`llmjax.outputs`:
`.outputs[i].text`, `.token_ids`, ...). `get_tokenizer()` is the engine's tokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from pydantic import ValidationError
from tqdm import tqdm

from llmjax.config import ConfigError, EngineConfig
from llmjax.engine import LLMEngine
from llmjax.outputs import RequestOutput
from llmjax.sampling_params import RequestOutputKind, SamplingParams
from llmjax.serve.protocol import ChatContent, validation_message
from llmjax.tokenizer import CharTokenizer, Tokenizer

Prompt = str | Mapping[str, Any]  # str | {"prompt": str} | {"prompt_token_ids": list[int]}, + "cache_salt"
Conversation = Sequence[Mapping[str, Any]]  # messages: {"role": str, "content": str | [{"type": "text", ...}]}
log = logging.getLogger(__name__)


def _template_message(message: Any, loc: tuple[str | int, ...]) -> dict[str, Any]:
    """`message` as the chat template sees it, as the server makes it: its `content` checked and made
    text by the server's `ChatContent` (a string, or OpenAI text parts joined by newlines), role
    `developer` as `system`, a `name` of None left out (as the server's `ChatMessage` leaves it), its
    other keys as they are. ValueError, worded as the server's 400 and placed at `loc` (the
    message's own), for anything else (a `name` that is no string)."""
    where = ".".join(map(str, loc))
    if not isinstance(message, Mapping):
        raise ValueError(f"{where}: a message is a mapping with 'role' and 'content', got {message!r:.80}")
    if not isinstance(message.get("role"), str):
        raise ValueError(f"{where}.role: a message's role is a string, got {message.get('role')!r:.80}")
    try:
        content = ChatContent.model_validate({"content": message["content"]} if "content" in message else {})
    except ValidationError as exc:
        raise ValueError(validation_message([{**e, "loc": (*loc, *e["loc"])} for e in exc.errors()])[0]) from None
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}.name: a message's name is a string, got {name!r:.80}")
    role = "system" if message["role"] == "developer" else message["role"]
    rest = {key: value for key, value in message.items() if not (key == "name" and value is None)}
    return {**rest, "role": role, "content": content.text()}


class LLM:
    """A model plus an engine, for batch generation in one process."""

    def __init__(self, model: str | None = None, seed: int | None = None, engine_config: EngineConfig | None = None,
                 **engine_args: Any):
        """`engine_args` are `EngineConfig` fields, applied over `engine_config` when both are given (a
        name that is no field raises TypeError). `seed`, as vLLM's: the sampling of requests without
        their own seed (`EngineConfig.seed`) and a preset's random weights; None keeps the config's."""
        if seed is not None:
            engine_args["seed"] = seed
        config = (engine_config or EngineConfig()).replace(**engine_args)
        self._check_offline(config)
        self.engine = LLMEngine.from_config(model, config, seed=config.seed)
        self.tokenizer = self.engine.tokenizer

    @staticmethod
    def _check_offline(config: EngineConfig) -> None:
        """ConfigError, before the model loads, for a setting that would have no effect here, as
        `llmjax generate` refuses its flags: the stream interval (outputs are returned whole) and the
        dynamic policy's `max_delay` (every prompt is queued at once, so a batch never waits for more)."""
        if config.stream_interval != EngineConfig().stream_interval:
            raise ConfigError("stream_interval has no effect on the LLM API: its outputs are not streamed")
        dynamic = EngineConfig(scheduling_policy="dynamic")
        if config.scheduling_policy == dynamic.scheduling_policy and config.max_delay != dynamic.max_delay:
            raise ConfigError("max_delay has no effect on the LLM API: every prompt is queued at once, so a dynamic "
                              "batch never waits for more")

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt given no SamplingParams gets (vLLM's): SamplingParams' defaults, over which
        the model's generation_config.json settings (`LLMEngine.generation_defaults`)."""
        return SamplingParams(**self.engine.generation_defaults)

    def get_tokenizer(self) -> Tokenizer | CharTokenizer:
        """The engine's tokenizer (vLLM's `LLM.get_tokenizer`): `encode`, `decode`, `encode_chat`;
        a model's HF tokenizer is its `hf` (what vLLM's returns: `apply_chat_template`, `eos_token_id`)."""
        return self.engine.tokenizer

    @staticmethod
    def _engine_prompt(prompt: Prompt) -> tuple[str | list[int], str | None]:
        """A vLLM prompt -> the prompt and the namespace `LLMEngine.add_request` takes (the engine checks
        the namespace, a `cache_salt`). Raises TypeError for anything else."""
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt), None  # token ids, as vLLM takes them bare
        if isinstance(prompt, Mapping):
            keys, salt = set(prompt) - {"cache_salt"}, prompt.get("cache_salt")
            if keys == {"prompt"} and isinstance(prompt["prompt"], str):
                return prompt["prompt"], salt
            if keys == {"prompt_token_ids"} and not isinstance(prompt["prompt_token_ids"], str):
                return prompt["prompt_token_ids"], salt  # the engine checks they are integer ids
        raise TypeError('a prompt is a string, a list of token ids, {"prompt": str} or {"prompt_token_ids": '
                        '[int, ...]} (each mapping may add "cache_salt"; chat conversations go through LLM.chat), got '
                        f"{prompt!r:.80}")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; returns one finished `RequestOutput` per prompt, in order.
        A prompt the engine refuses raises (`RequestError`, `SamplingParamsError`) with nothing left queued.
        `use_tqdm`: show a progress bar; a callable (vLLM's) makes the bar, taking tqdm's arguments.
        Interrupted (Ctrl-C, an exception while stepping), it aborts the requests it queued."""
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts
                                                   and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence):
            raise TypeError(f"prompts are a prompt or a list of them, got {prompts!r:.80}")
        return self._run([self._engine_prompt(p) for p in prompts], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (rendered with the chat template).
        A message's `content` is a string or a list of OpenAI text parts (`{"type": "text", "text":
        ...}`, joined by newlines, as in vLLM and the server). A content the server would refuse (an
        image part, a missing text) raises ValueError with the server's message, its place given as
        `messages.I...` (one conversation) or `messages.C.I...`, with nothing queued; so does a
        conversation that is no list of messages (a string, say), or a message without a string role.
        Each output's `prompt` is its rendered conversation, as in vLLM. `add_generation_prompt` and
        `continue_final_message` (the reply goes on with the last message's text; it needs
        `add_generation_prompt=False`, as in vLLM, else ValueError) are True or False (TypeError
        otherwise, as for the server's fields)."""
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} is True or False, got {flag!r:.80}")
        conversations = list(messages)
        single = bool(conversations) and isinstance(conversations[0], Mapping)
        if single:
            conversations = [conversations]
        for c, conversation in enumerate(conversations):
            if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
                raise ValueError(f"messages{'' if single else f'.{c}'}: a conversation is a list of messages "
                                 f"(mappings with 'role' and 'content'), got {conversation!r:.80}")
        messages = [[_template_message(m, ("messages", *(() if single else (c,)), i)) for i, m in enumerate(conv)]
                    for c, conv in enumerate(conversations)]
        rendered = []
        for c, m in enumerate(messages):
            try:
                rendered.append(self.tokenizer.chat_prompt(m, add_generation_prompt, continue_final_message))
            except ValueError as exc:
                raise ValueError(f"messages{'' if single else f'.{c}'}: {exc}") from None
        ids = [self.tokenizer.encode_chat(m, add_generation_prompt, continue_final_message=continue_final_message)
               for m in messages]
        outputs = self._run([(i, None) for i in ids], sampling_params, use_tqdm)
        for output, text in zip(outputs, rendered):
            output.prompt = text
        return outputs

    def _run(self, prompts: list[tuple[str | list[int], str | None]], sampling_params, use_tqdm) -> list[RequestOutput]:
        """Run (prompt, namespace) pairs to completion (see `generate`)."""
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise TypeError(f"use_tqdm is a bool or a callable that makes a tqdm bar, got {use_tqdm!r:.80}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif not (isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes))
                  and all(isinstance(sp, SamplingParams) for sp in sampling_params)):
            raise TypeError("sampling_params is a SamplingParams or a list of them, one per prompt, got "
                            f"{sampling_params!r:.80}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        # one output per request, when it finishes (as vLLM's LLM asks for)
        final = {id(sp): dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                 for sp in {id(sp): sp for sp in sampling_params}.values()}
        sampling_params = [final[id(sp)] for sp in sampling_params]
        engine = self.engine
        ids = engine.add_requests([(prompt, params, None, namespace)
                                   for (prompt, namespace), params in zip(prompts, sampling_params)])
        engine.scheduler.input_closed = True
        results: dict[str, RequestOutput] = {}
        start, generated_before = time.perf_counter(), engine.num_generation_tokens
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        try:
            with make_bar(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        results[output.request_id] = output
                        bar.update(1)
                    generated = engine.num_generation_tokens - generated_before
                    bar.set_postfix(tok_per_s=f"{generated / (time.perf_counter() - start):.1f}", refresh=False)
        except BaseException:  # interrupted: the next call must not run (and pay for) these requests
            for request_id in ids:
                if request_id not in results:
                    engine.abort(request_id)
            raise
        finally:
            engine.scheduler.input_closed = False
        failed = [results[i] for i in ids if results[i].error is not None]
        if failed:  # their outputs end with finish reason "error" and say why in `error`
            log.warning("%d of %d requests failed (their outputs' `error`), the first: %s", len(failed), len(ids),
                        failed[0].error)
        return [results[i] for i in ids]
