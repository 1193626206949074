"""The router end to end: real uvicorn servers on 127.0.0.1 (`tests/server_helpers.py`).

Two tiny-model replicas behind a cache-aware router: prefix families stick to one replica,
stopping a replica in the middle of a run loses no later request, and a hundred poison requests
leave both healthy. Health-check removal and recovery, retries on a 503 and relayed errors use
stub workers (no model) whose answers can be switched. `llmjax cluster` runs as a subprocess for
the supervision test (a replica killed under load comes back).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmjax.serve import asgi
from llmjax.serve.api import build_app
from llmjax.serve.cluster import replica_pids
from llmjax.serve.metrics import parse_metrics
from llmjax.serve.router import Router, build_router_app
from llmjax.serve.routing import CacheAware, RoundRobin, routing_key
from tests.engine_helpers import tiny_engine
from tests.server_helpers import running_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
from common import free_port  # noqa: E402  (experiments/common.py)

MODEL = "tiny"
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 4, "ignore_eos": True}
NUM_FAMILIES, PER_FAMILY = 4, 4
TIMEOUT = 120  # seconds; a loaded machine may compile a new step shape mid-test


def family_prompt(family: int, i: int) -> str:
    head = chr(ord("a") + family) * 3
    return f"{head} system prompt of family {family}; {head} rules. " * 2 + f"question {i}?"


@pytest.fixture(scope="module")
def replicas():
    """Two tiny-model servers for the module: their URLs and an ExitStack each (closing one stops
    that server; the test that does so comes last)."""
    with contextlib.ExitStack() as outer:
        stacks = [outer.enter_context(contextlib.ExitStack()) for _ in range(2)]
        urls = [s.enter_context(running_server(build_app(tiny_engine(max_num_seqs=8, kv_cache_memory_bytes=4 << 20,
                                                                        max_model_len=128), MODEL)))
                for s in stacks]
        yield urls, stacks


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=TIMEOUT).text)


async def send(client: httpx.AsyncClient, prompt: str, stream: bool, **extra) -> tuple[int, str, str]:
    """POST a completion through the router; (status, worker header, generated text)."""
    body = {**GREEDY, "prompt": prompt, "stream": stream, **extra}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        raw = (await r.aread()).decode()
    if r.status_code != 200:
        return r.status_code, "", raw
    if not stream:
        return 200, r.headers["x-llmjax-worker"], json.loads(raw)["choices"][0]["text"]
    events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", raw
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), raw
    return 200, r.headers["x-llmjax-worker"], "".join(c["choices"][0]["text"] for c in chunks)


def test_prefix_families_stick_to_one_replica(replicas):
    urls, _ = replicas
    with running_server(build_router_app(urls, CacheAware(), 3600)) as router:  # no health checks needed
        jobs = [(f, i) for i in range(PER_FAMILY) for f in range(NUM_FAMILIES)]  # interleaved

        async def run():
            async with httpx.AsyncClient(base_url=router, timeout=TIMEOUT) as client:
                return await asyncio.gather(*(send(client, family_prompt(f, i), stream=(f + i) % 2 == 0)
                                              for f, i in jobs))

        results = asyncio.run(run())
        assert all(status == 200 for status, _, _ in results), results
        assert all(len(text) == 4 for _, _, text in results)  # CharTokenizer: one character per token
        homes = {}
        for (f, _), (_, worker, _) in zip(jobs, results):
            homes.setdefault(f, set()).add(worker)
        assert all(len(h) == 1 for h in homes.values()), homes
        assert {w for h in homes.values() for w in h} == set(urls)  # families spread over both replicas

        body = {**GREEDY, "prompt": family_prompt(0, 9)}
        direct = httpx.post(f"{urls[0]}/v1/completions", json=body, timeout=TIMEOUT).json()
        status, _, text = asyncio.run(_one(router, family_prompt(0, 9), stream=True))
        assert (status, text) == (200, direct["choices"][0]["text"])  # the stream relayed intact

        routed = metrics(router)
        assert routed["llmjax:router_decisions_total"] == len(jobs) + 1
        hits = sum(metrics(u)["llmjax:prefix_cache_hits_total"] for u in urls)
        assert hits > 0
        for path in ("/v1/models", f"/v1/models/{MODEL}", "/health"):
            assert httpx.get(router + path, timeout=TIMEOUT).status_code == 200
        assert httpx.post(f"{router}/tokenize", json={"prompt": "abc"}, timeout=TIMEOUT).json()["count"] >= 3


async def _one(base_url: str, prompt: str, stream: bool):
    async with httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT) as client:
        return await send(client, prompt, stream)


class StubWorker:
    """A worker without a model: `/health` and `/v1/completions` answer 200, or an error when told."""

    def __init__(self, name: str):
        self.healthy: bool | str = True  # or "garbled": a 502 whose body is no text
        self.serving = True
        self.completions = 0  # requests that reached `/v1/completions`
        self.fail_with: int | None = None  # answer completions with this error status
        self.retry_after: str | None = None  # the Retry-After of its 503s
        self.name = name
        self.app = FastAPI()
        self.app.add_api_route("/health", self.health)
        self.app.add_api_route("/v1/completions", self.complete, methods=["POST"])

    def health(self):
        if self.healthy == "garbled":
            return Response(b"\xff\xfe not UTF-8", status_code=502, media_type="text/plain; charset=utf-8")
        return Response(status_code=200 if self.healthy else 503)

    def complete(self):
        self.completions += 1
        if not self.serving:
            headers = {"retry-after": self.retry_after} if self.retry_after else None
            return JSONResponse(self.overloaded_body(), status_code=503, headers=headers)
        if self.fail_with is not None:
            return JSONResponse({"error": {"message": "refused", "code": self.fail_with}}, status_code=self.fail_with)
        return {"choices": [{"text": self.name}]}

    def overloaded_body(self) -> dict:
        return {"error": {"message": f"{self.name} is overloaded", "type": "service_unavailable", "code": 503}}


def complete_stub(router: str) -> str:
    """The name of the stub worker that answered a completion through the router."""
    return httpx.post(f"{router}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT).json()["choices"][0]["text"]


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_health_checks_take_a_worker_out_and_bring_it_back():
    a, b = StubWorker("a"), StubWorker("b")
    with running_server(a.app) as url_a, running_server(b.app) as url_b, \
            running_server(build_router_app([url_a, url_b], RoundRobin(), 0.05)) as router:
        def up() -> dict[str, bool]:
            return {w["url"]: w["up"] for w in httpx.get(f"{router}/workers", timeout=TIMEOUT).json()}

        def served(n: int) -> set[str]:
            return {complete_stub(router) for _ in range(n)}

        assert served(4) == {"a", "b"}
        b.healthy = False
        wait_for(lambda: up() == {url_a: True, url_b: False})
        assert served(4) == {"a"}
        b.healthy = True
        wait_for(lambda: up() == {url_a: True, url_b: True})
        assert served(4) == {"a", "b"}
        b.healthy = "garbled"  # any answer is a failed check; the checks go on
        wait_for(lambda: up() == {url_a: True, url_b: False})
        b.healthy = True
        wait_for(lambda: up() == {url_a: True, url_b: True})

        a.healthy = b.healthy = False
        wait_for(lambda: not any(up().values()))
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]
        assert httpx.get(f"{router}/health", timeout=TIMEOUT).status_code == 503
        assert metrics(router)["llmjax:router_failed_requests_total"] == 1


def test_a_503_before_the_first_byte_is_retried_on_another_worker():
    a, b = StubWorker("a"), StubWorker("b")
    b.serving = False  # healthy by /health, but its engine refuses work
    with running_server(a.app) as url_a, running_server(b.app) as url_b, \
            running_server(build_router_app([url_a, url_b], RoundRobin(), 3600)) as router:
        assert [complete_stub(router) for _ in range(4)] == ["a"] * 4
        m = metrics(router)
        # round robin keeps trying b; each 503 is retried on a, and b stays up: an answer is no
        # reason to take a worker down (its /health decides)
        failures = m["llmjax:router_worker_failures_total"]
        assert failures >= 2 and m["llmjax:router_requests_total"] == 4 + failures
        assert all(w["up"] for w in httpx.get(f"{router}/workers", timeout=TIMEOUT).json())
        b.serving = True
        assert sorted(complete_stub(router) for _ in range(2)) == ["a", "b"]


def test_a_retried_request_is_one_decision_and_only_the_serving_worker_keeps_its_prefix():
    """Cache-aware routing sends each new prompt to b first (the earlier of two idle workers with
    empty trees); b answers 503, so a serves it. Each request counts one decision, and only a's
    tree holds its prompt."""
    a, b = StubWorker("a"), StubWorker("b")
    b.serving = False
    policy = CacheAware()
    prompts = [f"{family} system prompt, question {i}" for i, family in enumerate(("first", "second", "third"))]
    with running_server(a.app) as url_a, running_server(b.app) as url_b, \
            running_server(build_router_app([url_b, url_a], policy, 3600)) as router:
        for prompt in prompts:
            r = httpx.post(f"{router}/v1/completions", json={"prompt": prompt}, timeout=TIMEOUT)
            assert r.json()["choices"][0]["text"] == "a"
        m = metrics(router)
        assert m["llmjax:router_worker_failures_total"] == len(prompts)  # every one went to b first
        assert m["llmjax:router_decisions_total"] == len(prompts)
        for prompt in prompts:
            assert policy.tree(url_b).match(routing_key(prompt)) == 0
            assert policy.tree(url_a).match(routing_key(prompt)) == len(routing_key(prompt))
        b.serving = True  # the family's next request follows the worker that served it
        r = httpx.post(f"{router}/v1/completions", json={"prompt": prompts[0] + "?"}, timeout=TIMEOUT)
        assert r.json()["choices"][0]["text"] == "a"
        assert all(w["in_flight"] == 0 for w in httpx.get(f"{router}/workers", timeout=TIMEOUT).json())


def test_a_prompt_a_worker_refused_leaves_no_prefix_in_its_tree():
    """An error answer (a 400: nothing computed) is relayed, and the cache-aware policy forgets the
    prompt for that worker; a success keeps it."""
    a = StubWorker("a")
    policy = CacheAware()
    with running_server(a.app) as url_a, running_server(build_router_app([url_a], policy, 3600)) as router:
        a.fail_with = 400
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "refused system prompt"}, timeout=TIMEOUT)
        assert r.status_code == 400
        assert policy.tree(url_a).match(routing_key("refused system prompt")) == 0
        a.fail_with = None
        assert httpx.post(f"{router}/v1/completions", json={"prompt": "served system prompt"},
                          timeout=TIMEOUT).json()["choices"][0]["text"] == "a"
        assert policy.tree(url_a).match(routing_key("served system prompt")) == len(routing_key("served system prompt"))
        assert metrics(router)["llmjax:router_decisions_total"] == 2


def test_when_every_worker_answers_503_the_last_answer_is_relayed():
    """Round robin tries a, then b: the client gets b's 503 as b sent it, Retry-After included."""
    a, b = StubWorker("a"), StubWorker("b")
    a.serving = b.serving = False
    a.retry_after, b.retry_after = "1", "2"
    with running_server(a.app) as url_a, running_server(b.app) as url_b, \
            running_server(build_router_app([url_a, url_b], RoundRobin(), 3600)) as router:
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 503 and r.json() == b.overloaded_body(), r.text
        assert r.headers["retry-after"] == "2" and r.headers["x-llmjax-worker"] == url_b
        b.retry_after = None  # no Retry-After from the last worker: none relayed, whatever a sent
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 503 and r.json() == b.overloaded_body() and "retry-after" not in r.headers
        m = metrics(router)
        assert m["llmjax:router_failed_requests_total"] == 2 and m["llmjax:router_worker_failures_total"] == 4
        assert all(w["up"] and w["in_flight"] == 0 for w in httpx.get(f"{router}/workers", timeout=TIMEOUT).json())


class SilentWorker:
    """A worker that goes silent when told: before its response headers (`hang`: "headers") or
    after the first event of an SSE stream ("stream"). `disconnected` is set once the router has
    closed a silent request's connection."""

    def __init__(self):
        self.hang: str | None = None
        self.healthy = True
        self.disconnected = threading.Event()
        self.app = FastAPI()
        self.app.add_api_route("/health", lambda: Response(status_code=200 if self.healthy else 503))
        self.app.add_api_route("/v1/completions", self.complete, methods=["POST"])

    async def complete(self, request: Request):
        if self.hang == "headers":
            await self._until_disconnected(request)
            return Response(status_code=200)
        if self.hang == "stream":
            async def events():
                yield FIRST_EVENT
                await self._until_disconnected(request)
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"text": "ok"}]}

    async def _until_disconnected(self, request: Request) -> None:
        try:
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
        finally:  # cancelled, too, when the server sees the disconnect first
            self.disconnected.set()


def test_a_worker_silent_before_its_headers_gets_the_client_a_504():
    worker = SilentWorker()
    with running_server(worker.app) as url, \
            running_server(build_router_app([url], RoundRobin(), 3600, request_timeout=1.0)) as router:
        worker.hang = "headers"
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 504 and r.json()["error"]["code"] == 504, r.text
        assert url in r.json()["error"]["message"]
        assert worker.disconnected.wait(TIMEOUT)  # the router closed the worker's connection
        [state] = httpx.get(f"{router}/workers", timeout=TIMEOUT).json()
        assert state["up"] and state["in_flight"] == 0
        worker.hang = None  # the next request is served as usual
        assert httpx.post(f"{router}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT).json() == {
            "choices": [{"text": "ok"}]}


def test_a_stream_that_goes_silent_ends_with_an_error_event():
    worker = SilentWorker()
    worker.hang = "stream"
    with running_server(worker.app) as url, \
            running_server(build_router_app([url], RoundRobin(), 3600, request_timeout=1.0)) as router:
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "x", "stream": True}, timeout=TIMEOUT)
        events = [e[6:] for e in r.text.split("\n\n") if e]
        assert r.status_code == 200 and len(events) == 3, r.text
        assert events[0].encode() == FIRST_EVENT[6:-2]
        assert json.loads(events[1])["error"]["code"] == 504 and events[2] == "[DONE]"
        assert worker.disconnected.wait(TIMEOUT)
        wait_for(lambda: httpx.get(f"{router}/workers", timeout=TIMEOUT).json()[0]["in_flight"] == 0)


def test_a_stream_of_a_worker_marked_down_ends_once_silent():
    """A worker that froze mid-stream (silent, failing its health checks): once it is marked down, its
    stream ends with an error event after `health_check_timeout` seconds of silence, not after the
    30-minute `request_timeout`."""
    worker = SilentWorker()
    worker.hang = "stream"
    with running_server(worker.app) as url, running_server(build_router_app(
            [url], RoundRobin(), 0.05, health_check_timeout=0.5, health_failure_threshold=1)) as router:
        with httpx.stream("POST", f"{router}/v1/completions", json={"prompt": "x", "stream": True},
                          timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert next(lines).encode() == FIRST_EVENT[:-2]
            worker.healthy = False
            start = time.monotonic()
            events = [line[6:] for line in lines if line]
        assert time.monotonic() - start < 10
        assert len(events) == 2 and json.loads(events[0])["error"]["code"] == 502 and events[1] == "[DONE]", events
        assert "marked down and silent" in json.loads(events[0])["error"]["message"]
        assert worker.disconnected.wait(TIMEOUT)


def test_the_request_timeout_must_be_positive():
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="request_timeout"):
            Router(["http://127.0.0.1:1"], RoundRobin(), request_timeout=bad)


def test_errors_are_relayed_and_do_not_take_a_worker_down():
    a = StubWorker("a")
    with running_server(a.app) as url_a, \
            running_server(build_router_app([url_a], RoundRobin(), 3600)) as router:
        for status in (400, 404, 500, 502):
            a.fail_with = status
            r = httpx.post(f"{router}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
            assert r.status_code == status and r.json()["error"]["code"] == status, r.text
        a.fail_with = None
        assert complete_stub(router) == "a"
        [worker] = httpx.get(f"{router}/workers", timeout=TIMEOUT).json()
        assert worker["up"] and worker["in_flight"] == 0
        m = metrics(router)
        assert m["llmjax:router_worker_failures_total"] == 0 and m["llmjax:router_requests_total"] == 5
        r = httpx.get(f"{router}/no-such-route", timeout=TIMEOUT)  # the router's own errors: OpenAI's shape
        assert r.status_code == 404 and r.json()["error"]["code"] == 404


class ChatStub:
    """A worker without a model that answers every chat completion with `answer` (streamed in
    pieces when asked) and counts the requests it served."""

    def __init__(self, answer: str):
        self.answer, self.served = answer, 0
        self.app = FastAPI()
        self.app.add_api_route("/health", lambda: Response(status_code=200))
        self.app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])

    async def chat(self, request: Request):
        self.served += 1
        if not (await request.json()).get("stream"):
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": self.answer}}]}
        pieces = [self.answer[i:i + 7] for i in range(0, len(self.answer), 7)]
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  *({"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces),
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return StreamingResponse(iter([body]), media_type="text/event-stream")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_conversations_next_turn_follows_the_worker_that_holds_its_answer(stream):
    """The answer is far longer than the prompt: matched on the prompt alone, turn 2 would fall under
    the threshold and go to the idle worker with an empty tree; the router remembers the relayed
    answer after the prompt, so turn 2 matches all but its new question."""
    answer = "A long answer, sentence after sentence. " * 20
    a, b = ChatStub(answer), ChatStub(answer)
    policy = CacheAware()
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
    with running_server(a.app) as url_a, running_server(b.app) as url_b, \
            running_server(build_router_app([url_a, url_b], policy, 3600)) as router:
        first = httpx.post(f"{router}/v1/chat/completions", json={"messages": turn1, "stream": stream},
                           timeout=TIMEOUT).headers["x-llmjax-worker"]
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Shorter?"}]
        r = httpx.post(f"{router}/v1/chat/completions", json={"messages": turn2, "stream": stream}, timeout=TIMEOUT)
        assert r.headers["x-llmjax-worker"] == first
    assert (a.served, b.served) in ((2, 0), (0, 2))


def test_the_router_refuses_a_declared_body_over_the_replicas_limit_unread():
    """The replicas' 413 limit holds at the router too, before it buffers and parses the body: the
    worker sees nothing."""
    a = StubWorker("a")
    with running_server(a.app) as url, running_server(build_router_app([url], RoundRobin(), 3600)) as router:
        host, port = router.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {asgi.MAX_REQUEST_BODY_BYTES + 1}\r\n\r\n".encode())  # and no body
            assert conn.recv(4096).startswith(b"HTTP/1.1 413 ")
        assert a.completions == 0
        assert complete_stub(router) == "a" and a.completions == 1


def test_end_to_end_headers_are_relayed_both_ways():
    """The client's `Authorization` (a worker's `--api-key`) and `x-request-id` reach the worker; the
    worker's own response headers reach the client; hop-by-hop ones stay on their connection."""
    seen = {}
    worker = FastAPI()

    async def complete(request: Request):
        seen.update(request.headers, query=request.url.query, cookies=request.headers.getlist("cookie"))
        response = JSONResponse({"choices": [{"text": "ok"}]}, status_code=429, headers={"retry-after": "7"})
        response.raw_headers += [(b"set-cookie", b"a=1"), (b"set-cookie", b"b=2"), (b"x-bytes", b"caf\xe9")]
        return response

    worker.add_api_route("/v1/completions", complete, methods=["POST"])
    worker.add_api_route("/health", lambda: Response(status_code=200))
    with running_server(worker) as url, running_server(build_router_app([url], RoundRobin(), 3600)) as router:
        r = httpx.post(f"{router}/v1/completions?api-version=1&x=%20y", json={"prompt": "x"}, timeout=TIMEOUT,
                       headers=[("Authorization", "Bearer K"), ("x-request-id", "r-1"), ("Connection", "keep-alive"),
                                ("Accept-Encoding", "gzip"), ("Cookie", "c=1"), ("Cookie", "d=2")])
    assert r.status_code == 429 and r.headers["retry-after"] == "7" and r.headers["x-llmjax-worker"] == url
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]  # a repeated header as often as it came
    assert (b"x-bytes", b"caf\xe9") in r.headers.raw and r.headers["x-llmjax-worker"] == url  # its bytes as sent
    assert seen["cookies"] == ["c=1", "d=2"]
    assert seen["accept-encoding"] == "identity"  # the router reads what it relays: nothing compressed
    assert seen["authorization"] == "Bearer K" and seen["x-request-id"] == "r-1"
    assert seen["query"] == "api-version=1&x=%20y"  # the query string as the client sent it
    assert seen["content-type"] == "application/json" and seen["host"] != httpx.URL(router).netloc.decode()


def test_cors_preflights_are_relayed_to_a_worker_that_answers_them():
    """A worker's `--allowed-origins` (`build_app`'s CORSMiddleware) answers a browser's preflight
    through the router as it does without it: allowed origins get their headers, others a 400."""
    a = StubWorker("a")
    a.app.add_middleware(CORSMiddleware, allow_origins=["http://ui.example"], allow_methods=["*"], allow_headers=["*"])
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with running_server(a.app) as url_a, running_server(build_router_app([url_a], RoundRobin(), 3600)) as router:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"):
            direct = httpx.options(f"{url_a}{path}", headers=preflight, timeout=TIMEOUT)
            relayed = httpx.options(f"{router}{path}", headers=preflight, timeout=TIMEOUT)
            assert relayed.status_code == direct.status_code == 200, (path, relayed.text)
            assert relayed.headers["access-control-allow-origin"] == "http://ui.example"
            assert "authorization" in relayed.headers["access-control-allow-headers"]
        refused = httpx.options(f"{router}/v1/completions", headers={**preflight, "Origin": "http://evil.example"},
                                timeout=TIMEOUT)
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://ui.example"},
                       timeout=TIMEOUT)
        assert r.json()["choices"][0]["text"] == "a" and r.headers["access-control-allow-origin"] == "http://ui.example"


def test_tenants_are_routed_apart_and_each_sticks_to_its_worker():
    a, b = StubWorker("a"), StubWorker("b")
    with running_server(a.app) as url_a, running_server(b.app) as url_b, \
            running_server(build_router_app([url_a, url_b], CacheAware(), 3600)) as router:
        def served(salt: str, prompt: str) -> str:
            body = {"prompt": prompt, "cache_salt": salt}
            return httpx.post(f"{router}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["text"]

        system = "You are a helpful assistant with a very long system prompt. " * 4
        first = [served("tenant-1", system + "q0"), served("tenant-2", system + "q0")]
        assert sorted(first) == ["a", "b"]  # the second tenant does not follow the first one's text
        assert [served(t, system + f"q{i}") for i in (1, 2) for t in ("tenant-1", "tenant-2")] == first * 2


def dying_worker(chunks: list[bytes], media_type: str) -> FastAPI:
    """A worker whose completions send `chunks`, then drop the connection before the body's end."""
    app = FastAPI()

    async def body():
        for chunk in chunks:
            yield chunk
        raise RuntimeError("the worker died")  # the server drops the connection mid-body

    app.add_api_route("/health", lambda: Response(status_code=200))
    app.add_api_route("/v1/completions", lambda: StreamingResponse(body(), media_type=media_type), methods=["POST"])
    return app


def relay_through_router(worker: FastAPI, body: dict) -> httpx.Response:
    """POST a completion to `worker` through a router; afterwards the worker is up and idle."""
    with running_server(worker) as url, running_server(build_router_app([url], RoundRobin(), 3600)) as router:
        try:
            return httpx.post(f"{router}/v1/completions", json=body, timeout=TIMEOUT)
        finally:
            wait_for(lambda: httpx.get(f"{router}/workers", timeout=TIMEOUT).json()[0]["in_flight"] == 0)
            assert httpx.get(f"{router}/workers", timeout=TIMEOUT).json()[0]["up"]


FIRST_EVENT = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'


def test_a_worker_that_fails_mid_stream_ends_the_relayed_stream_with_an_error_event():
    """Half an event the worker sent before it died never reaches the client: every event parses."""
    worker = dying_worker([FIRST_EVENT, b'data: {"id": "c", "choi'], "text/event-stream")
    r = relay_through_router(worker, {"prompt": "x", "stream": True})
    events = [e[6:] for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and r.text.endswith("\n\n") and len(events) == 3, r.text
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert "worker failed mid-stream" in json.loads(events[1])["error"]["message"], r.text
    assert events[2] == "[DONE]"


def test_a_worker_that_fails_after_its_done_event_ends_the_stream_as_it_sent_it():
    chunks = [FIRST_EVENT, b"data: [DONE]\n\n"]
    r = relay_through_router(dying_worker(chunks, "text/event-stream"), {"prompt": "x", "stream": True})
    assert r.status_code == 200 and r.content == b"".join(chunks)


def test_a_body_the_worker_cuts_short_reaches_the_client_cut_short():
    """Not a clean 200 with half a JSON body: the client sees the transfer broken, as it would from
    the worker itself."""
    worker = dying_worker([b'{"id": "c", "choices": [{"text": "'], "application/json")
    with running_server(worker) as url, pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)  # direct
    with pytest.raises(httpx.RemoteProtocolError):
        relay_through_router(worker, {"prompt": "x"})


def test_a_client_that_leaves_a_stream_through_the_router_aborts_it_on_the_worker(replicas):
    urls, _ = replicas
    max_tokens = 110  # long enough that only an abort ends it early

    async def leave_after_two_events(router: str) -> str:
        body = {**GREEDY, "prompt": "a long story: ", "max_tokens": max_tokens, "stream": True}
        async with httpx.AsyncClient(base_url=router, timeout=TIMEOUT) as client:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 2:
                        return r.headers["x-llmjax-worker"]  # leaving the block drops the connection
        raise AssertionError("the stream ended before its second event")

    with running_server(build_router_app(urls, RoundRobin(), 3600)) as router:
        before = {u: metrics(u)["llmjax:generation_tokens_total"] for u in urls}
        worker = asyncio.run(leave_after_two_events(router))
        wait_for(lambda: metrics(worker)["llmjax:num_requests_running"] == 0)
        assert metrics(worker)["llmjax:generation_tokens_total"] - before[worker] < max_tokens
        wait_for(lambda: httpx.get(f"{router}/workers", timeout=TIMEOUT).json()[urls.index(worker)]["in_flight"] == 0)

# --- poison requests, a killed replica ----------------------------------------------------------------------------
POISON = [
    # (body or raw bytes, acceptable statuses): bad values must get a 4xx and harm nothing
    ({"prompt": "hi", "max_tokens": 2, "top_k": 2147483648}, {400}),
    ({"prompt": "hi", "max_tokens": 2, "seed": 1099511627776}, {200}),  # valid: a seed above 32 bits
    ({"prompt": "hi", "max_tokens": 2, "seed": 2**64}, {400}),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', {400}),
    ({"prompt": [5, 10**6], "max_tokens": 2}, {400}),
    ({"prompt": "hi", "max_tokens": 10**12}, {400}),
    ({"prompt": "hi", "logprobs": 1000}, {400}),
    ({"prompt": "hi", "n": 10**6}, {400}),
    ({"prompt": "hi", "logit_bias": {"99999999": 5}}, {400}),
    ({"prompt": "hi", "max_tokens": 2, "top_k": 10**6}, {200}),  # valid: above the vocabulary, it filters nothing
    ({"prompt": "hi", "stop": [""]}, {400}),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, {400}),
    (b'{"model": "tiny", "prompt": ', {400}),
]


REFUSED = [  # (path, body) a worker refuses with a 400, each of a shape the router's own parsing must survive
    ("/v1/chat/completions", b'{"model": "tiny", "messages": 5}'),
    *(("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                               b'"text": %s}]}]}' % text) for text in (b"5", b"null")),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 600 + b"1" + b"]" * 600 + b"}"),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi"'),
]


def test_bodies_a_worker_refuses_get_its_own_answer_through_the_router(replicas):
    urls, _ = replicas
    with running_server(build_router_app(urls[:1], CacheAware(), 3600)) as router:
        for path, body in REFUSED:
            direct, relayed = (httpx.post(base + path, content=body, headers={"content-type": "application/json"},
                                          timeout=TIMEOUT) for base in (urls[0], router))
            assert relayed.status_code == direct.status_code == 400, (body[:80], relayed.text)
            assert relayed.json() == direct.json()


def test_poison_requests_through_the_router_leave_every_replica_healthy(replicas):
    urls, _ = replicas
    with running_server(build_router_app(urls, RoundRobin(), 3600)) as router:
        async def one(client: httpx.AsyncClient, body) -> int:
            if isinstance(body, bytes):
                r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            else:
                r = await client.post("/v1/completions", json={"model": MODEL, **body})
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
            return r.status_code

        async def run():
            async with httpx.AsyncClient(base_url=router, timeout=TIMEOUT) as client:
                jobs = [POISON[i % len(POISON)] for i in range(100)]
                statuses = await asyncio.gather(*(one(client, body) for body, _ in jobs))
                return list(zip(jobs, statuses))

        for (body, allowed), status in asyncio.run(run()):
            assert status in allowed, (body, status)
        for url in urls:
            for path in ("/health", "/debug/kv_invariants"):
                assert httpx.get(url + path, timeout=TIMEOUT).status_code == 200, (url, path)
        assert all(w["up"] for w in httpx.get(f"{router}/workers", timeout=TIMEOUT).json())
        for i in range(4):  # both replicas still serve
            assert asyncio.run(_one(router, family_prompt(i, 0), stream=i % 2 == 0))[0] == 200


def _children(pid: int) -> list[tuple[int, str, str]]:
    """(pid, state, command line) of the processes whose parent is `pid` (zombies included)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid:
            found.append((int(entry), state, cmdline))
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie that its new parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_replica_exits_when_its_launcher_is_killed_outright():
    """A launcher killed by SIGKILL runs no cleanup: the replica (here a child that called
    `exit_with_parent` as `serve_replica` does) gets SIGTERM from the kernel."""
    child = ("import os, time; from llmjax.serve.cluster import exit_with_parent; "
             "exit_with_parent(os.getppid()); print('ready', flush=True); time.sleep(300)")
    launcher = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
                "print(p.pid, flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        lines = {proc.stdout.readline().strip() for _ in range(2)}
        assert "ready" in lines, lines
        [child_pid] = [int(line) for line in lines if line.isdigit()]
        assert _alive(child_pid)
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not _alive(child_pid), timeout=30)


def test_cluster_restarts_a_killed_replica_and_loses_no_unstarted_request(tmp_path):
    """`llmjax cluster` with two tiny replicas under load: one replica is killed with SIGKILL.
    Every request that had not started streaming succeeds (the router retries it on the other
    replica), the supervisor restarts the killed one (reaped: no zombie), and SIGTERM stops all."""
    base = free_port(3)  # the two replicas' ports, then the router's
    port = base + 2
    cmd = [sys.executable, "-m", "llmjax.cli", "cluster", "tiny-gqa", "--replicas", "2", "--port", str(port),
           "--replica-base-port", str(base), "--served-model-name", MODEL, "--no-warmup", "--block-size", "8",
           "--max-model-len", "128", "--kv-cache-memory", str(4 << 20), "--attention-backend", "xla",
           "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--health-check-interval", "0.5",
           "--health-failure-threshold", "1", "--uvicorn-log-level", "warning"]
    log_path = tmp_path / "cluster.log"
    with open(log_path, "w") as log:  # its own process group, as a service manager starts it
        cluster = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = f"http://127.0.0.1:{port}"

    def workers_up() -> list[bool]:
        try:
            return [w["up"] for w in httpx.get(f"{router}/workers", timeout=10).json()]
        except httpx.TransportError:
            return []

    try:
        wait_for(lambda: workers_up() == [True, True] or cluster.poll() is not None, timeout=600)
        assert cluster.poll() is None, log_path.read_text()
        pids = replica_pids(cluster.pid)
        assert len(pids) == 2, _children(cluster.pid)
        results, killed = [], []  # (stream, status, chunks received, ok)

        async def client_loop(client: httpx.AsyncClient, c: int):
            for i in range(1000):
                if killed and len([r for r in results if r[0] > killed[0]]) >= 12 and workers_up() == [True, True]:
                    return
                results.append((time.monotonic(), *await _attempt(client, family_prompt(c, i), stream=i % 2 == 0)))
                if len(results) == 8 and not killed:
                    os.kill(pids[1], signal.SIGKILL)
                    killed.append(time.monotonic())

        async def run():
            async with httpx.AsyncClient(base_url=router, timeout=TIMEOUT) as client:
                await asyncio.wait_for(asyncio.gather(*(client_loop(client, c) for c in range(4))), 600)

        asyncio.run(run())
        for _, stream, status, chunks, ok in results:
            assert ok or (stream and chunks > 0), (stream, status, chunks)  # only started streams may fail
        assert len([r for r in results if r[0] > killed[0]]) >= 12
        assert "restarted" in log_path.read_text()
        assert len(replica_pids(cluster.pid)) == 2
        assert not [c for c in _children(cluster.pid) if c[1] == "Z"], _children(cluster.pid)  # reaped
    finally:
        os.killpg(cluster.pid, signal.SIGTERM)  # the whole group, as systemd stops a service
        try:
            cluster.wait(60)
        finally:
            if cluster.poll() is None:
                cluster.kill()
    assert not _children(cluster.pid)
    log = log_path.read_text()
    assert cluster.returncode == 0, log  # stopped on purpose
    assert log.count("restarted (pid") == 1, log  # the killed replica; none while the group stopped
    assert "Traceback" not in log, log


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_stops_on_ctrl_c_or_sigterm_without_a_traceback(stop):
    """Ctrl-C (SIGINT to the process group) or SIGTERM (systemd's, Kubernetes') stops `llmjax serve`
    with status 0, as uvicorn's own command does on Ctrl-C; the status the cluster's supervisor reads
    as a replica stopped on purpose."""
    port = free_port()
    cmd = [sys.executable, "-m", "llmjax.cli", "serve", "tiny-gqa", "--port", str(port), "--no-warmup",
           "--max-model-len", "128", "--kv-cache-memory", str(2 << 20), "--attention-backend", "xla"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        def up() -> bool:
            assert server.poll() is None, server.stdout.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, timeout=300)
        os.killpg(server.pid, stop)
        output, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0 and "Traceback" not in output, output


@pytest.mark.parametrize("status, restarted", [(1, True), (-signal.SIGKILL, True), (0, False),
                                               (-signal.SIGTERM, False), (-signal.SIGINT, False)])
def test_the_supervisor_restarts_a_replica_that_died_not_one_that_was_stopped(monkeypatch, status, restarted):
    from llmjax.serve.cluster import Replica, Supervisor

    class Exited:
        exitcode, pid = status, 0

        def is_alive(self) -> bool:
            return False

        def join(self, timeout=None) -> None:
            pass

    starts = []
    monkeypatch.setattr(Replica, "start", lambda self: starts.append(self))
    replica = Replica(argparse.Namespace(), 1)
    replica.proc, replica.backoff = Exited(), 0.0
    supervisor = Supervisor([replica])
    supervisor._check(replica)  # reaps it
    supervisor._check(replica)  # its restart is due at once (no backoff)
    assert starts == ([replica] if restarted else [])


async def _attempt(client: httpx.AsyncClient, prompt: str, stream: bool) -> tuple[bool, int, int, bool]:
    """(stream, status, data chunks received, ok: 200 with the full answer) of one completion."""
    body = {**GREEDY, "prompt": prompt, "stream": stream}
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if not stream:
                raw = (await r.aread()).decode()
                ok = r.status_code == 200 and len(json.loads(raw)["choices"][0]["text"]) == 4
                return stream, r.status_code, 0, ok
            text, done, error = "", False, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks += 1
                    event = json.loads(line[6:])
                    error = error or "error" in event
                    text += "".join(c["text"] for c in event.get("choices", []))
            return stream, r.status_code, chunks, r.status_code == 200 and done and not error and len(text) == 4
    except httpx.HTTPError:
        return stream, 0, chunks, False


# --- last: it stops the module's second replica ---------------------------------------------------------------------
def test_stopping_a_replica_mid_run_loses_no_later_request(replicas):
    urls, stacks = replicas
    # A health interval far longer than the test: only the retry before the first byte can save
    # the requests sent to the stopped replica (the health check is tested with stubs below).
    with running_server(build_router_app(urls, CacheAware(), 3600)) as router:
        done, stopped_at = [], []  # (start, status, worker, text); when replica 1 had stopped

        def stop_second_replica_soon():
            while len(done) < 8:
                time.sleep(0.01)
            stacks[1].close()  # graceful: requests it holds finish, then the port closes
            stopped_at.append(time.monotonic())

        def after_stop() -> list[tuple]:
            return [d for d in done if stopped_at and d[0] > stopped_at[0]]

        async def client_loop(client: httpx.AsyncClient, c: int):
            for i in range(200):
                if len(after_stop()) >= 8:
                    return
                start = time.monotonic()
                status, worker, text = await send(client, family_prompt(c % NUM_FAMILIES, i), stream=i % 2 == 0)
                done.append((start, status, worker, text))

        async def run():
            async with httpx.AsyncClient(base_url=router, timeout=TIMEOUT) as client:
                await asyncio.gather(*(client_loop(client, c) for c in range(4)))

        stopper = threading.Thread(target=stop_second_replica_soon)
        stopper.start()
        asyncio.run(run())
        stopper.join()
        assert all(status == 200 and len(text) == 4 for _, status, _, text in done), done
        assert len(after_stop()) >= 8 and all(worker == urls[0] for _, _, worker, _ in after_stop())
        workers = {w["url"]: w for w in httpx.get(f"{router}/workers", timeout=TIMEOUT).json()}
        assert workers[urls[1]]["up"] is False and workers[urls[0]]["in_flight"] == 0
        assert metrics(router)["llmjax:router_worker_failures_total"] >= 1


def test_a_cache_salt_longer_than_a_worker_takes_is_no_routing_key():
    """The worker refuses such a salt (400): the router keeps neither it nor the text in its tree."""
    from llmjax.request import MAX_NAMESPACE_CHARS
    from llmjax.serve.router import _routing_input

    body = {"prompt": "some text", "cache_salt": "t" * (MAX_NAMESPACE_CHARS + 1)}
    assert _routing_input("/v1/completions", json.dumps(body).encode()) == ("", None, body)
    body["cache_salt"] = "t" * MAX_NAMESPACE_CHARS
    assert _routing_input("/v1/completions", json.dumps(body).encode()) == ("some text", body["cache_salt"], body)
