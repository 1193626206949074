"""The router end to end: real uvicorn servers on 127.0.0.1 (`tests/server_helpers.py`).

Two tiny-model replicas behind a cache-aware router: prefix families stick to one replica, and
stopping a replica in the middle of a run loses no later request. Health-check removal and
recovery, and retries on a 503, use stub workers (no model) whose health can be switched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from llmjax.serve.api import build_app
from llmjax.serve.metrics import parse_metrics
from llmjax.serve.router import build_router_app
from llmjax.serve.routing import CacheAware, RoundRobin
from tests.engine_helpers import tiny_engine
from tests.server_helpers import running_server

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
        for path in ("/v1/models", "/health"):
            assert httpx.get(router + path, timeout=TIMEOUT).status_code == 200
        assert httpx.post(f"{router}/tokenize", json={"prompt": "abc"}, timeout=TIMEOUT).json()["count"] >= 3


async def _one(base_url: str, prompt: str, stream: bool):
    async with httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT) as client:
        return await send(client, prompt, stream)


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


class StubWorker:
    """A worker without a model: `/health` and `/v1/completions` answer 200, or 503 when told."""

    def __init__(self, name: str):
        self.healthy = self.serving = True
        self.name = name
        self.app = FastAPI()
        self.app.add_api_route("/health", lambda: Response(status_code=200 if self.healthy else 503))
        self.app.add_api_route("/v1/completions", self.complete, methods=["POST"])

    def complete(self):
        if not self.serving:
            return JSONResponse({"error": {"message": "engine dead"}}, status_code=503)
        return {"choices": [{"text": self.name}]}


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
        assert m["llmjax:router_worker_failures_total"] == 1  # then b is down: no more attempts there
        assert m["llmjax:router_requests_total"] == 5


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
