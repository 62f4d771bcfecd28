"""One request, forwarded: the Reach request becomes an HTTP request (payload, deadline,
ids and trace context as headers) and the HTTP answer becomes a result or a Reach error.

Mapping, decided here once:

- 2xx: a JSON body is the result as it is (not decoded and encoded again); an empty body
  is ``null``; any other body is returned as a JSON string (the text, UTF-8).
- 429, 503: ``resource_exhausted`` (retryable: the caller tries another instance).
- 408, 504: ``timeout``; any other 4xx: ``bad_request``; any other status: ``failed``.
- no answer within the time: ``timeout``.
- the endpoint cannot be reached (connection refused, DNS, connect timeout):
  ``agent_unavailable``, retryable, since nothing was sent.
- the connection broke after the request went out: ``failed``, not retried (the
  endpoint may have acted on it).
- an answer over ``max_body`` bytes (decompressed): ``failed``; reading stops there.

Error messages carry the HTTP status and the first bytes of the answer's body (at most
``SNIPPET_BYTES`` of it are read).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from opentelemetry import propagate

from .._codec import now_ms
from .._handlers import Context
from ..errors import (
    AgentUnavailable,
    BadRequest,
    HandlerFailed,
    RemoteError,
    RequestTimeout,
    ResourceExhausted,
)
from ..wire import Header
from .spec import Endpoint, redact

__all__ = ["SNIPPET", "Forwarder", "HttpHeader", "Throttle", "WrapStats", "outgoing_headers"]

log = logging.getLogger("reach.wrap")

#: characters of an error answer's body quoted in the Reach error message
SNIPPET = 200
#: bytes of an error answer's body read for it (the rest is not read)
SNIPPET_BYTES = 800


class HttpHeader:
    """What the wrapped endpoint receives besides the payload (absent ones are not sent)."""

    REQUEST_ID = "Reach-Request-Id"
    #: when the caller stops waiting (or the endpoint's timeout, if sooner): unix epoch ms
    DEADLINE = "Reach-Deadline"
    #: the same as milliseconds left when the request was sent
    TIMEOUT_MS = "Reach-Timeout-Ms"
    PRIORITY = "Reach-Priority"
    #: 1 on the first attempt; a caller's retry on another instance counts up
    ATTEMPT = "Reach-Attempt"
    #: the caller's ``Reach-Idempotency-Key``, under the name HTTP services know
    IDEMPOTENCY_KEY = "Idempotency-Key"
    TRACEPARENT = "traceparent"
    TRACESTATE = "tracestate"


@dataclass(slots=True)
class WrapStats:
    """What the wrapper saw of its endpoints (the agent counts the Reach side)."""

    forwarded: int = 0
    ok: int = 0
    #: error answers by HTTP status
    http_errors: dict[int, int] = field(default_factory=dict)
    timeouts: int = 0
    unreachable: int = 0
    broken: int = 0
    #: answers over ``max_body`` bytes
    too_large: int = 0


class Throttle:
    """At most one warning per kind every ``every`` seconds: while an upstream is down,
    every request fails alike, and one line a request would flood the log. The warnings
    held back are counted and the next one says how many."""

    def __init__(self, every: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def warn(self, key: tuple[str, str], msg: str, *args: object) -> None:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            msg += f" (and {held} more like it since the last such warning)"
        log.warning(msg, *args)


def outgoing_headers(ep: Endpoint, ctx: Context, budget: float) -> httpx.Headers:
    """The endpoint's own headers, then Reach's: ids, the deadline and the trace context.
    Case-insensitive, so a name is sent once (the spec refuses Reach's names anyway)."""
    headers = httpx.Headers(ep.headers)
    budget_ms = int(budget * 1000)
    deadline = now_ms() + budget_ms
    if ctx.deadline_ms is not None and ctx.deadline_ms <= deadline:
        deadline = ctx.deadline_ms  # the caller's own, exactly
    headers[HttpHeader.DEADLINE] = str(deadline)
    headers[HttpHeader.TIMEOUT_MS] = str(budget_ms)
    headers[HttpHeader.REQUEST_ID] = ctx.request_id
    headers[HttpHeader.PRIORITY] = ctx.priority.value
    headers[HttpHeader.ATTEMPT] = str(ctx.attempt)
    incoming = ctx.headers
    key = incoming.get(Header.IDEMPOTENCY_KEY)
    if key:
        headers[HttpHeader.IDEMPOTENCY_KEY] = key
    for name in (Header.TRACEPARENT, Header.TRACESTATE):
        value = incoming.get(name)
        if value:
            headers[name] = value
    # With a tracer, the handler's span is current: the endpoint continues from it (no span:
    # nothing is written, and the caller's context above goes through unchanged).
    propagate.inject(headers)
    return headers


def _request(
    http: httpx.AsyncClient, ep: Endpoint, payload: bytes, headers: httpx.Headers, budget: float
) -> httpx.Request:
    """The HTTP request; httpx's own timeouts are the budget, so it usually gives up by
    itself, cleanly, before anything has to cancel it."""
    method = ep.method.upper()
    if method == "GET":
        url = httpx.URL(ep.url)
        params = _query(payload)
        if params:
            fixed = sorted(set(params) & set(url.params.keys()))
            if fixed:
                raise BadRequest(f"query parameter {fixed[0]!r} is set by the endpoint's URL")
            url = url.copy_merge_params(params)
        return http.build_request(method, url, headers=headers, timeout=budget)
    if payload:
        headers["Content-Type"] = "application/json"
    return http.build_request(method, ep.url, content=payload, headers=headers, timeout=budget)


def _query(payload: bytes) -> dict[str, Any] | None:
    """A GET's payload: a JSON object of scalars (or lists of them), as query parameters."""
    if not payload:
        return None
    try:
        value = msgspec.json.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid payload: {exc}") from None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("a GET endpoint takes a JSON object of query parameters")
    return {k: _param(v) for k, v in value.items()}


def _param(value: Any) -> Any:
    if isinstance(value, list):
        return [_param(v) for v in value]
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or isinstance(value, str | int | float):
        return "" if value is None else value
    raise BadRequest("query parameters must be scalars or lists of scalars")


async def _read(response: httpx.Response, limit: int) -> bytes | None:
    """The (decompressed) body, or None as soon as it is over ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _head(response: httpx.Response) -> bytes:
    """The first ``SNIPPET_BYTES`` of the body, for an error message."""
    head = b""
    async for chunk in response.aiter_bytes():
        head += chunk
        if len(head) >= SNIPPET_BYTES:
            break
    return head[:SNIPPET_BYTES]


def _snippet(body: bytes) -> str:
    text = body[: SNIPPET * 4].decode("utf-8", "replace")
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET else text[: SNIPPET - 1] + "…"


def error_for(status: int, body: bytes) -> RemoteError:
    """The Reach error for a non-2xx answer (``body``: its first bytes)."""
    snippet = _snippet(body)
    message = f"upstream HTTP {status}" + (f": {snippet}" if snippet else "")
    cls: type[RemoteError]
    if status in (429, 503):
        cls = ResourceExhausted
    elif status in (408, 504):
        cls = RequestTimeout
    elif 400 <= status < 500:
        cls = BadRequest
    else:
        cls = HandlerFailed  # 5xx, and 1xx/3xx (redirects are not followed)
    return cls(message)


def result_of(body: bytes, encoding: str | None) -> Any:
    """A 2xx answer as the capability's result: JSON bytes as they are, else text."""
    if not body:
        return None
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode(encoding or "utf-8", "replace")
    return body


@dataclass(slots=True)
class Forwarder:
    """A wrapper's way out: its pool, its counts and the cap on an answer's size (0: the
    agent connection's ``max_payload``, as a larger result could not be sent anyway)."""

    http: httpx.AsyncClient
    stats: WrapStats
    max_body: int = 0
    warnings: Throttle = field(default_factory=Throttle)

    async def __call__(self, ep: Endpoint, payload: bytes, ctx: Context) -> Any:
        """Serve one request by calling ``ep``; wait at most its timeout, or the caller's
        remaining time if that is shorter."""
        stats = self.stats
        budget = ep.timeout
        remaining = ctx.remaining()
        if remaining is not None:
            if remaining <= 0:
                stats.timeouts += 1
                raise RequestTimeout("no time left to call the upstream")
            budget = min(budget, remaining)
        http = self.http
        limit = self.max_body or ctx.client.nc.max_payload
        request = _request(http, ep, payload, outgoing_headers(ep, ctx, budget), budget)
        stats.forwarded += 1
        try:
            # httpx's timeouts bound each phase (connect, write, each read); this, the whole.
            async with asyncio.timeout(budget):
                response = await http.send(request, stream=True)
                try:
                    code = response.status_code
                    if 200 <= code < 300:
                        body = await _read(response, limit)
                    else:
                        body = await _head(response)
                finally:
                    await response.aclose()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            stats.unreachable += 1
            self.warnings.warn(
                (ep.capability, "unreachable"),
                "wrap %s: %s %s unreachable: %r",
                ep.capability,
                request.method,
                redact(ep.url),
                exc,
            )
            raise AgentUnavailable(f"upstream unreachable ({type(exc).__name__})") from None
        except (TimeoutError, httpx.TimeoutException):
            stats.timeouts += 1
            raise RequestTimeout(f"upstream gave no answer within {budget:.3g}s") from None
        except httpx.HTTPError as exc:
            stats.broken += 1
            self.warnings.warn(
                (ep.capability, "broken"),
                "wrap %s: %s %s failed: %r",
                ep.capability,
                request.method,
                redact(ep.url),
                exc,
            )
            raise HandlerFailed(f"upstream exchange failed ({type(exc).__name__})") from None
        if body is None:
            stats.too_large += 1
            self.warnings.warn(
                (ep.capability, "too_large"),
                "wrap %s: an answer of %s was over max_body (%d bytes)",
                ep.capability,
                redact(ep.url),
                limit,
            )
            raise HandlerFailed(f"upstream answer over {limit} bytes")
        if 200 <= code < 300:
            stats.ok += 1
            return result_of(body, response.encoding)
        stats.http_errors[code] = stats.http_errors.get(code, 0) + 1
        raise error_for(code, body)
