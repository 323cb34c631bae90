"""OpenAI-style error JSON for every HTTP edge of the project.

Shape (what the OpenAI API and vLLM return):
    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

`install_error_handlers(app)` makes FastAPI answer validation failures, malformed JSON, unknown routes and
methods, `APIError`s and any unexpected exception (a catch-all ASGI middleware: 500 with a fixed message, the
traceback only in the server's log) in that shape, so no handler has to format errors by hand. Every message
goes through `serving.scrub.scrub_message` (no peer addresses, engine or lease ids); `scrub_error_content` and
`scrub_sse_chunk` do the same to upstream answers a proxy relays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.scrub import scrub_message

log = logging.getLogger("pdcluster.errors")

DRAINING_HEADER = "x-pdcluster-draining"
"""Set ("1") on a node's 503 that refuses a request because the node is draining (shutting down), as opposed to
a busy node's: nothing was computed, and a router that can re-place the request sends it to another instance
(router/admission.py `is_node_draining`) rather than relaying the 503."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout_error",
}


@dataclass
class APIError(Exception):
    """An error the client should see: HTTP status, message naming the bad value, optional param."""

    status: int
    message: str
    param: str | None = None
    type: str | None = None

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict:
    """The OpenAI error object for `status` (the message scrubbed of internal names)."""
    return {
        "error": {
            "message": scrub_message(message),
            "type": type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": status,
        }
    }


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param, type_))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def _error_object(payload: object) -> dict | None:
    """The dict holding the message of an OpenAI (or vLLM flat) error body, None for any other payload."""
    if not isinstance(payload, dict):
        return None
    if isinstance(payload.get("error"), dict):
        return payload["error"]
    return payload if payload.get("object") == "error" else None


def _scrub_in_place(error: dict) -> bool:
    """Scrub `error["message"]`; True when it changed."""
    message = error.get("message")
    if not isinstance(message, str):
        return False
    error["message"] = scrub_message(message)
    return error["message"] is not message


def scrub_error_content(status: int, content: bytes) -> bytes:
    """A relayed upstream error answer, safe for the client (unchanged bytes when nothing needed scrubbing)."""
    if status < 400:
        return content
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        payload = None
    error = _error_object(payload)
    if error is not None:
        return orjson.dumps(payload) if _scrub_in_place(error) else content
    return orjson.dumps(error_body(status, f"the upstream server answered HTTP {status}"))


def scrub_sse_chunk(chunk: bytes) -> bytes:
    """A relayed SSE chunk with the messages of its error events scrubbed (unchanged bytes otherwise)."""
    if b'"error"' not in chunk:
        return chunk
    lines = chunk.split(b"\n")
    changed = False
    for i, line in enumerate(lines):
        if not line.startswith(b"data:") or b'"error"' not in line:
            continue
        try:
            payload = orjson.loads(line[5:].strip())
        except orjson.JSONDecodeError:
            continue
        error = _error_object(payload)
        if error is not None and _scrub_in_place(error):
            lines[i] = b"data: " + orjson.dumps(payload)
            changed = True
    return b"\n".join(lines) if changed else chunk


class CatchAllMiddleware:
    """Pure ASGI: an exception no handler answered becomes a 500 OpenAI error (logged with its traceback here,
    never sent). After the response started nothing can be sent any more: the connection is ended."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_started = False

        async def tracking_send(message: dict) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - the catch-all: every error is OpenAI JSON
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if is_started:
                return
            body = orjson.dumps(error_body(500, "internal server error"))
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})


def install_error_handlers(app: FastAPI, catch_all: bool = True) -> None:
    """Answer every error of `app` as OpenAI error JSON. `catch_all=False`: leave unexpected exceptions to the
    server that calls the app (the router's server has the one catch-all of its process: router/server.py)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = f"{message}: {request.method} {request.url.path[:200]}"
        response = error_response(exc.status_code, message, None)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    if catch_all:
        app.add_middleware(CatchAllMiddleware)
