"""Reach errors as HTTP answers: one status per error code, one JSON shape for all.

    {"error": {"code": "capability_not_found", "message": "...", "retryable": false,
               "capability": "text.translate", ...}}

Only fields that carry something are present. An application's own code (a handler's
``RemoteError`` subclass) passes through in ``code`` with status 502: the gateway reached
the agent, and the agent refused.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ..errors import (
    AgentUnavailable,
    Cancelled,
    CapabilityNotFound,
    CircuitOpen,
    ConfigurationError,
    ConnectionFailed,
    CorruptRecord,
    DeadLetterNotFound,
    NotStarted,
    PayloadTooLarge,
    ReachError,
    RemoteError,
    RequestTimeout,
    ResourceExhausted,
    StreamBroken,
    TaskNotFound,
    Unauthorized,
)

__all__ = [
    "HTTP_CODES",
    "STATUS_BY_CODE",
    "EdgeError",
    "error_response",
    "http_status",
    "install_error_handlers",
]

#: wire error code -> HTTP status (the README's table is this one)
STATUS_BY_CODE: dict[str, int] = {
    "bad_request": 400,
    # NATS refused the gateway's own user (or an agent refused): no token of the caller's
    # would change that, so not 403, which says the caller's token lacks a scope
    "unauthorized": 502,
    "capability_not_found": 404,
    "task_not_found": 404,
    "dead_letter_not_found": 404,
    "cancelled": 409,
    "resource_exhausted": 429,
    "failed": 502,
    "agent_unavailable": 503,
    "circuit_open": 503,
    "timeout": 504,
    # a started stream cut short (client-side code): the upstream failed mid-answer
    "stream_broken": 502,
    # a stored task record that does not decode: the server's fault, not the caller's
    "corrupt_record": 500,
}
_RETRY_AFTER = frozenset({429, 503})
_json = msgspec.json.Encoder()


class EdgeError(ReachError):
    """An HTTP request refused by the gateway itself (auth, size, shape), before NATS."""

    def __init__(
        self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None
    ) -> None:
        self.status = status
        self.code = code
        self.headers = headers or {}
        super().__init__(message)


def _code(exc: ReachError) -> str:
    """The code an HTTP caller branches on: Reach's, with the two lookups told apart."""
    if isinstance(exc, TaskNotFound):
        return "task_not_found"
    if isinstance(exc, DeadLetterNotFound):
        return "dead_letter_not_found"
    return exc.code


def http_status(exc: ReachError) -> int:
    """The HTTP status for any Reach error."""
    if isinstance(exc, EdgeError):
        return exc.status
    if isinstance(exc, PayloadTooLarge):
        return 413  # by class: a request's payload over max_payload, or a task's record
    if isinstance(exc, ConfigurationError):
        return 400
    if isinstance(exc, ConnectionFailed | NotStarted):
        return 503  # NATS out of reach, or the gateway is shutting down
    if isinstance(exc, RemoteError):
        for cls, status in (
            (RequestTimeout, 504),
            (ResourceExhausted, 429),
            (CapabilityNotFound, 404),
            (AgentUnavailable, 503),
            (CircuitOpen, 503),
            (Unauthorized, 502),
            (Cancelled, 409),
        ):
            if isinstance(exc, cls):
                return status
        return STATUS_BY_CODE.get(exc.code, 502)  # failed and application codes
    if isinstance(exc, CorruptRecord):
        return STATUS_BY_CODE[exc.code]  # a stored record is broken: not the caller's fault
    return 404 if isinstance(exc, TaskNotFound | DeadLetterNotFound) else 500


def error_body(exc: ReachError) -> dict[str, Any]:
    """The ``error`` object: code, message, retryable and the structured fields set."""
    out: dict[str, Any] = {"code": _code(exc), "message": exc.message, "retryable": exc.retryable}
    if isinstance(exc, RemoteError):
        for name in ("capability", "agent_id", "request_id"):
            value = getattr(exc, name)
            if value:
                out[name] = value
        if exc.code not in STATUS_BY_CODE:
            out["application_code"] = True
        if exc.attempts:
            out["attempts"] = [
                {
                    "agent_id": a.agent_id,
                    "outcome": a.outcome,
                    "duration_ms": round(a.duration_ms, 3),  # not 338.9999999999418
                }
                for a in exc.attempts
            ]
    if isinstance(exc, TaskNotFound | CorruptRecord):
        out["task_id"] = exc.task_id
    if isinstance(exc, StreamBroken):
        out["chunks"] = exc.chunks
    return out


def error_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Response:
    headers = dict(headers or {})
    if status in _RETRY_AFTER and "retry-after" not in {k.lower() for k in headers}:
        headers["Retry-After"] = "1"
    return Response(
        _json.encode({"error": body}),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def reach_error_response(exc: ReachError) -> Response:
    headers = exc.headers if isinstance(exc, EdgeError) else None
    return error_response(http_status(exc), error_body(exc), headers)


async def _on_reach_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ReachError)
    return reach_error_response(exc)


async def _on_validation(request: Request, exc: Exception) -> Response:
    """FastAPI's 422, in the gateway's shape: ``fields`` says where and what."""
    assert isinstance(exc, RequestValidationError)
    fields = [
        {
            "loc": [str(p) for p in err.get("loc", ())],
            "message": str(err.get("msg", "")),
            "type": str(err.get("type", "")),
        }
        for err in exc.errors()
    ]
    first = fields[0] if fields else {"loc": [], "message": "invalid"}
    where = ".".join(first["loc"])
    message = f"{where}: {first['message']}" if where else str(first["message"])
    body = {"code": "bad_request", "message": message, "retryable": False, "fields": fields}
    return error_response(422, body)


#: the code of a refusal that carries only an HTTP status
HTTP_CODES = {
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    421: "misdirected_request",
    503: "resource_exhausted",
}


async def _on_http(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path, wrong method) in the same shape."""
    assert isinstance(exc, HTTPException)
    code = HTTP_CODES.get(exc.status_code, "bad_request" if exc.status_code < 500 else "failed")
    body = {"code": code, "message": str(exc.detail), "retryable": exc.status_code in _RETRY_AFTER}
    return error_response(exc.status_code, body, dict(exc.headers or {}))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ReachError, _on_reach_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(HTTPException, _on_http)
