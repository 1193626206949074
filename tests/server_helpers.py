"""A real uvicorn server on 127.0.0.1 in a background thread, and checks on it (idle, no KV block
leaked, SSE framing), for tests."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from llmjax.serve.metrics import parse_metrics


@contextlib.contextmanager
def running_server(app: FastAPI, startup_timeout: float = 60.0):
    """Serve `app` on a free port of 127.0.0.1 while the block runs; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


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
    for path in ("/health", "/debug/kv_invariants"):
        r = client.get(path)
        assert r.status_code == 200, r.text


def sse_events(raw: str) -> list[dict]:
    """Parse an SSE body, checking OpenAI's framing: `data: ...` events, the last `[DONE]`."""
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]
