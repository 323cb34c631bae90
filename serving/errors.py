"""OpenAI-style error JSON for every HTTP edge of the project.

Shape (what the OpenAI API and vLLM return):
    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

`install_error_handlers(app)` makes FastAPI answer validation failures, malformed JSON, unknown routes
and `APIError`s in that shape, so no handler has to format errors by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
    """The OpenAI error object for `status`."""
    return {
        "error": {
            "message": message,
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


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` as OpenAI error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None)
