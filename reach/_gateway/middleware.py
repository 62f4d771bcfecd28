"""One ASGI wrapper around the gateway app: the request guard (``guard``), the body limit
and the HTTP metrics.

The limit holds before anything parses a body: a ``Content-Length`` above it is refused
(413) before the app runs (and the HTTP server never hands over more than a declared
length), and a body without one (chunked) is counted as it arrives, so the 413 comes as
soon as the count passes the limit, whoever is reading. Before answering, the rest of a
refused body is read and dropped, up to ``DRAIN_LIMIT`` bytes, so a client still sending
gets the 413 rather than a reset connection; past that the connection is closed.
"""

from __future__ import annotations

import logging
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import HTTP_CODES, error_response
from .guard import MAX_LENGTH_DIGITS, RequestGuard, Seen
from .metrics import HttpMetrics
from .settings import GatewaySettings

__all__ = ["DRAIN_LIMIT", "EdgeMiddleware"]

DRAIN_LIMIT = 8 * 1024 * 1024

log = logging.getLogger("reach.gateway")


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"the request body is larger than {limit} bytes")


class EdgeMiddleware:
    """``app.add_middleware(EdgeMiddleware, metrics=..., settings=...)``. With
    ``outermost=True`` (a route served around Starlette's stack) it also answers an
    unexpected error with a 500 in the JSON shape, as Starlette's outer layer would."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: HttpMetrics,
        settings: GatewaySettings,
        outermost: bool = False,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = settings.max_body_bytes
        self.guard = RequestGuard(settings)
        self.outermost = outermost

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
            length = self._length(scope)
            if isinstance(length, tuple):
                refusal, declared = length
                drained = declared <= DRAIN_LIMIT and await _drain(receive)
                await _answer(refusal, scope, sending, drained)
                return
            try:
                await self.app(scope, receive if length else self._counting(receive), sending)
            except HTTPException as exc:
                if exc.status_code != 413 or started:
                    raise
                await _answer(exc, scope, sending, await _drain(receive))
            except Exception:
                if not self.outermost:
                    raise
                log.exception("%s %s failed", scope["method"], scope["path"][:200])
                if started:
                    raise
                body = {"code": "failed", "message": "internal error", "retryable": False}
                await error_response(500, body)(scope, receive, sending)
        finally:
            metrics.in_flight -= 1
            route = scope.get("route")
            # a mounted app (A2A, the page) sets no route, but its mount path as root_path
            template = getattr(route, "path", None) or scope.get("root_path") or "unmatched"
            metrics.observe(template, scope["method"], status, time.perf_counter() - start)

    def _length(self, scope: Scope) -> int | tuple[HTTPException, int] | None:
        """The declared body length (None: none declared), or the refusal to send with
        the length declared (the guard's, or the body limit's)."""
        seen = Seen.of(scope)
        length = None
        if seen.length is not None:
            if not seen.length.isdigit() or len(seen.length) > MAX_LENGTH_DIGITS:
                return HTTPException(400, "Content-Length is not a number"), 0
            length = int(seen.length)
        refusal = self.guard.refusal(scope, seen)
        if refusal is not None:
            return refusal, length or 0
        if length is not None and length > self.max_body:
            return _too_large(self.max_body), length
        return length

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


async def _drain(receive: Receive) -> bool:
    """Read and drop the rest of a body: True once it has all come, False past
    ``DRAIN_LIMIT`` bytes or when the client went away."""
    seen = 0
    while seen <= DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return False
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


async def _answer(exc: HTTPException, scope: Scope, send: Send, drained: bool) -> None:
    code = HTTP_CODES.get(exc.status_code, "bad_request")
    response = error_response(
        exc.status_code,
        {"code": code, "message": str(exc.detail), "retryable": False},
        None if drained else {"Connection": "close"},
    )
    await response(scope, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}
