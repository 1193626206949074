"""`run_server(args)`: one `llmjax serve` process (also each replica of `llmjax cluster`).

Binds its address first (a port in use is an `error:` before the model loads), builds the engine
from the engine flags (`llmjax/engine_args.py`) and the app (`build_app`), refuses to start when the
KV pool cannot hold one `max_model_len` request, warms up, and serves with uvicorn on the bound
socket until stopped. Stopped by SIGINT (Ctrl-C) or SIGTERM, it lets open responses end (for up to
`GRACEFUL_SHUTDOWN_S`, then aborts their requests, so each stream still ends with its final chunk and
`data: [DONE]`) and exits with status 0; if the engine loop dies, the server shuts down and the
process exits with status 1, so a supervisor (`llmjax cluster`, systemd, Kubernetes) restarts it.

API key: `--api-key` or the `LLMJAX_API_KEY` environment variable; without one, binding an
address other than loopback logs a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import signal
import threading
import socket
import sys
from typing import TYPE_CHECKING

from llmjax.cli_types import non_empty, port, positive_seconds

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

KEEP_ALIVE_S = 5.0  # uvicorn's default, as vLLM serves
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def add_address_args(parser: argparse.ArgumentParser, whose: str = "the server's") -> None:
    """`--host` and `--port`, shared by `llmjax serve`, `router` and `cluster` (`whose`: the help's subject)."""
    parser.add_argument("--host", type=non_empty, default="127.0.0.1", help=f"{whose} address (default: %(default)s)")
    parser.add_argument("--port", type=port, default=8000, help=f"{whose} port (default: %(default)s)")


def add_serve_args(parser: argparse.ArgumentParser, address: bool = True) -> None:
    """The flags of one server besides the engine's; `address`: also `--host` and `--port`."""
    if address:
        add_address_args(parser)
    parser.add_argument("--served-model-name", type=non_empty, default=None,
                        help="the name clients send (default: the model's)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the common step shapes before accepting requests")
    parser.add_argument("--api-key", type=non_empty, default=None,
                        help="require `Authorization: Bearer KEY` on /v1/* and /debug/* (default: $LLMJAX_API_KEY, "
                             "else none)")
    parser.add_argument("--allowed-origins", default="",
                        help="comma-separated origins allowed by CORS (default: none)")
    add_http_args(parser)


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """`--uvicorn-log-level` and `--timeout-keep-alive`, shared by `llmjax serve` and `llmjax router`."""
    parser.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    parser.add_argument("--timeout-keep-alive", type=positive_seconds, default=KEEP_ALIVE_S, metavar="S",
                        help="seconds an idle HTTP connection is kept open (default: %(default)s); set it above "
                             "the idle timeout of a proxy or client pool that reuses connections, or their requests "
                             "can fail on a connection closed under them")


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """`--api-key`, else the `LLMJAX_API_KEY` environment variable, else None (no key). SystemExit with
    `error: ...` for a key no client could send in an `Authorization` header (surrounding whitespace,
    such as a file's last newline; a character other than printable ASCII), which would lock every
    client out."""
    key = args.api_key or os.environ.get("LLMJAX_API_KEY") or None
    source = "--api-key" if args.api_key else "LLMJAX_API_KEY"
    if key is not None and (key != key.strip() or not all(" " <= c <= "~" for c in key)):
        raise SystemExit(f"error: {source} has surrounding whitespace or a character other than printable ASCII: "
                         "no client could send it in an Authorization header")
    return key


def http_url(host: str, port: int) -> str:
    """The base URL of a server at `host`:`port` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def warn_if_exposed(host: str, what: str) -> None:
    """Warn on stderr that serving on `host`, an address other than loopback, is `what`."""
    if not is_loopback(host):
        print(f"warning: serving on {host} {what}", file=sys.stderr, flush=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (port 0: any free one), not yet listening, so a client
    that connects before the server accepts is refused rather than kept waiting. SystemExit with
    `error: ...` when the address cannot be bound (in use, not this machine's)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def start_listening(sock: socket.socket, host: str, port: int) -> None:
    """Make the bound `sock` listen, once the server is ready to accept. SystemExit with `error: ...` when
    it cannot: another process bound the port with SO_REUSEADDR while this one was starting (Linux lets
    two such sockets bind one port while neither listens; the first to listen wins, and uvicorn would
    go on serving a socket that never listened)."""
    try:
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc.strerror or exc} (another server "
                         "took the port while this one was starting)") from None


class _Terminated(Exception):
    """SIGTERM, once uvicorn has shut down on it."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


def run_until_stopped(server: uvicorn.Server, **run_kwargs) -> None:
    """`server.run(**run_kwargs)`, returning once it has shut down on SIGINT (Ctrl-C) or SIGTERM. uvicorn
    re-raises the signal it stopped on to the handler it found: SIGINT's is Python's KeyboardInterrupt,
    SIGTERM's is set here (the default one would end the process with status -SIGTERM). Signals reach
    the main thread only: in another thread (tests) uvicorn captures none and this sets none."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
    try:
        server.run(**run_kwargs)
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def serve_app(app: FastAPI, sock: socket.socket, log_level: str = "info",
              timeout_keep_alive: float = KEEP_ALIVE_S) -> int:
    """Serve an app of `build_app` on the bound `sock` (`bind_socket`; closed when it returns) until
    stopped: 0 when stopped (a signal, Ctrl-C), 1 when its engine loop died (the server then stops
    at once). Stopping lets open responses end for up to GRACEFUL_SHUTDOWN_S; requests still going
    shortly before then are aborted (their streams end with finish reason "abort"; a non-streamed
    one gets a 503)."""
    import uvicorn

    from llmjax.serve.asgi import GRACEFUL_SHUTDOWN_S

    async_engine = app.state.server.async_engine

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            """uvicorn's, which cancels the responses still open after the grace period (their clients
            see a cut connection, the log a traceback each); before that (2 s before, time for a slow
            step to end), their requests are aborted instead: each stream ends with finish reason
            "abort" and `data: [DONE]`, a non-streamed request gets a 503 (`ShuttingDownError`)."""
            grace = self.config.timeout_graceful_shutdown
            abort = asyncio.get_running_loop().call_later(grace - min(2.0, grace / 2), async_engine.abort_all)
            try:
                await super().shutdown(sockets)
            finally:
                abort.cancel()

    server = Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                   timeout_keep_alive=timeout_keep_alive))
    async_engine.on_dead = lambda: setattr(server, "should_exit", True)  # uvicorn polls the flag
    try:
        run_until_stopped(server, sockets=[sock])
    finally:
        sock.close()
    if async_engine.error is not None:
        print(f"error: the engine loop died: {async_engine.error!r}", file=sys.stderr, flush=True)
        return 1
    return 0


def run_server(args: argparse.Namespace) -> None:
    """`llmjax serve`: exits with status 1 on a bad configuration, model or file (`error: ...`,
    `exit_on_user_error`) or when the engine loop dies."""
    from llmjax.engine import LLMEngine, freeze_gc_heap
    from llmjax.engine_args import engine_config_from_args, exit_on_user_error
    from llmjax.models.loader import resolve_source
    from llmjax.serve.api import build_app

    api_key = resolve_api_key(args)
    if api_key is None:
        warn_if_exposed(args.host, "without an API key: anyone who can reach it can use it "
                                   "(set --api-key or LLMJAX_API_KEY)")
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    sock = bind_socket(args.host, args.port)
    with exit_on_user_error():
        name = args.served_model_name or resolve_source(args.model).name
        engine = LLMEngine.from_config(args.model, engine_config_from_args(args), seed=args.seed)
        app = build_app(engine, name, api_key, origins)
    if args.warmup:
        engine.warmup()
    freeze_gc_heap()
    start_listening(sock, args.host, args.port)
    print(f"serving {name!r} at {http_url(args.host, sock.getsockname()[1])}/v1", flush=True)
    sys.exit(serve_app(app, sock, args.uvicorn_log_level, args.timeout_keep_alive))
