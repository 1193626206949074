"""`llmjax router`: one HTTP process in front of N replicas (`llmjax serve` URLs), same OpenAI API.

`build_router_app(urls, policy)` -> FastAPI app; `app.state.router` is the `Router`.

- `/v1/completions`, `/v1/chat/completions`: the policy (`llmjax/serve/routing.py`) picks a worker
  from the request's tenant (`cache_salt`) and text (`request_text(body)`). Parts of another
  shape count as "" (a body that is no JSON at all: no text, no tenant) and the request is
  relayed all the same: the worker's own answer (a 400) reaches the client. The worker's response
  is relayed as it arrives, chunk by chunk (an SSE stream event by event), with its status code
  and headers; the header `x-llmjax-worker` names the worker. Workers are asked for uncompressed
  bodies (the router reads them). A body over the replicas' limit (64 MiB) gets a 413 unread.
- `/v1/models`, `/v1/models/{model}`, `/tokenize`, `/detokenize`: relayed to the least-loaded healthy worker, and so are
  CORS preflights (`OPTIONS`) of every relayed path: the workers' `--allowed-origins` answers them,
  as it answers them without the router.
- Failures: when a worker fails before the first byte of its response body (no connection, a
  dropped connection, a 503), the request goes to another healthy worker (each worker tried at
  most once). None left: the last 503 a worker answered is relayed as it came (status, body,
  headers such as `Retry-After`, plus `x-llmjax-worker`), or, when no worker answered, the
  router's own 503. Any other answer, 4xx or 5xx included, is relayed to the client as it is.
  Only a connection that cannot be made (refused, or not accepted within the connect timeout)
  takes the worker down at once; an answer, even a 503 or a 500,
  never does (its `/health` decides), and neither does a dropped connection (a keep-alive
  connection the worker closed as it was reused looks the same). A worker that fails later ends
  the relayed body: an SSE stream loses the incomplete event and gets an OpenAI error event and
  `[DONE]` (nothing more once the worker's `[DONE]` has been relayed); any other body is cut
  short (the client's connection is dropped). A client that disconnects first closes the
  worker's response, so the worker aborts the request.
- Timeout (`request_timeout`, `--request-timeout`): a worker may stay silent that long, waiting
  for its response headers or for the next chunk of its body (each wait on its own: a long
  generation that keeps streaming is never cut). On expiry the worker's connection is closed and
  its load released; before the first byte of the body the client gets a 504 (the request is not
  retried: the worker may still be computing, and a retry would double the wait), later the
  relay ends as for a failure (an SSE stream with an error event of code 504 and `[DONE]`).
  sglang-router's `--request-timeout-secs` bounds the whole request instead. Once a worker is
  marked down (below), a body it is relaying that then gets nothing for `health_check_timeout`
  seconds ends as for a failure (a frozen worker's streams end then, not after the timeout); a
  request still waiting for its first byte keeps `request_timeout` (a non-streamed one is silent
  until its completion is whole, and a busy worker may still finish it).
- One client request is one routing decision in the statistics: the decision of its last
  attempt (the worker that served it, or the last one tried). The policy's record of a decision
  (`cache_aware`: the key in the worker's tree) is retracted when that worker does not serve the
  request (it failed, timed out, or the client left first) or answers it with an error status (a
  400 computed nothing): only a worker whose success is relayed keeps the key. When a success
  has been relayed whole, the policy also remembers each answer after its prompt
  (`followup_text`: the text a conversation's next turn starts with), read from the relayed body
  (at most `MAX_REMEMBERED_BODY` bytes of it: a longer body is relayed, not remembered).
- Health: every `health_check_interval` seconds each worker's `/health` is fetched. A worker goes
  down after `health_failure_threshold` failed checks in a row (a busy replica may answer late; a
  request that cannot reach it takes it down at once) and is back on the first 200. A down worker
  gets no requests and the policy forgets its tree. The router's own `/health` is 200 while any
  worker is up.
- `/metrics` (Prometheus): `llmjax:router_requests_total{worker}` (requests sent, retries
  included), `llmjax:router_decisions_total{policy,reason}` (one per routed request a worker
  was chosen for), `llmjax:router_worker_failures_total` (attempts that failed or timed out
  before the first byte), `llmjax:router_failed_requests_total` (no worker could take it, or one
  timed out before the first byte), gauges `llmjax:router_requests_in_flight{worker}` and
  `llmjax:router_worker_up{worker}`.
  `/workers` lists the same per worker as JSON.

Threads: everything (handlers, the health task, the policy, the worker table) runs on the app's
event loop, so nothing is locked; the policy is not thread-safe and must stay there.

The workers are reached through one aiohttp session, made when the app starts (C parsers; a pool
that finds a free connection without scanning all of them). What relaying costs, against the
replica direct: `experiments/router_overhead.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Callable

import aiohttp
from fastapi import FastAPI, Request
from multidict import CIMultiDict
from starlette.requests import ClientDisconnect
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from llmjax.request import MAX_NAMESPACE_CHARS
from llmjax.serve import routing
from llmjax.serve.asgi import GRACEFUL_SHUTDOWN_S, LimitRequestBody, error_response, install_error_handlers, \
    wait_for_disconnect
from llmjax.serve.protocol import error_body

log = logging.getLogger(__name__)
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_REMEMBERED_BODY = 4 << 20  # bytes of a relayed response kept to read its answers from
RELAYED_PATHS = (("GET", "/v1/models"), ("GET", "/v1/models/{model:path}"), ("POST", "/tokenize"),
                 ("POST", "/detokenize"))


def request_text(body: Any, chat: bool) -> str:
    """The text a request is matched on: the chat messages concatenated (role, newline, content,
    newline each; the text parts of a content list joined), or the completion prompt: a string as
    is, token ids each followed by a space, several prompts joined by newlines. Never raises, whatever the
    JSON: a part of another shape counts as "" (the worker will refuse it)."""
    if not isinstance(body, dict):
        return ""
    if chat:
        messages = body.get("messages")
        return "".join(f"{_str(m.get('role'))}\n{_content_text(m.get('content'))}\n"
                       for m in (messages if isinstance(messages, list) else []) if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_token_ids(prompt):  # several prompts
        return "\n".join(_prompt_text(p) for p in prompt)
    return _prompt_text(prompt)


def followup_text(body: Any, chat: bool, answer: str) -> str | None:
    """The text the worker's cache holds once it answered `body` with `answer`, as `request_text`
    writes it (so the next turn of a conversation, which repeats the answer, matches all of it):
    the messages and then the assistant's answer, or the one string prompt followed by its
    completion. None where no later request would repeat it: several prompts, token ids, `echo`."""
    if not isinstance(body, dict):
        return None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return request_text({"messages": [*messages, {"role": "assistant", "content": answer}]}, chat=True)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or body.get("echo") is True:
        return None
    return prompt + answer


def answer_texts(body: bytes, sse: bool, chat: bool) -> list[str]:
    """Each choice's whole text in a relayed response body: a JSON completion, or an SSE stream of
    chunks (their deltas joined per choice). [] for a body of another shape; never raises."""
    try:
        if not sse:
            texts = [c["message"]["content"] if chat else c["text"] for c in json.loads(body)["choices"]]
            return [t for t in texts if isinstance(t, str)]
        events = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: {")]  # not [DONE]
        pieces: dict[int, list[str]] = {}
        for chunk in json.loads(b"[" + b",".join(events) + b"]"):  # one call for them all: ~1.5x faster
            for c in chunk.get("choices") or ():
                piece = c.get("delta", {}).get("content") if chat else c.get("text")
                if isinstance(piece, str) and piece:
                    pieces.setdefault(c.get("index", 0), []).append(piece)
        return ["".join(p) for p in pieces.values()]
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return []


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(_str(part.get("text")) for part in content if isinstance(part, dict))
    return _str(content)


def _is_token_ids(prompt: list) -> bool:
    return all(isinstance(t, int) for t in prompt)


def _prompt_text(prompt: Any) -> str:
    """One prompt: a string, or token ids each followed by a space (so the key of ids [1, 2, 3] is no
    prefix of the key of [1, 2, 34])."""
    if isinstance(prompt, list) and _is_token_ids(prompt):
        return "".join(f"{t} " for t in prompt)
    return _str(prompt)


@dataclass
class WorkerState:
    url: str
    up: bool = False
    in_flight: int = 0
    requests: int = 0
    failed_checks: int = 0  # in a row
    problem: str = "not checked yet"


class _WorkerFailed(Exception):
    """The worker failed before the first byte; `down`: it cannot be reached (connection refused);
    `answer`: its 503, to relay when no other worker takes the request."""

    def __init__(self, message: str, down: bool, answer: Response | None = None):
        super().__init__(message)
        self.down, self.answer = down, answer


class _WorkerTimedOut(Exception):
    """The worker sent nothing for `request_timeout` seconds before the first byte of its body."""


class _WorkerWentDown(aiohttp.ClientConnectionError):
    """Set on a relayed body whose worker was marked down and then stayed silent (`_Relay`)."""


def _attempt_error(exc: BaseException, what: str) -> Exception | None:
    """What an exception raised while waiting for a worker's first byte means: `_WorkerTimedOut`,
    `_WorkerFailed`, or None when it is no worker's failure (cancelled: re-raise it as it is)."""
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return _WorkerTimedOut(f"{what}: {exc!r}")
    if isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError)):
        down = isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
        return _WorkerFailed(f"{what} failed: {exc!r}", down)
    return None


# Not relayed either way: hop-by-hop headers (RFC 9110 §7.6.1), the ones each connection sets for
# itself, and accept-encoding (bodies are relayed as they come, never re-encoded).
_NOT_RELAYED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                          "transfer-encoding", "upgrade", "host", "content-length", "date", "server",
                          "accept-encoding"})


def _relayed(headers) -> list[tuple[str, str]]:
    """The end-to-end headers of a client's request (`Authorization`, `Origin`, `x-request-id`, ...),
    a repeated one as often as it came."""
    return [(k, v) for k, v in headers.items() if k.lower() not in _NOT_RELAYED]


def _with_worker_headers(response: Response, upstream: aiohttp.ClientResponse, worker_url: str) -> Response:
    """`response` with the end-to-end headers of the worker's (`retry-after`, CORS headers, ...;
    their bytes as sent, a repeated one as often as it came) and `x-llmjax-worker`."""
    response.raw_headers += [(k, v) for k, v in upstream.raw_headers if k.decode("latin-1").lower() not in _NOT_RELAYED]
    response.raw_headers.append((b"x-llmjax-worker", worker_url.encode()))
    return response


class _Relay(StreamingResponse):
    """Relays a worker's response from its first chunk on; however the relay ends (done, client
    gone, worker failed), it lets go of the worker's response (its connection goes back to the pool
    when the body was read to the end, and is closed otherwise, so the worker sees the client go)
    and calls `on_close`.

    A worker that fails mid-body: an SSE stream (`text/event-stream`) is relayed one complete event
    at a time (each ends with a blank line), so the client never gets half an event; on the failure
    the incomplete event is dropped and, unless the worker's `data: [DONE]` has gone out (then the
    stream just ends), an OpenAI error event and `data: [DONE]` follow. Any other body re-raises the
    failure, so the server drops the connection and the client sees the body cut short, as it would
    from the worker, never a complete-looking answer.

    `on_body`, when set before the response is sent, gets the whole body once it was relayed to
    the end (not for a body cut short, or longer than `MAX_REMEMBERED_BODY`)."""

    def __init__(self, upstream: aiohttp.ClientResponse, first: bytes, rest: AsyncIterator[bytes], worker_url: str,
                 on_close: Callable[[], None], went_down: asyncio.Event, silence: float):
        super().__init__(self._chunks(first, rest), status_code=upstream.status)
        _with_worker_headers(self, upstream, worker_url)
        self.upstream, self.worker_url, self.on_close = upstream, worker_url, on_close
        self.went_down, self.silence = went_down, silence
        self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        self.on_body: Callable[[bytes], None] | None = None
        self._body: list[bytes] = []  # what was relayed, while `on_body` wants it
        self._body_size = 0
        self._whole = False  # relayed to the end

    def _keep(self, chunk: bytes) -> bytes:
        if self.on_body is not None:
            self._body_size += len(chunk)
            if self._body_size > MAX_REMEMBERED_BODY:
                self.on_body, self._body = None, []
            else:
                self._body.append(chunk)
        return chunk

    async def _chunks(self, first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        body = _prepended(first, rest)
        if not self.sse:
            try:
                async for chunk in body:
                    yield self._keep(chunk)
            except aiohttp.ClientError as exc:
                log.warning("worker %s failed mid-response; dropping the client's connection: %r", self.worker_url, exc)
                raise
            self._whole = True
            return
        tail, done = b"", False  # the incomplete event held back; whether `data: [DONE]` has gone out
        try:
            async for chunk in body:
                events, blank, tail = (tail + chunk).rpartition(b"\n\n")
                if blank:
                    done = done or events.rpartition(b"\n")[2] == b"data: [DONE]"
                    yield self._keep(events + blank)
        except aiohttp.ClientError as exc:
            log.warning("worker %s failed mid-stream: %r", self.worker_url, exc)
            if not done:
                timed_out = isinstance(exc, aiohttp.SocketTimeoutError)
                error = error_body(f"worker failed mid-stream: {exc!r}",
                                   "gateway_timeout" if timed_out else "internal_server_error",
                                   code=504 if timed_out else 502)
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        else:
            if tail:  # an unterminated last event: the worker ended there, so relayed as it is
                yield self._keep(tail)
            self._whole = True

    async def _end_if_silent_while_down(self) -> None:
        """While the worker is marked down (`went_down` set), a body that receives nothing for
        `silence` seconds fails as a worker failing mid-body does: a frozen worker's stream ends
        then, not after `request_timeout`. A worker that still sends, or is back up, goes on."""
        content = self.upstream.content
        while True:
            await self.went_down.wait()
            received = content.total_bytes
            await asyncio.sleep(self.silence)
            if self.went_down.is_set() and content.total_bytes == received and not content.at_eof():
                content.set_exception(_WorkerWentDown(f"marked down and silent for {self.silence:g} s"))
                return

    async def __call__(self, scope, receive, send) -> None:
        watchdog = asyncio.ensure_future(self._end_if_silent_while_down())
        try:
            await super().__call__(scope, receive, send)
        finally:
            watchdog.cancel()
            _let_go(self.upstream)
            self.on_close()
            if self._whole and self.on_body is not None:
                self.on_body(b"".join(self._body))


async def _prepended(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`first`, then the chunks of `rest`."""
    yield first
    async for chunk in rest:
        yield chunk


def _let_go(upstream: aiohttp.ClientResponse) -> None:
    """Back to the pool when its body was read to the end; closed (the worker sees a disconnect) otherwise."""
    if upstream.content.at_eof():
        upstream.release()
    else:
        upstream.close()


class _WorkerCollector:
    def __init__(self, workers: dict[str, WorkerState]):
        self.workers = workers

    def collect(self):
        for name, doc, value in (("router_requests_in_flight", "Requests relayed now.", lambda w: w.in_flight),
                                 ("router_worker_up", "1 while the worker passes health checks.", lambda w: w.up)):
            gauge = GaugeMetricFamily("llmjax:" + name, doc, labels=["worker"])
            for w in self.workers.values():
                gauge.add_metric([w.url], float(value(w)))
            yield gauge


class Router:
    """The worker table, the policy, the HTTP client and the health task (module docstring)."""

    def __init__(self, urls: list[str], policy: routing.RoutingPolicy,
                 health_check_interval: float = routing.DEFAULT_HEALTH_CHECK_INTERVAL,
                 health_check_timeout: float = routing.DEFAULT_HEALTH_CHECK_TIMEOUT,
                 health_failure_threshold: int = routing.DEFAULT_HEALTH_FAILURE_THRESHOLD,
                 request_timeout: float = routing.DEFAULT_REQUEST_TIMEOUT):
        if not urls:
            raise ValueError("the router needs at least one worker URL")
        if not 0 < request_timeout < math.inf:
            raise ValueError(f"request_timeout must be a positive number of seconds, got {request_timeout}")
        self.workers = {u.rstrip("/"): WorkerState(u.rstrip("/")) for u in urls}
        # set while a worker is marked down: a body it relays ends once silent (`_Relay`)
        self._went_down = {url: asyncio.Event() for url in self.workers}
        self.policy = policy
        self.health_check_interval = health_check_interval
        self.health_check_timeout = health_check_timeout
        self.health_failure_threshold = health_failure_threshold
        self.request_timeout = request_timeout
        self.session: aiohttp.ClientSession | None = None  # made by `start`, on the app's event loop
        self._health_task: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_WorkerCollector(self.workers))
        self.requests = Counter("llmjax:router_requests", "Requests sent to each worker (retries included).",
                                ["worker"], registry=self.registry)
        self.decisions = Counter("llmjax:router_decisions", "Routed requests a worker was chosen for, by policy "
                                 "and the reason of the decision that settled them.",
                                 ["policy", "reason"], registry=self.registry)
        self.worker_failures = Counter("llmjax:router_worker_failures", "Attempts that failed or timed out before "
                                       "the first byte.", registry=self.registry)
        self.failed = Counter("llmjax:router_failed_requests", "Requests no worker could take, or one timed out "
                              "before the first byte.",
                              registry=self.registry)

    # --- health ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the session, check every worker once, then keep checking in the background."""
        # Idle connections are dropped before the replicas' keep-alive (`--timeout-keep-alive`, 5 s by
        # default) closes them under us; a request that fails before its first byte is retried anyway.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(
            total=None, connect=self.health_check_timeout, sock_read=self.request_timeout))
        await self.check_all()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.session is not None:
            await self.session.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval)
            try:
                await self.check_all()
            except Exception:  # `_check` catches a worker's failures: this is the router's own bug
                log.exception("health check failed; checking again in %g s", self.health_check_interval)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers.values()))

    async def _check(self, worker: WorkerState) -> None:
        try:
            async with self.session.get(f"{worker.url}/health",
                                        timeout=aiohttp.ClientTimeout(total=self.health_check_timeout)) as r:
                problem = "" if r.status == 200 else \
                    f"/health {r.status}: {(await r.read())[:200].decode('utf-8', 'replace')}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            problem = f"/health failed: {exc!r}"
        except Exception as exc:  # whatever a worker answers, it is a failed check, never the loop's end
            problem = f"/health failed: {exc!r}"
        if not problem:
            if not worker.up:
                log.info("worker %s is up", worker.url)
            worker.up, worker.problem, worker.failed_checks = True, "", 0
            self._went_down[worker.url].clear()
            return
        worker.failed_checks += 1
        if worker.failed_checks >= self.health_failure_threshold or not worker.up:
            self._mark_down(worker, problem)

    def _mark_down(self, worker: WorkerState, problem: str) -> None:
        if worker.up:
            log.warning("worker %s is down: %s", worker.url, problem)
            self.policy.forget(worker.url)
        worker.up, worker.problem = False, problem
        self._went_down[worker.url].set()

    # --- relaying -------------------------------------------------------------------------------------
    def loads(self, exclude: set[str] = frozenset()) -> dict[str, int]:
        """Requests in flight on each up worker not in `exclude`, in the configured order."""
        return {u: w.in_flight for u, w in self.workers.items() if w.up and u not in exclude}

    def _release(self, worker: WorkerState) -> None:
        worker.in_flight -= 1

    async def relay(self, request: Request, path: str, routed: bool) -> Response:
        """Relay one request: to the policy's choice (`routed`) or the least-loaded worker, then to
        the others in turn while they fail before the first byte. A routed request counts one
        decision, its last one; every decision whose worker did not serve it, or answered it with
        an error status, is retracted."""
        try:
            body = await request.body()
        except ClientDisconnect:  # the client left while sending its body: nothing to relay
            return Response(status_code=499)
        text, tenant, payload = _routing_input(path, body) if routed else ("", None, None)
        tried: set[str] = set()
        decision: routing.Decision | None = None
        refusal: Response | None = None  # the last 503 a worker answered
        try:
            while loads := self.loads(exclude=tried):
                if routed:
                    decision = self.policy.select(text, loads, tenant)
                    url = decision.worker
                else:
                    url = min(loads, key=loads.__getitem__)
                tried.add(url)
                try:
                    return await self._attempt(request, self.workers[url], decision, path, body, payload, tenant)
                except _WorkerFailed as exc:
                    log.warning("worker %s failed before the first byte: %s", url, exc)
                    if exc.down:
                        self._mark_down(self.workers[url], str(exc))
                    self.worker_failures.inc()
                    if exc.answer is not None:
                        refusal = exc.answer
            self.failed.inc()
            if refusal is not None:
                return refusal
            return error_response(503, "no healthy worker can take the request")
        finally:
            if decision is not None:
                self.decisions.labels(self.policy.name, decision.reason).inc()

    async def _attempt(self, request: Request, worker: WorkerState, decision: routing.Decision | None, path: str,
                       body: bytes, payload: Any = None, tenant: str | None = None) -> Response:
        """One attempt on `worker`: the relay of its response, a 504 when it timed out, a 499 when
        the client left first; `_WorkerFailed` when it failed before the first byte. Unless its
        response is relayed (the relay releases it when it ends), the worker's load is released
        here; unless it is relayed with a success status, `decision` is retracted. A success the
        policy recorded a key for (`payload`: the parsed body) has its answers remembered once
        relayed whole."""
        worker.in_flight += 1
        worker.requests += 1
        self.requests.labels(worker.url).inc()
        relay: Response | None = None
        try:
            relay = await self._open(request, worker, path, body)
        except _WorkerTimedOut as exc:
            log.warning("worker %s timed out before the first byte: %s", worker.url, exc)
            self.worker_failures.inc()
            self.failed.inc()
            message = f"worker {worker.url} sent nothing for {self.request_timeout:g} s"
            return error_response(504, message, type_="gateway_timeout")
        finally:
            if relay is None:
                self._release(worker)
            if decision is not None and (relay is None or relay.status_code >= 400):
                self.policy.retract(decision)  # the worker computed nothing of this prompt to reuse
        if relay is None:
            return Response(status_code=499)
        if decision is not None and decision.insertion is not None and relay.status_code < 400:
            chat = path.endswith("/chat/completions")
            relay.on_body = lambda whole: self._remember_answers(worker.url, payload, chat, tenant, whole, relay.sse)
        return relay

    def _remember_answers(self, url: str, payload: Any, chat: bool, tenant: str | None, body: bytes,
                          sse: bool) -> None:
        """Tell the policy what the worker's cache holds after serving the request: each answer
        after its prompt (`followup_text`)."""
        for answer in answer_texts(body, sse, chat):
            text = followup_text(payload, chat, answer)
            if text:
                self.policy.remember(url, text, tenant)

    async def _open(self, request: Request, worker: WorkerState, path: str, body: bytes) -> Response | None:
        """Send the request to `worker` and wait for the first byte of its body; the relay of the
        response, or None when the client left first. Nothing relayed yet: `_WorkerFailed` when
        the worker cannot be reached, drops the connection or answers 503, `_WorkerTimedOut` when
        it sends nothing for `request_timeout` seconds."""
        # identity: the router reads the bodies it relays (SSE events, answers to remember)
        headers = CIMultiDict([*_relayed(request.headers), ("accept-encoding", "identity")])
        headers.setdefault("content-type", "application/json")
        target = f"{path}?{request.url.query}" if request.url.query else path  # the query string as sent
        opening = asyncio.ensure_future(self._first_byte(request.method, worker.url, target, body, headers))
        watch = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({opening, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not opening.done():
                return None
            upstream, first, rest = opening.result()
            return _Relay(upstream, first, rest, worker.url, lambda: self._release(worker),
                          self._went_down[worker.url], self.health_check_timeout)
        finally:
            watch.cancel()
            if not opening.done():
                opening.cancel()
                await asyncio.wait({opening})  # it closes its response

    async def _first_byte(self, method: str, worker_url: str, path: str, body: bytes, headers: CIMultiDict):
        """(response, its first chunk, the rest); on any failure the response is let go."""
        upstream: aiohttp.ClientResponse | None = None
        try:
            upstream = await self.session.request(method, worker_url + path, data=body, headers=headers)
            if upstream.status == 503:
                answer = _with_worker_headers(Response(await upstream.read(), 503), upstream, worker_url)
                raise _WorkerFailed(f"{path} 503: {answer.body[:200]!r}", down=False, answer=answer)
            rest = upstream.content.iter_any()
            return upstream, await anext(rest, b""), rest
        except BaseException as exc:
            if upstream is not None:
                _let_go(upstream)
            error = _attempt_error(exc, path)
            if error is None:
                raise
            raise error from exc

    # --- the router's own endpoints ---------------------------------------------------------------------
    async def health(self) -> Response:
        if any(w.up for w in self.workers.values()):
            return Response(status_code=200)
        problems = "; ".join(f"{w.url}: {w.problem}" for w in self.workers.values())
        return error_response(503, f"no worker is up ({problems})")

    async def metrics_text(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def worker_list(self) -> list[dict]:
        return [asdict(w) for w in self.workers.values()]


def _routing_input(path: str, body: bytes) -> tuple[str, str | None, Any]:
    """(`request_text`, tenant: a string `cache_salt` or None, the parsed body) of a request body.
    Never raises: a body that is no JSON at all (malformed, not UTF-8, nested too deeply) gives
    ("", None, None), and the worker it goes to answers it (400) as it would without the router; so
    does a `cache_salt` longer than a worker takes (`MAX_NAMESPACE_CHARS`), as ("", None, body)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        payload = None
    tenant = payload.get("cache_salt") if isinstance(payload, dict) else None
    if isinstance(tenant, str) and len(tenant) > MAX_NAMESPACE_CHARS:  # the worker refuses it: nothing to match
        return "", None, payload
    return (request_text(payload, path.endswith("/chat/completions")), tenant if isinstance(tenant, str) else None,
            payload)


def build_router_app(urls: list[str], policy: routing.RoutingPolicy,
                     health_check_interval: float = routing.DEFAULT_HEALTH_CHECK_INTERVAL,
                     health_check_timeout: float = routing.DEFAULT_HEALTH_CHECK_TIMEOUT,
                     health_failure_threshold: int = routing.DEFAULT_HEALTH_FAILURE_THRESHOLD,
                     request_timeout: float = routing.DEFAULT_REQUEST_TIMEOUT) -> FastAPI:
    """The router app (`Router`'s arguments); its lifespan checks the workers once, then runs the
    health task."""
    router = Router(urls, policy, health_check_interval, health_check_timeout, health_failure_threshold,
                    request_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="llmjax router", lifespan=lifespan)
    app.state.router = router
    for path in ROUTED_PATHS:
        app.add_api_route(path, _handler(router, path, routed=True), methods=["POST"])
    for method, path in RELAYED_PATHS:
        app.add_api_route(path, _handler(router, path, routed=False), methods=[method])
    for path in (*ROUTED_PATHS, *(path for _, path in RELAYED_PATHS)):  # CORS preflights
        app.add_api_route(path, _handler(router, path, routed=False), methods=["OPTIONS"])
    app.add_api_route("/health", router.health, methods=["GET"])
    app.add_api_route("/metrics", router.metrics_text, methods=["GET"])
    app.add_api_route("/workers", router.worker_list, methods=["GET"])
    install_error_handlers(app)
    app.add_middleware(LimitRequestBody)  # the replicas' limit, checked before the router buffers a body
    return app


def _handler(router: Router, path: str, routed: bool):
    """The route's handler; a path with parameters (`{model:path}`) is relayed as the client sent it."""
    templated = "{" in path

    async def handle(request: Request) -> Response:
        return await router.relay(request, request.url.path if templated else path, routed)
    return handle


# --- command line ------------------------------------------------------------------------------------------
def serve_router(urls: list[str], args: argparse.Namespace) -> None:
    """Run the router with uvicorn on `args.host:args.port` until Ctrl-C or SIGTERM (flags:
    `routing.add_router_args`, plus `--uvicorn-log-level` and `--timeout-keep-alive`)."""
    import uvicorn

    from llmjax.serve.server import http_url, resolve_api_key, run_until_stopped, warn_if_exposed

    # `llmjax cluster` gives its replicas its own serve flags and environment, the API key with them
    replicas_keyed = hasattr(args, "api_key") and resolve_api_key(args) is not None
    warn_if_exposed(args.host, "with a router that checks no API key: " + (
        "the replicas check it (the router relays Authorization)" if replicas_keyed else
        "give the replicas --api-key (the router relays Authorization)")
        + "; its /workers and /metrics, which name the replicas, are open")
    app = build_router_app(urls, routing.policy_from_args(args), args.health_check_interval,
                           args.health_check_timeout, args.health_failure_threshold, args.request_timeout)
    print(f"routing ({args.policy}) over {len(urls)} workers at {http_url(args.host, args.port)}/v1", flush=True)
    run_until_stopped(uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)))
