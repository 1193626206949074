"""The HTTP server end to end: a real uvicorn server on 127.0.0.1 over a tiny random model.

One server for the module (a few tests build their own app: API key, a dead engine loop). KV
health is checked through `/debug/kv_invariants`, which runs the engine's `check_kv_invariants` on
the loop thread (503 if they fail); "no block in use" through `/metrics`. Every error case is
followed by a good request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmjax.config import ConfigError
from llmjax.request import MAX_NAMESPACE_CHARS
from llmjax.serve.api import build_app
from llmjax.serve.metrics import parse_metrics
from llmjax.serve import asgi
from llmjax.serve.server import bind_socket, http_url, is_loopback, resolve_api_key, serve_app, start_listening
from tests.engine_helpers import dense_logits, tiny_engine
from tests.server_helpers import assert_no_leak, metrics, running_server, sse_events, wait_idle

MODEL = "tiny"
MAX_MODEL_LEN = 128
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def app():
    engine = tiny_engine(max_num_seqs=32, kv_cache_memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN)
    return build_app(engine, MODEL)


@pytest.fixture(scope="module")
def base_url(app):
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def complete(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client: httpx.Client, path: str, **body) -> list[dict]:
    r = client.post(path, json={"model": MODEL, "stream": True, **body})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return sse_events(r.text)


# --- basics ----------------------------------------------------------------------------------------------
def test_models_health_tokenize(client):
    [card] = client.get("/v1/models").json()["data"]
    assert (card["id"], card["root"], card["parent"], card["object"]) == (MODEL, MODEL, None, "model")
    assert client.get(f"/v1/models/{MODEL}").json() == card
    _assert_error(client.get("/v1/models/other"), 404, "model")
    assert client.get("/health").status_code == 200
    tokens = client.post("/tokenize", json={"prompt": "hello"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 6 and tokens["max_model_len"] == MAX_MODEL_LEN
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "hello"
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


def test_completion_stream_matches_non_stream(client):
    full = complete(client, prompt="The quick brown fox", **GREEDY)
    [choice] = full["choices"]
    assert choice["finish_reason"] == "length" and len(choice["text"]) == 8
    assert full["usage"]["completion_tokens"] == 8 and full["usage"]["prompt_tokens"] == 20
    events = stream(client, "/v1/completions", prompt="The quick brown fox", stream_options={"include_usage": True},
                    **GREEDY)
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert all(e["usage"] is None for e in events[:-1])


def test_a_chat_stream_sends_no_byte_before_the_engines_first_output(app):
    """The role chunks come with the first output, as vLLM sends them: a router retries a request of
    which no byte came on another worker, so one still queued on a worker that dies is not lost."""
    from llmjax.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from llmjax.sampling_params import SamplingParams
    from llmjax.serve import protocol

    body = protocol.ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, n=2)
    first = [RequestOutput("r-0", None, [1], [CompletionOutput(i, "hi", [5], finish_reason="length")], i == 1,
                           RequestMetrics(0.0)) for i in range(2)]

    async def run():
        ready = asyncio.Event()

        async def outputs():
            await ready.wait()
            for out in first:
                yield out

        chunks = app.state.server._chat_chunks(outputs(), SamplingParams(n=2, max_tokens=1), body, "chatcmpl-x", 0)
        pending = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0.1)
        early = pending.done()
        ready.set()
        return early, [await pending] + [c async for c in chunks]

    early, chunks = asyncio.run(run())
    assert not early
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks] == [
        (0, "assistant"), (1, "assistant"), (0, None), (1, None)]


def test_chat_stream_matches_non_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **GREEDY}).json()
    [choice] = full["choices"]
    assert full["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    events = stream(client, "/v1/chat/completions", messages=messages, stream_options={"include_usage": True},
                    **GREEDY)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == choice["message"]["content"]
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (full["usage"]["prompt_tokens"], 8)
    plain = stream(client, "/v1/chat/completions", messages=messages, **GREEDY)
    assert all("usage" not in e or e["usage"] is None for e in plain)


def test_openai_client(base_url):
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0)
    text = oai.completions.create(prompt="Once upon", **kwargs).choices[0].text
    chunks = list(oai.completions.create(prompt="Once upon", stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == text
    messages = [{"role": "user", "content": "Say something"}]
    reply = oai.chat.completions.create(messages=messages, **kwargs)
    chunks = list(oai.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True},
                                              **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(prompt="x", model="no-such-model", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.completions.create(prompt="x" * 200, **kwargs)


def test_prompt_forms_and_echo(client):
    single = {p: complete(client, prompt=p, **GREEDY)["choices"][0]["text"] for p in ("abc", "hello")}
    batch = complete(client, prompt=["abc", "hello"], **GREEDY)
    assert [(c["index"], c["text"]) for c in batch["choices"]] == [(0, single["abc"]), (1, single["hello"])]
    assert batch["usage"]["completion_tokens"] == 16
    ids = client.post("/tokenize", json={"prompt": "abc"}).json()["tokens"]
    assert complete(client, prompt=ids, **GREEDY)["choices"][0]["text"] == single["abc"]
    both = complete(client, prompt=[ids, ids], **GREEDY)["choices"]
    assert [c["text"] for c in both] == [single["abc"]] * 2
    assert complete(client, prompt="abc", echo=True, **GREEDY)["choices"][0]["text"] == "abc" + single["abc"]
    events = stream(client, "/v1/completions", prompt=["abc", "hello"], echo=True, **GREEDY)
    texts = {0: "", 1: ""}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: "abc" + single["abc"], 1: "hello" + single["hello"]}


def test_logprobs(client):
    lp = complete(client, prompt="abc", logprobs=2, **GREEDY)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 2 and logprob <= 0 and top[token] == pytest.approx(max(top.values()))
    assert lp["text_offset"] == list(range(8))
    events = stream(client, "/v1/completions", prompt="abc", logprobs=2, **GREEDY)
    assert [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
    chat = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3, **GREEDY,
    }).json()["choices"][0]["logprobs"]["content"]
    assert len(chat) == 8 and all(len(t["top_logprobs"]) == 3 and t["top_logprobs"][0]["token"] == t["token"]
                                  for t in chat)



def assert_same_logprobs(token_logprobs: list, top_logprobs: list, expected: dict) -> None:
    """Completion logprobs equal to `expected`'s up to float rounding (same top tokens)."""
    np.testing.assert_allclose(token_logprobs, expected["token_logprobs"], atol=1e-5)
    assert [list(t) for t in top_logprobs] == [list(t) for t in expected["top_logprobs"]]
    np.testing.assert_allclose([v for t in top_logprobs for v in t.values()],
                               [v for t in expected["top_logprobs"] for v in t.values()], atol=1e-5)


def test_echo_with_logprobs_scores_the_prompt(client, app):
    """`echo` with `logprobs` (lm-evaluation-harness's loglikelihood request): the prompt's tokens come
    first with their logprobs (null for the first), the dense model's; then the completion's, as
    without echo; offsets run over the prompt's text and on. `max_tokens` 0 echoes the prompt alone.
    Streamed, the same."""
    engine = app.state.server.async_engine.engine
    prompt = "the cat sat on"
    ids = client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    lp = complete(client, prompt=prompt, echo=True, logprobs=2, **GREEDY)["choices"][0]["logprobs"]
    plain = complete(client, prompt=prompt, logprobs=2, **GREEDY)["choices"][0]["logprobs"]
    p = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = np.asarray(jax.nn.log_softmax(dense_logits(engine, ids), axis=-1))
    np.testing.assert_allclose(lp["token_logprobs"][1:p], [ref[t - 1, ids[t]] for t in range(1, p)], atol=2e-5)
    for t in range(1, p):
        top = lp["top_logprobs"][t]
        assert len(top) in (2, 3) and top[lp["tokens"][t]] == lp["token_logprobs"][t]
        np.testing.assert_allclose(sorted(top.values(), reverse=True)[:2], np.sort(ref[t - 1])[::-1][:2], atol=2e-5)
    assert "".join(lp["tokens"][:p]) == prompt and lp["tokens"][p:] == plain["tokens"]
    assert_same_logprobs(lp["token_logprobs"][p:], lp["top_logprobs"][p:], plain)  # batch shapes round apart
    tokens = lp["tokens"]  # the tokenizer's BOS renders as ""
    assert lp["text_offset"] == [len("".join(tokens[:i])) for i in range(p + GREEDY["max_tokens"])]
    events = stream(client, "/v1/completions", prompt=prompt, echo=True, logprobs=2, **GREEDY)
    streamed = {key: [x for e in events if e["choices"] for x in e["choices"][0]["logprobs"][key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert_same_logprobs(streamed["token_logprobs"][1:], streamed["top_logprobs"][1:],
                         {k: lp[k][1:] for k in ("token_logprobs", "top_logprobs")})

    only = complete(client, prompt=prompt, echo=True, logprobs=1, max_tokens=0)["choices"][0]
    assert only["text"] == prompt and only["finish_reason"] == "length"
    assert only["logprobs"]["tokens"] == lp["tokens"][:p]
    np.testing.assert_allclose(only["logprobs"]["token_logprobs"][1:], lp["token_logprobs"][1:p], atol=1e-5)
    events = stream(client, "/v1/completions", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    chunks = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == prompt and chunks[-1]["finish_reason"] == "length"
    streamed_only = [x for c in chunks for x in c["logprobs"]["token_logprobs"]]
    assert streamed_only[0] is None and len(streamed_only) == p
    np.testing.assert_allclose(streamed_only[1:], only["logprobs"]["token_logprobs"][1:], atol=1e-5)
    assert complete(client, prompt=prompt, echo=True, max_tokens=0)["choices"][0]["text"] == prompt
    assert_no_leak(client)

# --- errors --------------------------------------------------------------------------------------------------
COMPLETION_ERRORS = [
    # (request body or raw bytes, status, param, message start)
    ({"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs must be"),
    ({"prompt": "x", "n": 0}, 400, "n", "n must be"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of", "only best_of=1"),
    ({"prompt": ""}, 400, "prompt", "prompt"),
    ({"prompt": []}, 400, "prompt", "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt", "prompt"),
    ({"prompt": [5, 100000]}, 400, "prompt", "prompt token ids"),
    (b'{"prompt": "x", ', 400, None, "malformed JSON"),
    (b'not json', 400, None, "malformed JSON"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ({"max_tokens": 3}, 400, "prompt", "prompt"),
    ({"prompt": "x" * 200}, 400, "prompt", f"This model's maximum context length is {MAX_MODEL_LEN} tokens."),
    ({"prompt": [5] * MAX_MODEL_LEN}, 400, "prompt", f"This model's maximum context length is {MAX_MODEL_LEN} "
     f"tokens. However, your request has {MAX_MODEL_LEN} input tokens. Please reduce the length of the input prompt."),
    ({"prompt": "x", "max_tokens": 500}, 400, "max_tokens",
     f"This model's maximum context length is {MAX_MODEL_LEN} tokens."),
    ({"prompt": "x", "model": "gpt-5"}, 404, "model", "The model `gpt-5` does not exist."),
]


@pytest.mark.parametrize("body,status,param,message", COMPLETION_ERRORS)
def test_completion_errors(client, body, status, param, message):
    if isinstance(body, bytes):
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/completions", json=body if "model" in body else {"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error
    assert error["type"] and error["code"] == status  # the HTTP status, as vLLM sends it
    assert complete(client, prompt="still fine", max_tokens=2)["choices"][0]["finish_reason"]


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "x"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_an_empty_or_missing_model_name_is_the_served_model(client, route, body):
    """As in vLLM: a request without a model name, or with an empty one, is served by the model."""
    for named in ({}, {"model": ""}, {"model": None}):
        r = client.post(route, json={**body, **named, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == MODEL, (named, r.text)


class EchoBody(pydantic.BaseModel):
    text: str


def test_a_body_over_the_limit_is_refused_declared_or_chunked():
    """`LimitRequestBody` (64 MiB on the server; 100 bytes here) refuses a declared Content-Length
    over it before the body is read, and a chunked body once its bytes pass it; a body within it
    reaches the route."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()

    async def echo(body: EchoBody) -> dict:
        return {"n": len(body.text)}

    app.add_api_route("/echo", echo, methods=["POST"])
    asgi.install_error_handlers(app)
    app.add_middleware(asgi.LimitRequestBody, limit=100)
    client = TestClient(app)
    assert client.post("/echo", json={"text": "x" * 50}).json() == {"n": 50}
    r = client.post("/echo", json={"text": "x" * 200})
    assert r.status_code == 413 and r.json()["error"]["message"] == "the request body is larger than 100 bytes"

    def chunks():
        yield b'{"text": "'
        for _ in range(20):
            yield b"x" * 10
        yield b'"}'

    r = client.post("/echo", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text


def test_the_server_refuses_a_declared_body_over_its_limit_unread(base_url):
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {asgi.MAX_REQUEST_BODY_BYTES + 1}\r\n\r\n".encode())  # and no body
        assert conn.recv(4096).startswith(b"HTTP/1.1 413 ")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_told_so(client, content_type):
    """`curl -d` sends a form's Content-Type: the error says what the server needs, not that the
    body is of the wrong type. A JSON media type with parameters is JSON all the same."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    r = client.post("/v1/completions", content=body, headers={"content-type": content_type})
    assert r.status_code == 400 and "must be JSON, sent with `Content-Type: application/json`" in \
        r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,status,param", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -2}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500}, 400, "max_completion_tokens"),
])
def test_chat_errors(client, body, status, param):
    r = client.post("/v1/chat/completions", json={"model": MODEL, **body} if "model" not in body else body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    if param.startswith("max_"):  # the context-length refusal names the field the client sent
        assert r.json()["error"]["message"].endswith(f"reduce the length of the messages or {param}."), r.text
    ok = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 2})
    assert ok.status_code == 200


# --- concurrency, disconnects, leaks -----------------------------------------------------------------------------
async def _stream_text(client: httpx.AsyncClient, prompt: str, disconnect_after: int | None) -> str | None:
    body = {"model": MODEL, "prompt": prompt, "stream": True, **GREEDY}
    if disconnect_after is not None:
        body["max_tokens"] = 80  # long enough that only an abort ends it early
    text, events = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text
            events += 1
            text += json.loads(line[6:])["choices"][0]["text"]
            if events == disconnect_after:
                return None  # leaving the block closes the connection mid-stream


def test_concurrent_streams_with_disconnects(client, base_url):
    prompts = [f"prompt number {i}: " + "ab" * i for i in range(8)]
    reference = {p: complete(client, prompt=p, **GREEDY)["choices"][0]["text"] for p in prompts}
    generated_before = metrics(client)["llmjax:generation_tokens_total"]

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as ac:
            jobs = [_stream_text(ac, prompts[i % 8], 2 if i % 4 == 3 else None) for i in range(32)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i, text in enumerate(results):
        if i % 4 == 3:
            assert text is None
        else:
            assert text == reference[prompts[i % 8]], f"client {i}"
    m = wait_idle(client)
    assert m["llmjax:generation_tokens_total"] - generated_before < 24 * 8 + 8 * 80  # the 8 were cut short
    assert_no_leak(client)


def test_disconnect_frees_blocks_at_once(client, base_url):
    before = metrics(client)["llmjax:generation_tokens_total"]

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as ac:
            return await _stream_text(ac, "a long story: ", disconnect_after=2)

    assert asyncio.run(run()) is None
    m = wait_idle(client, timeout=5)
    assert m["llmjax:generation_tokens_total"] - before < 80
    assert_no_leak(client)
    # a non-streamed request whose client gives up is aborted too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/v1/completions", json={"prompt": "b", "max_tokens": 120, "ignore_eos": True},
                   timeout=0.1)
    m = wait_idle(client, timeout=5)
    assert m["llmjax:generation_tokens_total"] - before < 80 + 120
    assert_no_leak(client)


def test_tenant_isolation(client):
    prompt = "tenant isolation needs a prompt of several full blocks ..."
    body = {"prompt": prompt, "max_tokens": 2}

    def cached(**extra) -> int:
        return complete(client, **body, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"]

    hits_before = metrics(client)["llmjax:prefix_cache_hits_total"]
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0  # same prompt, other tenant: no cross-tenant hit
    assert cached() == 0  # nor for the shared default namespace
    hit = cached(cache_salt="tenant-a")
    assert hit >= 48  # the same tenant reuses its full pages
    assert metrics(client)["llmjax:prefix_cache_hits_total"] - hits_before == hit


def _samples(client: httpx.Client, name: str) -> dict[tuple, float]:
    """Label values (sorted by label name) -> value of one metric's samples."""
    text = client.get("/metrics").text
    return {tuple(v for _, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


def test_metrics_names(client):
    _good_request(client)
    m = metrics(client)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_success_total", "request_queue_time_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
                 "request_prompt_tokens_count", "request_generation_tokens_count", "engine_errors_total",
                 "step_compilations_total", "step_compile_seconds_total", "cache_config_info"):
        assert f"llmjax:{name}" in m, name
    assert m["llmjax:e2e_request_latency_seconds_count"] > 0 and m["llmjax:prompt_tokens_total"] > 0
    [(labels, value)] = _samples(client, "llmjax:cache_config_info").items()
    assert value == 1 and labels[:2] == ("8", "float32")  # block_size (tiny_engine's), cache_dtype: first by name


def test_cache_config_names_the_cache_values_dtype_not_its_storage():
    """A bfloat16 cache on CPU is stored as uint16 bits; the metric names the values' dtype, as vLLM's does."""
    from llmjax.serve.api import OpenAIServer

    server = OpenAIServer(tiny_engine(dtype="bfloat16"), MODEL)
    samples = {s.labels["cache_dtype"] for family in text_string_to_metric_families(server.metrics.render().decode())
               for s in family.samples if s.name == "llmjax:cache_config_info"}
    assert samples == {"bfloat16"}


def test_engine_gauges_and_counters_come_from_the_latest_stats_snapshot():
    from llmjax.serve.async_engine import EngineStats
    from llmjax.serve.metrics import ServerMetrics

    snapshot = [EngineStats()]
    server_metrics = ServerMetrics(lambda: snapshot[0], "m", 64, {"block_size": "8"})
    snapshot[0] = EngineStats(num_running=3, num_waiting=2, kv_usage=0.25, prefix_queried_tokens=40,
                              prefix_hit_tokens=16, num_preemptions=1, prompt_tokens=50, generation_tokens=7,
                              num_engine_errors=4, num_serving_compiles=2, serving_compile_seconds=1.5)
    m = parse_metrics(server_metrics.render().decode())
    expected = {"num_requests_running": 3, "num_requests_waiting": 2, "kv_cache_usage_perc": 0.25,
                "prefix_cache_queries_total": 40, "prefix_cache_hits_total": 16, "num_preemptions_total": 1,
                "prompt_tokens_total": 50, "generation_tokens_total": 7, "engine_errors_total": 4,
                "step_compilations_total": 2, "step_compile_seconds_total": 1.5}
    assert {name: m[f"llmjax:{name}"] for name in expected} == expected


def test_request_metrics_count_each_finished_request(client):
    def snapshot():
        success = _samples(client, "llmjax:request_success_total")
        return ({labels[0]: v for labels, v in success.items()}, metrics(client))

    success_before, before = snapshot()
    complete(client, prompt="abcd", max_tokens=5, ignore_eos=True)  # 5 prompt tokens (BOS + 4), 5 generated
    complete(client, prompt="abcd", max_tokens=3, stop_token_ids=[_token(client, c) for c in LETTERS])
    success, after = snapshot()

    def delta(name: str) -> float:
        return after[f"llmjax:{name}"] - before[f"llmjax:{name}"]

    assert success["length"] - success_before.get("length", 0) >= 1
    assert sum(success.values()) - sum(success_before.values()) == 2
    assert delta("request_prompt_tokens_count") == 2 and delta("request_prompt_tokens_sum") == 10
    assert delta("request_generation_tokens_count") == 2 and 6 <= delta("request_generation_tokens_sum") <= 8
    for name in ("queue", "prefill", "decode"):
        assert delta(f"request_{name}_time_seconds_count") == 2
    # each sample counts its finish reason, as vLLM counts the child requests of n samples
    answer = complete(client, prompt="abcd", max_tokens=2, ignore_eos=True, n=3, temperature=1.0, seed=1)
    assert [c["finish_reason"] for c in answer["choices"]] == ["length"] * 3
    assert snapshot()[0]["length"] - success["length"] == 3


def test_latency_metrics_are_the_requests_own_timings(client, app, monkeypatch):
    """Each latency histogram's sum grows by what the engine's timestamps of the request give; the
    queue time is the engine's queue alone (vLLM's), not the tokenizing before it (here 0.3 s)."""
    engine_loop, tokenizer = app.state.server.async_engine, app.state.server.tokenizer
    observe, finished, encode = engine_loop.on_finished, [], tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: (time.sleep(0.3), encode(*a, **k))[1])
    engine_loop.on_finished = lambda out: (finished.append(out), observe(out))
    try:
        wait_idle(client)
        before = metrics(client)
        complete(client, prompt="abcd", max_tokens=6, ignore_eos=True)
        after = wait_idle(client)
    finally:
        engine_loop.on_finished = observe
    [out] = finished
    m = out.metrics
    assert m.queued_time - m.arrival_time >= 0.3 and m.arrival_time <= m.queued_time <= m.first_scheduled_time
    expected = {
        "time_to_first_token_seconds": [m.first_token_time - m.arrival_time],
        "request_queue_time_seconds": [m.first_scheduled_time - m.queued_time],
        "request_prefill_time_seconds": [m.first_token_time - m.first_scheduled_time],
        "request_decode_time_seconds": [m.finish_time - m.first_token_time],
        "e2e_request_latency_seconds": [m.finish_time - m.arrival_time],
        "inter_token_latency_seconds": [b - a for a, b in zip(m.token_times, m.token_times[1:])],
    }
    assert len(expected["inter_token_latency_seconds"]) == 5  # one gap between each two of the 6 tokens' steps
    assert m.first_token_time <= m.token_times[-1] <= m.finish_time  # the last token came before the finish
    for name, values in expected.items():
        count = after[f"llmjax:{name}_count"] - before[f"llmjax:{name}_count"]
        total = after[f"llmjax:{name}_sum"] - before[f"llmjax:{name}_sum"]
        assert count == len(values) and total == pytest.approx(sum(values), abs=1e-9), name


def test_time_to_first_token_is_observed_when_the_first_token_comes(client, app, monkeypatch):
    """As vLLM's: a long generation's time to first token shows while it is still running (its other
    histograms, e2e latency among them, when it finishes)."""
    engine = app.state.server.async_engine.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.05), step())[1])  # 60 tokens: 3 s at least
    wait_idle(client)
    before = metrics(client)
    body = {"model": MODEL, "prompt": "abcd", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the first token's event
        during = metrics(client)
        list(lines)
    after = wait_idle(client)
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
        name = "llmjax:" + name
        assert (during[name] - before[name], after[name] - before[name]) == (
            (1, 1) if "first_token" in name else (0, 1)), name


# --- what the schemas refuse ---------------------------------------------------------------------------------
def _assert_error(r: httpx.Response, status: int, param: str | None, contains: str = "") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and contains in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def _good_request(client: httpx.Client) -> None:
    assert complete(client, prompt="still fine", max_tokens=2)["choices"][0]["finish_reason"]


UNSUPPORTED = ["response_format", "tools", "tool_choice", "parallel_tool_calls", "functions", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "suffix", "prompt_logprobs", "user", "bad_words"]


@pytest.mark.parametrize("field", UNSUPPORTED)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unsupported_fields_are_refused_by_name(client, path, field):
    body = {"model": MODEL, "max_tokens": 2, field: {"type": "json_object"}}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    _assert_error(client.post(path, json=body), 400, field, f"`{field}` is not supported")
    _good_request(client)


STRICT_ERRORS = [
    # (completion fields, param): values of the wrong type or out of range
    ({"stream": "yes"}, "stream"),
    ({"echo": 1}, "echo"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stop": 5}, "stop"),
    ({"model": 5}, "model"),
    ({"top_k": 2147483648}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"n": 1000}, "n"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [5, 10**6]}, "stop_token_ids"),  # past the vocabulary: no token could match it
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": "t" * (MAX_NAMESPACE_CHARS + 1)}, "cache_salt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # str.isdigit() holds for "²" and "٣", int() fails or reads 3
    ({"logit_bias": {"\u0663": 1}}, "logit_bias"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ab", ""]}, "stop"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [[1, 2], "ab"]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": ["x"] * 1025}, "prompt"),
    ({"stop": ["x"] * 65}, "stop"),  # every token is checked against each: a bound keeps one request cheap
]


@pytest.mark.parametrize("fields,param", STRICT_ERRORS)
def test_strict_values(client, fields, param):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **fields}
    _assert_error(client.post("/v1/completions", json=body), 400, param)
    _good_request(client)


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", r'{"prompt": ["fine", "a\udfff"]}', "prompt"),
    ("/v1/completions", r'{"prompt": "x", "stop": ["\ud800"]}', "stop.0"),
    ("/v1/completions", r'{"prompt": "x", "cache_salt": "\udc00"}', "cache_salt"),
    ("/v1/completions", r'{"prompt": "x", "model": "\ud800"}', "model"),
    ("/v1/completions", r'{"prompt": "x", "\ud800": 1}', None),  # a name that is not text
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
])
def test_lone_surrogates_are_refused(client, path, raw, param):
    """JSON can spell a UTF-16 surrogate alone; such text has no UTF-8 form (no tokenizer or response can
    carry it): a 400 naming the field, as for any other bad value."""
    r = client.post(path, content=raw.replace("{", '{"model": "tiny", "max_tokens": 2, ', 1) if path != "/tokenize"
                    else raw, headers={"content-type": "application/json"})
    _assert_error(r, 400, param)
    _good_request(client)


def test_null_means_the_default(client):
    """OpenAI's schema makes the optional fields nullable: `null` is the field left out."""
    body = {"prompt": "abc", "max_tokens": 6, "seed": 3}
    nulls = {"n": None, "temperature": None, "top_p": None, "top_k": None, "min_p": None, "stream": None,
             "echo": None, "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None,
             "ignore_eos": None, "min_tokens": None, "include_stop_str_in_output": None,
             "skip_special_tokens": None, "stop": None, "logprobs": None, "best_of": None}
    expected = complete(client, **body)["choices"]
    assert complete(client, **body, **nulls)["choices"] == expected
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "seed": 3}
    chat_nulls = {"logprobs": None, "add_generation_prompt": None, "temperature": None, "n": None}
    replies = [client.post("/v1/chat/completions", json={"model": MODEL, **chat, **extra})
               for extra in ({}, chat_nulls)]
    assert replies[0].status_code == replies[1].status_code == 200, replies[1].text
    assert replies[0].json()["choices"] == replies[1].json()["choices"]
    _assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "no_such_field": None}), 400,
                  "no_such_field")  # an unknown field is refused, null or not


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                                 b'{"prompt": "x", "temperature": -Infinity}'])
def test_non_finite_numbers_are_refused(client, raw):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("temperature", "top_p"), r.text
    _good_request(client)


CHAT_STRICT_ERRORS = [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),  # the chat field, not the engine's `logprobs`
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages.0.name"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),  # needs include_usage
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),  # only text parts
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
]


@pytest.mark.parametrize("fields,param", CHAT_STRICT_ERRORS)
def test_chat_strict_values(client, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields}
    _assert_error(client.post("/v1/chat/completions", json=body), 400, param)
    _good_request(client)


def test_errors_name_max_completion_tokens_when_the_client_sent_it(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3,
            "min_tokens": 5}
    r = client.post("/v1/chat/completions", json=body)
    _assert_error(r, 400, "min_tokens", "min_tokens (5) must be <= max_completion_tokens (3)")


def test_developer_role_and_names_reach_the_template(client):
    """`developer` is OpenAI's newer `system`; a message's `name` reaches the chat template (the tiny
    model's chat format writes `<role:name>`), as in vLLM."""
    def ids(*messages):
        r = client.post("/tokenize", json={"messages": list(messages)})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    user = {"role": "user", "content": "hi"}
    assert ids({"role": "developer", "content": "be brief"}, user) == ids({"role": "system", "content": "be brief"},
                                                                          user)
    named, plain = ids({**user, "name": "bob"}), ids(user)
    assert len(named) == len(plain) + len(":bob") and named != plain
    body = {"model": MODEL, "messages": [{"role": "developer", "content": "x", "name": "ops"}, {**user, "name": "bob"}],
            **GREEDY}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        ids({"role": "system", "content": "x", "name": "ops"}, {**user, "name": "bob"})), r.text


def test_null_max_tokens_is_no_limit_on_completions(client):
    """As in vLLM: an explicit `null` lets a completion run to `max_model_len`; left out it is 16."""
    prompt_tokens = complete(client, prompt="abc", max_tokens=1)["usage"]["prompt_tokens"]
    unlimited = complete(client, prompt="abc", max_tokens=None, temperature=0, ignore_eos=True)
    assert unlimited["choices"][0]["finish_reason"] == "length"
    assert unlimited["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt_tokens
    assert complete(client, prompt="abc", temperature=0, ignore_eos=True)["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(client, path):
    """vLLM's `continuous_usage_stats`: each chunk of a choice carries the usage so far of that choice
    (its prompt's tokens, the tokens it generated); counted here from the chunks' logprobs."""
    prompt = {"prompt": "The quick"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "The quick"}]}
    logprobs = {"logprobs": 0} if path == "/v1/completions" else {"logprobs": True}
    events = stream(client, path, **prompt, **logprobs, n=2, temperature=1.0, seed=5, max_tokens=6,
                    ignore_eos=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    final = events[-1]["usage"]
    counted = {0: 0, 1: 0}
    for e in events[:-1]:
        [choice] = e["choices"]
        if choice["logprobs"] is None:  # a chat role chunk
            assert "role" in choice["delta"]
            continue
        entries = choice["logprobs"]["tokens"] if path == "/v1/completions" else choice["logprobs"]["content"]
        counted[choice["index"]] += len(entries)
        usage = e["usage"]
        assert usage["completion_tokens"] == counted[choice["index"]]
        assert usage["prompt_tokens"] == final["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert counted == {0: 6, 1: 6} and final["completion_tokens"] == 12


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tokens_without_text_stream_a_chunk_each(app, client, path, monkeypatch):
    """A token that adds no text (here the tiny tokenizer's BOS, forced by logit_bias) still gets its
    chunk, as in vLLM, so a client's TTFT and inter-token latency time tokens, and the continuous usage
    counts every token. (Steps slowed to 50 ms: a stream that falls behind the engine would merge
    tokens into one chunk.)"""
    engine = app.state.server.async_engine.engine
    step = engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    prompt = {"prompt": "The quick"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "The quick"}]}
    events = stream(client, path, **prompt, max_tokens=5, ignore_eos=True, logit_bias={"1": 100},
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [e for e in events if e["choices"] and "role" not in e["choices"][0].get("delta", {})]
    texts = [c["choices"][0]["text"] if path == "/v1/completions" else c["choices"][0]["delta"].get("content")
             for c in chunks]
    assert len(chunks) == 5 and not any(texts), texts
    if path != "/v1/completions":  # a string until the last chunk, which carries only its finish reason
        assert [c["choices"][0]["delta"] for c in chunks] == [{"content": ""}] * 4 + [{}]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    assert events[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("method,path,content,status", [
    ("GET", "/no/such/route", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("POST", "/v1/completions", b'["a list", "not an object"]', 400),
])
def test_framework_errors_are_openai_errors(client, method, path, content, status):
    r = client.request(method, path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    if status == 405:  # HTTP requires it
        assert r.headers["allow"] == "POST"
    _good_request(client)


# --- parameters that work ------------------------------------------------------------------------------------------
def _token(client: httpx.Client, char: str) -> int:
    [token] = client.post("/tokenize", json={"prompt": char, "add_special_tokens": False}).json()["tokens"]
    return token


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_adds_no_text_unless_asked(client, app, stream):
    """As in vLLM: the EOS or stop id that ends a request stays in its token ids, its text is left out
    unless `include_stop_str_in_output`."""
    server = app.state.server
    stops = [i for i in range(server.vocab_size) if server.tokenizer.token_to_text(i) in LETTERS]
    for include in (False, True):
        body = dict(prompt="abcd", max_tokens=20, temperature=0, stop_token_ids=stops, logprobs=0,
                    include_stop_str_in_output=include)
        if stream:
            events = [e["choices"][0] for e in globals()["stream"](client, "/v1/completions", **body) if e["choices"]]
            text = "".join(c["text"] for c in events)
            tokens = [t for c in events if c["logprobs"] for t in c["logprobs"]["tokens"]]
            choice = events[-1]
        else:
            choice = complete(client, **body)["choices"][0]
            text, tokens = choice["text"], choice["logprobs"]["tokens"]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] in stops, choice
        assert tokens[-1] in LETTERS and "".join(tokens) == text + ("" if include else tokens[-1])


def test_logit_bias_changes_what_is_sampled(client, app):
    body = {"prompt": "bias test ", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    plain = complete(client, **body)["choices"][0]["text"]
    banned = max(set(plain), key=plain.count)
    # CharTokenizer: every id >= 3 is one character, chr(32 + (id - 3) % 95); ban each id of this one
    ids = [t for t in range(3, app.state.server.vocab_size) if chr(32 + (t - 3) % 95) == banned]
    text = complete(client, **body, logit_bias={str(t): -100 for t in ids})["choices"][0]["text"]
    assert banned not in text and len(text) == 12
    forced = complete(client, **body, logit_bias={str(_token(client, "Q")): 100})["choices"][0]["text"]
    assert forced == "Q" * 12
    with_seed = {**body, "temperature": 1.0, "seed": 1099511627776}  # a seed above 32 bits
    assert complete(client, **with_seed)["choices"][0]["text"] == complete(client, **with_seed)["choices"][0]["text"]


def test_penalties_reach_the_sampler(client):
    body = {"prompt": "repeat repeat repeat ", "temperature": 0, "max_tokens": 24, "ignore_eos": True}
    plain = complete(client, **body)["choices"][0]["text"]
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        text = complete(client, **body, **penalty)["choices"][0]["text"]
        assert len(text) == 24 and text != plain, penalty
        # a penalized greedy run repeats a character no more often than the plain one
        assert max(map(text.count, set(text))) <= max(map(plain.count, set(plain))), penalty
    assert_no_leak(client)


def test_completion_top_logprobs_hold_the_sampled_token(client):
    """Legacy completions: each position's top_logprobs hold the sampled token besides the `logprobs` best
    ones (OpenAI: "up to logprobs+1 elements"), with the sampled token's own logprob."""
    body = {"prompt": "hello", "max_tokens": 30, "temperature": 5.0, "seed": 1}
    for k in (0, 1):
        lp = complete(client, logprobs=k, **body)["choices"][0]["logprobs"]
        outside = 0
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert top[token] == logprob and len(top) <= k + 1
            outside += len(top) == k + 1
        assert outside > 0  # at temperature 5 some sampled tokens are not among the best k
        if k == 0:
            assert outside == 30


def test_streamed_text_offsets_follow_the_tokens_when_stop_strings_hold_text_back(client):
    body = {"prompt": "hello", "logprobs": 1, "stop": ["<<<<<<<<"], **GREEDY, "max_tokens": 20}
    whole = complete(client, **body)["choices"][0]["logprobs"]
    events = stream(client, "/v1/completions", **body)
    offsets = [o for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    lengths = [0] + [len(t) for t in whole["tokens"]]
    assert offsets == whole["text_offset"] == [sum(lengths[: i + 1]) for i in range(20)]


def test_every_chunk_of_a_stream_has_the_same_created_time(client, monkeypatch):
    from llmjax.serve import protocol

    class Clock:  # a second passes at every reading
        t = 1_700_000_000

        @classmethod
        def time(cls) -> int:
            cls.t += 1
            return cls.t

    monkeypatch.setattr(protocol, "time", Clock)
    for path, body in (("/v1/completions", {"prompt": "abc"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        events = stream(client, path, **body, **GREEDY, stream_options={"include_usage": True})
        assert len(events) > 3 and len({e["created"] for e in events}) == 1, [e["created"] for e in events]


def test_tokenize_flags(client):
    messages = [{"role": "user", "content": "hi"}]

    def tokens(**body) -> list[int]:
        r = client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    chat = tokens(messages=messages)
    assert tokens(messages=messages, add_special_tokens=True) == [1] + chat  # the tokenizer's BOS and the template's
    assert tokens(prompt="hi", add_special_tokens=False) == tokens(prompt="hi")[1:]
    _assert_error(client.post("/tokenize", json={"prompt": "hi", "add_generation_prompt": False}), 400,
                  "add_generation_prompt")
    _assert_error(client.post("/tokenize", json={"messages": []}), 400, "messages")  # as chat completions refuse it
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tokens(messages=[{"role": "user", "content": parts}]) == \
        tokens(messages=[{"role": "user", "content": "a\nb"}])  # text parts joined by newlines, as vLLM


def test_continue_final_message_ends_the_prompt_with_that_messages_text(client):
    """vLLM's `continue_final_message` (chat completions and /tokenize): the tiny chat format writes
    "<role>content\n" per message; the prompt stops right after the last content. It needs
    `add_generation_prompt: false`, as in vLLM."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "So"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == client.post("/tokenize", json={"prompt": "<user>hi\n<assistant>So"}).json()["tokens"]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>So") + 1  # the format's BOS
    for path, extra in (("/v1/chat/completions", {"model": "tiny", "max_tokens": 3}), ("/tokenize", {})):
        _assert_error(client.post(path, json={"messages": messages, "continue_final_message": True, **extra}), 400,
                      "continue_final_message")
    _assert_error(client.post("/tokenize", json={"prompt": "hi", "continue_final_message": True}), 400,
                  "continue_final_message")


def test_prompts_are_tokenized_in_worker_threads_and_admitted_in_one_command(client, app):
    """A long prompt must stall neither the event loop nor the engine's steps (tokenized in worker
    threads), and a batch of prompts waits for the engine loop once, not once per prompt."""
    server = app.state.server
    encode, call = server.tokenizer.encode, server.async_engine.call
    threads, calls = [], []

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    async def counting_call(fn):
        calls.append(threading.current_thread().name)  # the event loop's thread
        return await call(fn)

    server.tokenizer.encode, server.async_engine.call = recording_encode, counting_call
    try:
        out = complete(client, prompt=[f"prompt {i}" for i in range(8)], max_tokens=2)
    finally:
        server.tokenizer.encode, server.async_engine.call = encode, call
    assert len(out["choices"]) == 8 and len(calls) == 1
    assert len(threads) == 8 and not {*calls, "llmjax-engine-loop"} & set(threads), (threads, calls)


def test_add_generation_prompt(client):
    messages = [{"role": "user", "content": "hi"}]

    def usage(add: bool) -> int:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                      "add_generation_prompt": add})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    for add in (True, False):
        expected = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": add}).json()["count"]
        assert usage(add) == expected
    assert usage(True) - usage(False) == len("<assistant>")  # CharTokenizer's assistant header


def test_models_advertise_a_context_the_pool_holds(client):
    [card] = client.get("/v1/models").json()["data"]
    assert card["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(ConfigError, match="larger than the KV cache can hold"):
        build_app(tiny_engine(kv_cache_memory_bytes=64 << 10, max_model_len=MAX_MODEL_LEN), MODEL)


# --- health, failures -----------------------------------------------------------------------------------------------
def test_health_answers_while_the_loop_is_busy(client, base_url, app):
    """`/health` reads the heartbeat: it answers while the loop thread is held inside a command;
    the KV scan (`/debug/kv_invariants`) runs on the loop thread, so it waits for it."""
    gate, holding = threading.Event(), threading.Event()

    def hold(_engine) -> None:
        holding.set()
        gate.wait(60)

    holder = threading.Thread(target=lambda: asyncio.run(app.state.server.async_engine.call(hold)))
    holder.start()
    try:
        assert holding.wait(30)
        assert client.get("/health", timeout=10).status_code == 200
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{base_url}/debug/kv_invariants", timeout=0.5)
    finally:
        gate.set()
        holder.join()
    assert client.get("/debug/kv_invariants").status_code == 200
    _good_request(client)


def test_an_error_while_tokenizing_fails_only_that_request(client, app):
    tokenizer = app.state.server.tokenizer
    encode = tokenizer.encode

    def poisoned(text, *args, **kwargs):
        if "POISON" in text:
            raise RuntimeError("tokenizer failure")
        return encode(text, *args, **kwargs)

    tokenizer.encode = poisoned
    try:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["fine", "POISON"], "max_tokens": 2})
    finally:
        tokenizer.encode = encode
    assert r.status_code == 500 and "tokenizer failure" in r.json()["error"]["message"], r.text
    _good_request(client)
    assert_no_leak(client)


def test_an_error_while_the_engine_admits_fails_only_that_request(client, app):
    engine = app.state.server.async_engine.engine
    add_request = engine.add_request
    poison = [7, 7, 7, 7]

    def poisoned(prompt, *args, **kwargs):
        if list(prompt) == poison:
            raise RuntimeError("admission failure")
        return add_request(prompt, *args, **kwargs)

    errors_before = metrics(client)["llmjax:engine_errors_total"]
    engine.add_request = poisoned
    try:  # the first prompt is admitted, then the second fails: neither may stay queued
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6, 7], poison], "max_tokens": 2})
    finally:
        engine.add_request = add_request
    assert r.status_code == 500 and "admission failure" in r.json()["error"]["message"], r.text
    assert metrics(client)["llmjax:engine_errors_total"] == errors_before + 1
    _good_request(client)
    assert_no_leak(client)


def serve_in_thread(app) -> tuple[str, threading.Thread, list[int]]:
    """`serve_app(app)` on a free port in a thread, returned once `/health` answers 200: its URL, the
    thread, and the list its exit status is appended to."""
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    status = []
    thread = threading.Thread(target=lambda: status.append(serve_app(app, sock, "warning")))
    thread.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url, thread, status
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)


def test_a_dead_engine_loop_fails_health_and_exits_non_zero():
    engine = tiny_engine(kv_cache_memory_bytes=1 << 20, max_model_len=64)
    app = build_app(engine, MODEL)
    url, thread, status = serve_in_thread(app)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).status_code == 200

    step, steps = engine.step, []

    def broken_step():  # two good steps (the request runs, holding KV), then one that raises
        steps.append(1)
        if len(steps) > 2:
            raise RuntimeError("device lost")
        return step()

    engine.step = broken_step  # an error the engine could not contain: the loop dies
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 20}, timeout=60)
    assert r.status_code == 500 and "device lost" in r.json()["error"]["message"], r.text
    problem = app.state.server.async_engine.health()
    assert problem is not None and "device lost" in problem
    stats = app.state.server.async_engine.stats  # what /metrics shows: nothing runs any more
    assert (stats.num_running, stats.num_waiting, stats.kv_usage, stats.num_engine_errors) == (0, 0, 0.0, 1)
    thread.join(60)
    assert status == [1]  # the server stopped by itself, with a failure status for its supervisor


# --- API key, CORS ----------------------------------------------------------------------------------------------------
def test_api_key_and_cors():
    app = build_app(tiny_engine(kv_cache_memory_bytes=1 << 20, max_model_len=64), MODEL, api_key="sekrit",
                    allowed_origins=("http://ui.example",))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with running_server(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"},
                        {"Authorization": "Basic sekrit"}, {"Authorization": "Bearersekrit"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
            assert r.json()["error"]["code"] == 401
            assert c.get("/v1/models", headers=headers).status_code == 401
            assert c.get("/debug/kv_invariants", headers=headers).status_code == 401  # a pool scan on the loop
        auth = {"Authorization": "Bearer sekrit"}
        assert c.post("/v1/completions", json=body, headers=auth).status_code == 200
        assert c.get("/v1/models", headers=auth).status_code == 200
        assert c.get("/debug/kv_invariants", headers=auth).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "bearer sekrit"}).status_code == 200  # any case
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # open
        preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        r = c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = c.post("/v1/completions", json=body, headers={**auth, "Origin": "http://ui.example"})
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        r = c.options("/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_no_cors_by_default(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                    headers={"Origin": "http://ui.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_port_taken_while_the_server_started_is_an_error_not_a_server_that_never_listens():
    """Linux lets two SO_REUSEADDR sockets bind one port while neither listens: the first to listen
    wins, and the other must exit with an error rather than serve a socket that never listens."""
    first = bind_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = bind_socket("127.0.0.1", port)
    try:
        start_listening(second, "127.0.0.1", port)
        with pytest.raises(SystemExit, match="another server took the port while this one was starting"):
            start_listening(first, "127.0.0.1", port)
    finally:
        first.close()
        second.close()
    assert (http_url("::1", 8000), http_url("127.0.0.1", 8000)) == ("http://[::1]:8000", "http://127.0.0.1:8000")


def test_api_key_from_the_environment_and_loopback_hosts(monkeypatch):
    args = argparse.Namespace(api_key=None)
    monkeypatch.delenv("LLMJAX_API_KEY", raising=False)
    assert resolve_api_key(args) is None
    monkeypatch.setenv("LLMJAX_API_KEY", "from-env")
    assert resolve_api_key(args) == "from-env"
    assert resolve_api_key(argparse.Namespace(api_key="flag")) == "flag"
    for key in ("abc\n", " abc", "ab\tc", "clé"):  # a key file's newline; no client could send these
        monkeypatch.setenv("LLMJAX_API_KEY", key)
        with pytest.raises(SystemExit, match="LLMJAX_API_KEY has surrounding whitespace"):
            resolve_api_key(args)
        with pytest.raises(SystemExit, match="--api-key has surrounding whitespace"):
            resolve_api_key(argparse.Namespace(api_key=key))
    assert resolve_api_key(argparse.Namespace(api_key="a b~")) == "a b~"
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.1.2.3", "example.com")] == \
        [True, True, True, False, False, False]


# --- n > 1 and failed steps (the engine's delta outputs) ---------------------------------------------------
def test_n_samples_become_choices(client):
    body = dict(prompt=["abc", "xyz"], n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    whole = complete(client, **body)
    assert [c["index"] for c in whole["choices"]] == list(range(6))  # prompt i, sample j: index i * n + j
    texts = [c["text"] for c in whole["choices"]]
    assert len(set(texts[:3])) > 1 and all(c["finish_reason"] == "length" for c in whole["choices"])
    assert whole["usage"]["completion_tokens"] == 36
    events = stream(client, "/v1/completions", **body)
    streamed = {}
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert [streamed[i] for i in range(6)] == texts  # seeded: the same samples streamed or not
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                      "n": 2, **GREEDY}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]  # greedy samples agree
    assert_no_leak(client)


def test_a_failed_engine_step_is_a_500_error_object_and_serving_goes_on(client, app):
    runner = app.state.server.async_engine.engine.runner
    dispatch = runner.dispatch

    def fail_once(*args, **kwargs):
        runner.dispatch = dispatch
        raise RuntimeError("injected step failure")

    for path, body in [("/v1/completions", {"prompt": "abc"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        runner.dispatch = fail_once
        r = client.post(path, json={"model": MODEL, **body, **GREEDY})
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"], r.text
        runner.dispatch = fail_once
        events = stream(client, path, **body, **GREEDY)
        assert "injected step failure" in events[-1]["error"]["message"]
        _good_request(client)
    assert_no_leak(client)


def _http_get(sock: socket.socket, path: str) -> bytes:
    """Send a keep-alive GET on `sock` and read its whole (small, content-length) response."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head.split(b"\r\n")[0]


def test_timeout_keep_alive_closes_idle_connections_after_it_and_only_then():
    engine = tiny_engine(kv_cache_memory_bytes=1 << 20, max_model_len=64)
    app = build_app(engine, MODEL)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    status = []
    thread = threading.Thread(target=lambda: status.append(serve_app(app, sock, "warning", timeout_keep_alive=0.5)))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=10)
                break
            except OSError:
                assert time.monotonic() < deadline and thread.is_alive()
                time.sleep(0.05)
        with conn:
            assert _http_get(conn, "/health") == b"HTTP/1.1 200 OK"
            time.sleep(0.1)  # well within the keep-alive: the same connection serves again
            assert _http_get(conn, "/v1/models") == b"HTTP/1.1 200 OK"
            time.sleep(1.5)  # idle past it: the server has closed the connection (its default would wait 5 s)
            conn.settimeout(1.0)
            assert conn.recv(1) == b""
    finally:
        app.state.server.async_engine.on_dead()  # how the server is told to stop (see `serve_app`)
        thread.join(60)
    assert status == [0]


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_timeout_keep_alive_must_be_a_positive_number_of_seconds(value):
    from llmjax.serve.server import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["--timeout-keep-alive", "2.5"]).timeout_keep_alive == 2.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--timeout-keep-alive", value])


def test_a_stream_interval_sends_several_tokens_per_event_with_their_logprobs_and_offsets():
    engine = tiny_engine(kv_cache_memory_bytes=1 << 20, max_model_len=64, stream_interval=3)
    step = engine.step
    # slow steps: a stream merges the outputs its reader has not taken yet, and a busy machine's event
    # loop could otherwise fall a step behind, merging two events into one
    engine.step = lambda: (time.sleep(0.05), step())[1]
    with running_server(build_app(engine, MODEL)) as url, httpx.Client(base_url=url, timeout=120) as client:
        whole = complete(client, prompt="abc", logprobs=1, **GREEDY)["choices"][0]
        events = [e for e in stream(client, "/v1/completions", prompt="abc", logprobs=1, **GREEDY) if e["choices"]]
        chat = [e["choices"][0]["delta"].get("content") for e in stream(
            client, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], **GREEDY)]
    per_event = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events]
    assert per_event == [1, 3, 3, 1]  # 8 tokens: the first, two intervals, the rest
    joined = {key: [x for e in events for x in e["choices"][0]["logprobs"][key]] for key in whole["logprobs"]}
    assert joined == whole["logprobs"]  # tokens, logprobs, top logprobs and text offsets
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert len(chat) == 1 + 4  # the role, then the same four events

def test_an_echo_with_logprobs_aborted_before_its_prompt_is_computed_ends_with_abort(monkeypatch):
    """A streamed echo with logprobs still queued when the server stops: its prompt has no logprobs
    yet, so the echoed tokens' entries are null and the stream ends as any other aborted one (the
    prompt, finish reason "abort", `[DONE]`), not with a server error."""
    monkeypatch.setattr(asgi, "GRACEFUL_SHUTDOWN_S", 1.0)
    engine = tiny_engine(max_num_seqs=1, max_model_len=64)
    step = engine.step

    def slow_step():  # the running request outlasts the grace period
        time.sleep(0.03)
        return step()

    engine.step = slow_step
    app = build_app(engine, MODEL)
    url, thread, status = serve_in_thread(app)
    running = {"model": MODEL, "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    echo = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "echo": True, "logprobs": 1, "stream": True}
    queued: list[str] = []
    later = threading.Thread(target=lambda: queued.append(httpx.post(f"{url}/v1/completions", json=echo,
                                                                     timeout=60).text))
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=running, timeout=60) as r:
            for line in r.iter_lines():  # read to its end: it holds the slot until the abort
                if line.startswith("data: ") and not later.is_alive() and not queued:
                    later.start()  # the slot is taken: the echo waits in the queue
                    while len(engine.scheduler.waiting) < 1:
                        time.sleep(0.01)
                    app.state.server.async_engine.on_dead()
        later.join(60)
    finally:
        app.state.server.async_engine.on_dead()
        thread.join(60)
    chunks = sse_events(queued[0])
    assert chunks and all("error" not in c for c in chunks), queued
    choice = chunks[-1]["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"] == "hello", choice
    assert choice["logprobs"]["token_logprobs"] == [None] * len(choice["logprobs"]["tokens"]), choice
    assert status == [0]


def test_a_stream_still_going_when_the_grace_period_ends_is_aborted_and_ends_cleanly(monkeypatch):
    """Stopping lets open responses go on for the grace period (here 1 s); a stream still going
    shortly before its end is aborted: a final chunk with finish reason "abort", then `data: [DONE]`,
    instead of a connection cut by uvicorn's cancellation; a non-streamed request gets a 503; the
    server exits with status 0. (The same two requests run once first, so no step compiles when the
    abort is due: a compiling step would leave uvicorn's cut, as on a server started without warm-up.)"""
    monkeypatch.setattr(asgi, "GRACEFUL_SHUTDOWN_S", 1.0)
    engine = tiny_engine(kv_cache_memory_bytes=1 << 20, max_model_len=64)
    step = engine.step

    def slow_step():  # 50 tokens take 1.5 s, past the grace period
        time.sleep(0.03)
        return step()

    engine.step = slow_step
    app = build_app(engine, MODEL)
    url, thread, status = serve_in_thread(app)

    def both(max_tokens: int, stop: bool) -> tuple[list, list[str]]:
        """A non-streamed request, then a stream beside it; with `stop`, the server is told to stop
        (as `serve_app` is) at the stream's first event. The non-streamed response, the stream's events."""
        body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        whole = []
        other = threading.Thread(target=lambda: whole.append(httpx.post(
            f"{url}/v1/completions", json={**body, "stream": False}, timeout=60)))
        other.start()
        while not engine.has_unfinished_requests():  # it runs before the stream starts
            assert other.is_alive()
            time.sleep(0.01)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if stop and len(events) == 1:
                        app.state.server.async_engine.on_dead()
        other.join(60)
        return whole, events

    try:
        both(4, stop=False)  # compiles the steps' shapes
        whole, events = both(50, stop=True)
    finally:
        app.state.server.async_engine.on_dead()
        thread.join(60)
    assert events[-1] == "data: [DONE]", events
    reasons = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert reasons[-1] == "abort" and len(reasons) < 50, reasons
    # not a 200 with partial text: a 503, which a router re-sends to another replica
    assert whole[0].status_code == 503 and "shut" in whole[0].json()["error"]["message"], whole[0].text
    assert status == [0]
