"""The OpenAI-compatible HTTP API (FastAPI): `build_app(engine, model_name, api_key, allowed_origins)`.

Endpoints: `/v1/completions`, `/v1/chat/completions` (both with `stream`), `/v1/models`,
`/v1/models/{model}`, `/health`, `/metrics`, `/tokenize`, `/detokenize`, `/debug/kv_invariants`.

- The app's lifespan starts and stops the `AsyncEngine` loop thread; handlers never touch the
  engine directly. Prompts are tokenized (and chat templates rendered), and /detokenize's ids decoded, in worker threads
  (`asyncio.to_thread`), so a long prompt stalls neither the event loop nor the engine's steps; the
  engine gets token ids. The tokenizer is shared read-only with those threads and the loop thread
  (its detokenizers).
- Errors are OpenAI error objects (`llmjax/serve/asgi.py`): 400 for schema errors (unknown
  fields included), malformed JSON, bad sampling values (`SamplingParamsError`) and prompts the
  engine refuses (`RequestError`: empty, too long; a text certainly beyond the context is refused
  before it is tokenized, `Tokenizer.min_num_tokens`); 401 without the API key (when one is set);
  404 for an unknown model or route; 413 for a body over `MAX_REQUEST_BODY_BYTES` (64 MiB); 500
  for an unexpected error; 503 when the engine loop is dead. A refused request leaves nothing
  queued, so it never affects other requests.
- The app refuses to be built (`ConfigError`) when the KV pool cannot hold one `max_model_len`
  request, so `/v1/models` advertises a context length the pool can serve.
- Streaming is server-sent events (`data: {json}\\n\\n`, ending `data: [DONE]\\n\\n`).
- A client that disconnects aborts its requests: streamed responses abort when the response
  ends for any reason; non-streamed handlers race the generation against the disconnect.
- `/health` answers from the loop's heartbeat without waiting for it (`AsyncEngine.health`): 200
  while the loop is alive and no step has run past 600 s, else 503 with the reason.
  `/debug/kv_invariants` scans the KV pool on the loop thread between steps (200, or 503 with the
  violation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import AsyncIterator, Callable

import jax
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from llmjax.attention.cache_dtype import value_dtype
from llmjax.config import ConfigError
from llmjax.engine import LLMEngine, RequestError, check_fits_context, prompt_too_long
from llmjax.outputs import OutputAccumulator, RequestFailedError, RequestOutput
from llmjax.sampling_params import SamplingParams, SamplingParamsError
from llmjax.serve import protocol as p
from llmjax.serve.asgi import (LimitRequestBody, RequireAPIKey, error_response, install_error_handlers,
                               wait_for_disconnect)
from llmjax.serve.async_engine import AsyncEngine, EngineDeadError, OutputStream, ShuttingDownError
from llmjax.serve.metrics import ServerMetrics
from llmjax.tokenizer import TextTooLong

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def check_kv_capacity(engine: LLMEngine) -> None:
    """Raise `ConfigError` when the KV pool cannot hold one request of `max_model_len` tokens."""
    max_len, usable = engine.config.max_model_len, engine.num_blocks - 1
    if engine.kv.num_blocks_for(max_len) > usable:
        raise ConfigError(
            f"max_model_len ({max_len}) is larger than the KV cache can hold ({usable} blocks of "
            f"{engine.config.block_size} tokens = {usable * engine.config.block_size} tokens); raise "
            "--kv-cache-memory or lower --max-model-len")


class _EventStream(StreamingResponse):
    """Server-sent events of `chunks`, ending with `data: [DONE]`. When the response ends for any
    reason (done, client gone, error), the stream's unfinished requests are aborted."""

    def __init__(self, stream: OutputStream, chunks: AsyncIterator[BaseModel]):
        super().__init__(self._events(chunks), media_type="text/event-stream")
        self.stream = stream

    @staticmethod
    async def _events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as exc:  # the engine died mid-stream; OpenAI-style error event
            log.exception("stream failed")
            yield f"data: {json.dumps(p.error_body(str(exc), 'internal_server_error', code=500))}\n\n"
        yield "data: [DONE]\n\n"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()


def _choice_usage(output: RequestOutput, generated: int) -> p.Usage:
    """The usage so far of one choice of `output`'s request: its prompt and the `generated` tokens of
    that choice (vLLM's continuous usage stats)."""
    usage = p.Usage()
    usage.add(len(output.prompt_token_ids), generated, output.num_cached_tokens)
    return usage


def _raise_if_failed(output: RequestOutput) -> None:
    """A request the engine failed becomes a server error (500 JSON, or an SSE error event)."""
    if output.error is not None:
        raise RequestFailedError(output.error)


def _echoed_prompt_logprobs(output: RequestOutput) -> list:
    """A request's prompt logprobs entries for its echoed prompt tokens, one per token: a request
    aborted before its prompt was computed has fewer, and the rest are null."""
    entries = output.prompt_logprobs
    return entries + [None] * (len(output.prompt_token_ids) - len(entries))


class OpenAIServer:
    """Request handling over one `AsyncEngine`; `build_app` routes to its methods."""

    def __init__(self, engine: LLMEngine, model_name: str):
        check_kv_capacity(engine)
        self.async_engine = AsyncEngine(engine)
        # vLLM's label names (`num_gpu_blocks`: the blocks of the device's KV pool, whatever the device)
        cache_config = {"block_size": str(engine.config.block_size), "num_gpu_blocks": str(engine.num_blocks),
                        "cache_dtype": str(value_dtype(jax.tree.leaves(engine.runner.cache)[0].dtype)),
                        "enable_prefix_caching": str(engine.config.enable_prefix_caching)}
        self.metrics = ServerMetrics(lambda: self.async_engine.stats, model_name, engine.config.max_model_len,
                                     cache_config)
        self.async_engine.on_finished = self.metrics.observe_finished
        engine.on_first_token = self.metrics.observe_first_token
        self.tokenizer = engine.tokenizer
        self.generation_defaults = engine.generation_defaults
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.config.max_model_len
        self.model_name = model_name

    # --- helpers ------------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:  # none or "": the served model, as in vLLM
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def _chat_ids(self, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                  add_special_tokens: bool = False, generation: bool = True,
                  continue_final_message: bool = False) -> list[int]:
        """The rendered conversation's token ids (blocking: call it in a worker thread). For a
        `generation`, a conversation certainly beyond the context is refused before it is encoded
        (`/tokenize` encodes any, as vLLM's does)."""
        try:
            return self.tokenizer.encode_chat([m.as_dict() for m in messages], add_generation_prompt,
                                              add_special_tokens, self.max_model_len if generation else None,
                                              continue_final_message=continue_final_message)
        except TextTooLong as exc:
            raise prompt_too_long(exc, self.max_model_len, "messages") from None
        except (ValueError, TemplateError) as exc:
            raise RequestError(str(exc), "continue_final_message" if "continue_final_message" in str(exc)
                               else "messages") from exc

    def _token_ids(self, prompts: list[p.Prompt]) -> list[list[int]]:
        """Each prompt's token ids, as the engine would encode it (blocking: call it in a worker thread).
        A text certainly beyond the context is refused before it is encoded."""
        try:
            return [self.tokenizer.encode(q, at_most=self.max_model_len) if isinstance(q, str) else q
                    for q in prompts]
        except TextTooLong as exc:
            raise prompt_too_long(exc, self.max_model_len) from None

    def _prompt_text(self, prompt: p.Prompt) -> str:
        """The echoed prompt: a string as sent; token ids decoded with their special tokens, as vLLM
        echoes them (so the text matches the echoed logprob tokens and their offsets)."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    async def _open(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                    cache_salt: str | None, arrival: float,
                    max_tokens_field: str = "max_tokens",
                    prompt_field: str = "prompt") -> tuple[OutputStream, dict[str, int]]:
        """Queue one engine request per prompt (token ids), all in one engine command; returns the
        stream and request id -> choice index. `arrival`: when the handler started (the request's
        latencies count its tokenizing). If any prompt is refused, none stays queued; if the handler
        is cancelled meanwhile (the client left), they are aborted. A prompt plus `max_tokens` beyond
        `max_model_len` is refused here, as vLLM's OpenAI server does (the engine would cap it); the
        refusal names `max_tokens_field` or `prompt_field`, the fields the client sent."""
        for ids in prompts:
            check_fits_context(len(ids), params.max_tokens, self.max_model_len, max_tokens_field, prompt_field)
        stream = self.async_engine.open_stream()
        index = {f"{request_id}-{i}": i for i in range(len(prompts))}
        try:
            await stream.add(dict(zip(index, prompts)), params, cache_salt, arrival)
        except BaseException:
            stream.abort()
            raise
        return stream, index

    async def _final_outputs(self, raw: Request, stream: OutputStream) -> dict[str, RequestOutput] | None:
        """Each request's whole output (accumulated from the engine's deltas), or None when the client
        disconnected first (then aborted). Raises `RequestFailedError` when the engine failed one, and
        `ShuttingDownError` (503) when a shutting-down server aborted one (a partial answer is no answer)."""

        async def collect() -> dict[str, RequestOutput]:
            whole = OutputAccumulator()
            async for out in stream:
                _raise_if_failed(out)
                if self.async_engine.stopping and any(c.finish_reason == "abort" for c in out.outputs):
                    raise ShuttingDownError("the server shut down before the request finished")
                whole.add(out)
            return whole.outputs

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(wait_for_disconnect(raw))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                task.cancel()  # no-op for a finished task
            stream.abort()
        return work.result() if work in done else None

    @staticmethod
    def _usage(outputs: list[RequestOutput]) -> p.Usage:
        """Usage of finished outputs (their `metrics` count every sample's tokens)."""
        usage = p.Usage()
        for out in outputs:
            usage.add(len(out.prompt_token_ids), out.metrics.num_generation_tokens, out.num_cached_tokens)
        return usage

    def _completion_logprobs(self, token_ids: list[int], entries, text_offset: int) -> tuple[p.CompletionLogprobs, int]:
        """Logprobs of `token_ids`, the last tokens of the output whose entries are `entries`, and the
        text offset after them."""
        return p.completion_logprobs(self.tokenizer.token_to_text, token_ids, entries[len(entries) - len(token_ids):],
                                     text_offset)

    # --- /v1/completions ------------------------------------------------------------------------------
    async def completions(self, body: p.CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        params, prompts = body.sampling_params(self.generation_defaults), body.prompts()
        request_id, created = p.random_id("cmpl"), p.now_s()
        prompt_ids = await asyncio.to_thread(self._token_ids, prompts) if any(isinstance(q, str) for q in prompts) \
            else prompts
        stream, index = await self._open(prompt_ids, params, request_id, body.cache_salt, arrival)
        if body.stream:
            return _EventStream(stream, self._completion_chunks(stream, index, prompts, params, body, request_id,
                                                                created))
        outputs = await self._final_outputs(raw, stream)
        if outputs is None:
            return Response(status_code=499)
        choices = []
        for rid, out in outputs.items():
            i = index[rid]
            prefix = self._prompt_text(prompts[i]) if body.echo else ""
            for c in out.outputs:
                text, token_ids, entries, finish_reason, stop_reason = \
                    ("", [], [], "length", None) if body.echo_only else \
                    (c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
                logprobs = None
                if params.logprobs is not None:
                    if body.echo:
                        token_ids, entries = out.prompt_token_ids + token_ids, _echoed_prompt_logprobs(out) + entries
                    logprobs = self._completion_logprobs(token_ids, entries, 0)[0]
                choices.append(p.CompletionChoice(index=i * params.n + c.index, text=prefix + text,
                                                  logprobs=logprobs, finish_reason=finish_reason,
                                                  stop_reason=stop_reason))
        choices.sort(key=lambda c: c.index)
        return JSONResponse(p.CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                                 usage=self._usage(list(outputs.values()))).model_dump())

    async def _completion_chunks(self, stream: OutputStream, index: dict[str, int], prompts: list[p.Prompt],
                                 params: SamplingParams, body: p.CompletionRequest, request_id: str, created: int):
        echoed: set[int] = set()  # choices whose prompt was sent
        offsets: dict[int, int] = {}  # per choice: the text offset after its tokens so far (logprobs)
        generated: dict[int, int] = {}  # per choice: its tokens so far (continuous usage)
        prompt_logprobs: dict[str, list] = {}  # per request: its prompt's logprobs (in its first output)
        finished = []
        async for out in stream:
            _raise_if_failed(out)
            if out.prompt_logprobs is not None:
                prompt_logprobs[out.request_id] = _echoed_prompt_logprobs(out)
            for c in out.outputs:
                i = index[out.request_id] * params.n + c.index
                text, token_ids, entries, finish_reason, stop_reason = \
                    ("", [], [], c.finish_reason and "length", None) if body.echo_only else \
                    (c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
                if body.echo and i not in echoed:
                    echoed.add(i)
                    text = self._prompt_text(prompts[index[out.request_id]]) + text
                    if params.logprobs is not None:
                        token_ids = out.prompt_token_ids + token_ids
                        entries = prompt_logprobs[out.request_id] + (entries or [])
                # a delta of tokens without text (special tokens, a character still incomplete, text held
                # back for stop strings) is a chunk too, as in vLLM: its TTFT and ITL time tokens
                if not (text or finish_reason or token_ids):
                    continue
                logprobs = None
                if params.logprobs is not None:  # offsets follow the tokens, not text held back for stop strings
                    logprobs, offsets[i] = self._completion_logprobs(token_ids, entries, offsets.get(i, 0))
                choice = p.CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                            stop_reason=stop_reason)
                usage = None
                if body.continuous_usage:
                    generated[i] = generated.get(i, 0) + len(c.token_ids)
                    usage = _choice_usage(out, generated[i])
                yield p.CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[choice],
                                           usage=usage)
            if out.finished:
                finished.append(out)
        if body.include_usage:
            yield p.CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                       usage=self._usage(finished))

    # --- /v1/chat/completions -------------------------------------------------------------------------
    async def chat_completions(self, body: p.ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        params, request_id, created = body.sampling_params(self.generation_defaults), p.random_id("chatcmpl"), p.now_s()
        prompt_ids = await asyncio.to_thread(self._chat_ids, body.messages, body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message)
        sent = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        stream, index = await self._open([prompt_ids], params, request_id, body.cache_salt, arrival, sent, "messages")
        if body.stream:
            return _EventStream(stream, self._chat_chunks(stream, params, body, request_id, created))
        outputs = await self._final_outputs(raw, stream)
        if outputs is None:
            return Response(status_code=499)
        [out] = outputs.values()
        choices = [p.ChatChoice(index=c.index, message=p.AssistantMessage(content=c.text),
                                logprobs=self._chat_logprobs(params, c.token_ids, c.logprobs),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in out.outputs]
        return JSONResponse(p.ChatCompletionResponse(id=request_id, created=created, model=self.model_name,
                                                     choices=choices, usage=self._usage([out])).model_dump())

    def _chat_logprobs(self, params: SamplingParams, token_ids: list[int], entries) -> p.ChatLogprobs | None:
        """Logprobs of `token_ids`, the last tokens of the output whose entries are `entries`."""
        if params.logprobs is None:
            return None
        return p.chat_logprobs(self.tokenizer.token_to_text, self.tokenizer.token_bytes, token_ids,
                               entries[len(entries) - len(token_ids):], params.logprobs)

    async def _chat_chunks(self, stream: OutputStream, params: SamplingParams, body: p.ChatCompletionRequest,
                           request_id: str, created: int):
        generated = [0] * params.n  # per choice: its tokens so far (continuous usage)

        def chunk(index: int, delta: p.DeltaMessage, usage: p.Usage | None = None, **fields) -> p.ChatCompletionChunk:
            return p.ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                         choices=[p.ChatStreamChoice(index=index, delta=delta, **fields)], usage=usage)

        roles_sent = False
        async for out in stream:
            _raise_if_failed(out)
            if not roles_sent:  # with the first output, as vLLM: a router retries a request of which no byte came
                roles_sent = True
                for i in range(params.n):
                    yield chunk(i, p.DeltaMessage(role="assistant", content=""))
            for c in out.outputs:
                if not (c.text or c.finished or c.token_ids):  # see `_completion_chunks`
                    continue
                usage = None
                if body.continuous_usage:
                    generated[c.index] += len(c.token_ids)
                    usage = _choice_usage(out, generated[c.index])
                # tokens without text yet: "content": "" (as vLLM), so a client reading the content gets a
                # string; a last chunk with no text carries only its finish reason (as OpenAI)
                content = c.text or (None if c.finish_reason else "")
                yield chunk(c.index, p.DeltaMessage(content=content), usage,
                            logprobs=self._chat_logprobs(params, c.token_ids, c.logprobs or []),
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if out.finished and body.include_usage:
                yield p.ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                            usage=self._usage([out]))

    # --- the rest ---------------------------------------------------------------------------------------
    async def models(self) -> p.ModelList:
        return p.ModelList(data=[self._model_card()])

    async def model(self, model: str) -> p.ModelCard:
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> p.ModelCard:
        return p.ModelCard(id=self.model_name, root=self.model_name, max_model_len=self.max_model_len)

    async def health(self) -> Response:
        problem = self.async_engine.health()
        if problem:
            return error_response(503, problem)
        return Response(status_code=200)

    async def kv_invariants(self) -> Response:
        problem = self.async_engine.health() or await self.async_engine.check_kv_invariants()
        if problem:
            return error_response(503, problem)
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, body: p.TokenizeRequest) -> p.TokenizeResponse:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of `prompt` and `messages`", "prompt")
        special = body.add_special_tokens
        if body.messages is not None:
            generation_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
            tokens = await asyncio.to_thread(self._chat_ids, body.messages, generation_prompt, bool(special), False,
                                             bool(body.continue_final_message))
        elif body.add_generation_prompt is not None or body.continue_final_message is not None:
            name = "add_generation_prompt" if body.add_generation_prompt is not None else "continue_final_message"
            raise RequestError(f"{name} applies to `messages` only", name)
        else:
            tokens = await asyncio.to_thread(self.tokenizer.encode, body.prompt, special is not False)
        return p.TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    async def detokenize(self, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self._check_model(body.model)
        return p.DetokenizeResponse(prompt=await asyncio.to_thread(self._decode, body.tokens))

    def _decode(self, tokens: list[int]) -> str:
        """/detokenize's text (blocking: a worker thread's, as tokenizing is). Special tokens kept, as
        vLLM's: the inverse of /tokenize, chat template markers included."""
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise RequestError(f"token ids must be in [0, {self.vocab_size})", "tokens")
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


def build_app(engine: LLMEngine, model_name: str, api_key: str | None = None,
              allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The app; its lifespan runs the engine loop thread. `app.state.server` is the `OpenAIServer`.
    `api_key`: required on `/v1/*` and `/debug/*` when set. `allowed_origins`: CORS origins (none by default)."""
    server = OpenAIServer(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        server.async_engine.start()
        yield
        server.async_engine.shutdown()

    app = FastAPI(title="llmjax", lifespan=lifespan)
    app.state.server = server
    routes: list[tuple[str, str, Callable]] = [
        ("POST", "/v1/completions", server.completions),
        ("POST", "/v1/chat/completions", server.chat_completions),
        ("GET", "/v1/models", server.models),
        ("GET", "/v1/models/{model:path}", server.model),
        ("GET", "/health", server.health),
        ("GET", "/debug/kv_invariants", server.kv_invariants),
        ("GET", "/metrics", server.metrics_text),
        ("POST", "/tokenize", server.tokenize),
        ("POST", "/detokenize", server.detokenize),
    ]
    for method, path, handler in routes:
        app.add_api_route(path, handler, methods=[method])

    install_error_handlers(app)
    for bad_request in (RequestError, SamplingParamsError):
        app.add_exception_handler(bad_request, lambda _, exc: error_response(400, str(exc), exc.param))
    app.add_exception_handler(APIError, lambda _, exc: error_response(exc.status, str(exc), exc.param))
    app.add_exception_handler(EngineDeadError, lambda _, exc: error_response(503, str(exc)))
    app.add_middleware(LimitRequestBody)  # inside the key check: a request without the key is never read
    if api_key:
        app.add_middleware(RequireAPIKey, api_key=api_key)
    if allowed_origins:  # outermost, so preflight requests never need the key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app
