"""HTTP pieces the API server and the router share: OpenAI-shaped errors for everything the
framework itself refuses, the API-key check, and waiting for a client to disconnect.

- `install_error_handlers(app)`: FastAPI's own answers (404 unknown route, 405 wrong method,
  400 unparsable body: not UTF-8, malformed or too deeply nested JSON; request validation errors)
  and any unhandled exception (500, `CatchInternalErrors`) become `{"error": {"message", "type",
  "param", "code"}}`. A field the schema does not know is named in the message and in `param`.
- `RequireAPIKey`: an ASGI middleware; with a key set, every path under `/v1/` and `/debug/` needs
  `Authorization: Bearer <key>` (401 otherwise). `/health`, `/metrics`, `/tokenize`, `/detokenize`
  stay open, as in vLLM.
- `LimitRequestBody`: a body over `MAX_REQUEST_BODY_BYTES` gets a 413.
- `wait_for_disconnect(request)`: returns when the client has gone.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from llmjax.serve.protocol import error_body, validation_message

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 5.0  # on SIGTERM/SIGINT, how long open responses may go on (servers and router)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable"}


class _ASCIIJSONResponse(JSONResponse):
    """JSON escaped to ASCII: an error may quote the client's text, which can hold a lone surrogate
    (no UTF-8 form; the usual rendering would fail and turn a 400 into a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape; its `code` is the HTTP status, as vLLM's are."""
    return _ASCIIJSONResponse(error_body(message, type_ or _TYPES.get(status, "invalid_request_error"), status, param),
                              status_code=status)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json") and \
            any(tuple(e["loc"]) == ("body",) for e in errors):
        # FastAPI read no JSON from such a body: its error would be about the type of the whole body
        return error_response(400, "the request body must be JSON, sent with `Content-Type: application/json` "
                                   f"(got {content_type or 'no Content-Type'})")
    for e in errors:
        if e["type"] == "json_invalid":
            return error_response(400, f"malformed JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    message, param = validation_message([{**e, "loc": e["loc"][1:]} for e in errors])  # the body is the root
    return error_response(400, message, param)


def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    message = str(exc.detail)
    if exc.status_code == 400 and message == "There was an error parsing the body":
        message = "malformed request body: not UTF-8, not JSON, or nested too deeply"
    response = error_response(exc.status_code, message)
    response.headers.update(exc.headers or {})  # e.g. a 405's `Allow`
    return response


class CatchInternalErrors:
    """ASGI middleware: an exception no handler took becomes a 500 OpenAI error (when no response
    has started), and the connection stays usable (Starlette's own 500 handler re-raises, and the
    server then drops the keep-alive connection)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.error("unhandled error", exc_info=exc)
            if started:
                raise
            await error_response(500, f"internal error: {exc!r}")(scope, receive, send)


MAX_REQUEST_BODY_BYTES = 64 << 20  # far above any request a context can hold: 1,000 prompts of 2,048 ids are ~14 MB


class LimitRequestBody:
    """ASGI middleware: a request body over `limit` bytes gets a 413 OpenAI error, refused by its
    declared Content-Length before it is read, or (chunked) once the bytes received pass the limit
    (raised from `receive` as an HTTPException, which the app's handler renders), where the server
    would otherwise buffer and parse a body of any size."""

    def __init__(self, app, limit: int = MAX_REQUEST_BODY_BYTES):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than {self.limit} bytes"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await error_response(413, message)(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            item = await receive()
            if item["type"] == "http.request":
                received += len(item.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, message)
            return item

        await self.app(scope, counting_receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Call before adding other middleware (this one must sit innermost, next to the routes)."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_middleware(CatchInternalErrors)


class RequireAPIKey:
    """ASGI middleware: with `api_key` set, HTTP requests to `/v1/...` and `/debug/...` (which costs the
    engine loop a scan of the KV pool) need `Authorization: Bearer <api_key>` and get a 401 OpenAI
    error otherwise (the key compared in constant time; the scheme's case does not matter, RFC 9110).
    CORS preflights (OPTIONS) carry no key and pass."""

    PROTECTED = ("/v1/", "/debug/")

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.PROTECTED) and scope["method"] != "OPTIONS":
            scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if not (hmac.compare_digest(key.strip(b" "), self.key) and scheme.lower() == b"bearer"):
                body = json.dumps(error_body("invalid or missing API key (send `Authorization: Bearer <key>`)",
                                             "authentication_error", code=401)).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
