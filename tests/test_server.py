"""The HTTP server end to end: a real uvicorn server on 127.0.0.1 over a tiny random model.

One server for the module. KV health is checked through `/health`, which runs the engine's
`check_kv_invariants` on the loop thread (503 if they fail); "no block in use" through `/metrics`.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from llmjax.serve.api import build_app
from llmjax.serve.metrics import parse_metrics
from tests.engine_helpers import tiny_engine
from tests.server_helpers import running_server

MODEL = "tiny"
MAX_MODEL_LEN = 128
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def base_url():
    engine = tiny_engine(max_num_seqs=32, kv_cache_memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN)
    with running_server(build_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def metrics(client: httpx.Client) -> dict[str, float]:
    return parse_metrics(client.get("/metrics").text)


def wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client)
        if m["llmjax:num_requests_running"] == 0 and m["llmjax:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine still busy: {m}"
        time.sleep(0.05)


def assert_no_leak(client: httpx.Client) -> None:
    m = wait_idle(client)
    assert m["llmjax:kv_cache_usage_perc"] == 0.0
    health = client.get("/health")
    assert health.status_code == 200, health.text


def sse_events(raw: str) -> list[dict]:
    """Parse an SSE body, checking OpenAI's framing: `data: ...` events, the last `[DONE]`."""
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


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
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
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


# --- errors --------------------------------------------------------------------------------------------------
COMPLETION_ERRORS = [
    # (request body or raw bytes, status, param, message start)
    ({"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs must be"),
    ({"prompt": "x", "n": 2}, 400, "n", "only n=1"),
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
    assert error["type"] and "code" in error
    assert complete(client, prompt="still fine", max_tokens=2)["choices"][0]["finish_reason"]


@pytest.mark.parametrize("body,status,param", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -2}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "model"),
])
def test_chat_errors(client, body, status, param):
    r = client.post("/v1/chat/completions", json={"model": MODEL, **body} if "model" not in body else body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
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


def test_metrics_names(client):
    m = metrics(client)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert f"llmjax:{name}" in m, name
    assert m["llmjax:e2e_request_latency_seconds_count"] > 0 and m["llmjax:prompt_tokens_total"] > 0
