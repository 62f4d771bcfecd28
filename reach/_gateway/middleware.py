"""One ASGI wrapper around the gateway app: the body limit and the HTTP metrics.

The limit holds before anything parses a body: a ``Content-Length`` above it is answered
413 at once, and a body without one (chunked) is counted as it arrives, so the 413 comes
as soon as the count passes the limit, whoever is reading.
"""

from __future__ import annotations

import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response
from .metrics import HttpMetrics

__all__ = ["EdgeMiddleware"]


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"the request body is larger than {limit} bytes")


class EdgeMiddleware:
    """``app.add_middleware(EdgeMiddleware, metrics=..., max_body=...)``."""

    def __init__(self, app: ASGIApp, *, metrics: HttpMetrics, max_body: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        start = time.perf_counter()
        status = 500  # unless a response starts: an exception escaped everything
        started = False

        async def sending(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        metrics.in_flight += 1
        try:
            refusal = self._check_length(scope)
            if refusal is not None:
                await _answer(refusal, scope, sending)
                return
            try:
                await self.app(scope, self._counting(receive), sending)
            except HTTPException as exc:
                if exc.status_code != 413 or started:
                    raise
                await _answer(exc, scope, sending)
        finally:
            metrics.in_flight -= 1
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            metrics.observe(template, scope["method"], status, time.perf_counter() - start)

    def _check_length(self, scope: Scope) -> HTTPException | None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    return HTTPException(400, "Content-Length is not a number")
                if int(value) > self.max_body:
                    return _too_large(self.max_body)
        return None

    def _counting(self, receive: Receive) -> Receive:
        limit = self.max_body
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _too_large(limit)
            return message

        return counted


async def _answer(exc: HTTPException, scope: Scope, send: Send) -> None:
    code = "payload_too_large" if exc.status_code == 413 else "bad_request"
    response = error_response(
        exc.status_code,
        {"code": code, "message": str(exc.detail), "retryable": False},
        {"Connection": "close"},
    )
    await response(scope, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}
