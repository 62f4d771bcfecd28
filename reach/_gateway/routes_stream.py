"""``POST /v1/capabilities/{capability}/stream``: a streaming call as Server-Sent Events.

The options and the body are those of the call route (``routes_call``). The call is made
with ``Client.stream`` and held until its first frame, so that a call that fails before
it (nobody offers the capability, every instance busy, a bad payload) is an HTTP error
with the status of its code, as on the call route. Then the answer is a
``text/event-stream``, one event per chunk as it comes:

    id: 1
    event: chunk          (the chunk's JSON as it came; ``bytes`` and a base64 string
    data: {...}            for a chunk that is not JSON)

then ``event: end`` with ``{"chunks", "agent_id", "request_id"}``, or ``event: error``
with the error object of the gateway's error shape (``chunks`` when the stream broke). A
stream waiting for its next chunk sends a ``: ping`` comment every ``sse_ping`` seconds,
which keeps proxies from cutting it. The HTTP client going away cancels the handler (the
stream is closed, which tells the agent). The call holds one of the gateway's
``StreamSlots`` from before it is sent until the stream ends (none free: 503).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .._client import Stream
from ..errors import ReachError
from .deps import EdgeDeps
from .errors import error_body
from .events import frame
from .inputs import HEADERS, call_options, check_body, check_capability
from .settings import Scope
from .streams import Slot

__all__ = ["PATH", "router"]

PATH = "/v1/capabilities/{capability}/stream"
_WANTED = frozenset({"content-type", *HEADERS.values()})
_json = msgspec.json.Decoder()


def router(deps: EdgeDeps) -> APIRouter:
    api = APIRouter(tags=["capabilities"])

    @api.post(
        PATH,
        dependencies=[deps.guard(Scope.CALL)],
        summary="Call a capability that streams its answer: Server-Sent Events per chunk",
        response_class=StreamingResponse,
        responses={
            200: {"content": {"text/event-stream": {}}},
            400: {"description": "invalid capability name, option or payload"},
            404: {"description": "capability_not_found"},
            429: {"description": "resource_exhausted"},
            503: {
                "description": "agent_unavailable, circuit_open, or too many streams open"
                " (REACH_GATEWAY_MAX_STREAMS): resource_exhausted with Retry-After"
            },
            504: {"description": "timeout before the first chunk"},
        },
    )
    async def stream_capability(capability: str, request: Request) -> StreamingResponse:
        """Options as for ``POST /v1/capabilities/{capability}`` (query or ``X-Reach-*``
        headers); ``timeout`` bounds the wait for the first chunk and for each next one.
        Needs the `call` scope when tokens are configured."""
        name = check_capability(capability)
        headers = {k: v for k, v in request.headers.items() if k in _WANTED}
        opts = call_options(dict(request.query_params), headers, deps.settings.max_timeout)
        body = await request.body()
        check_body(body, headers.get("content-type", ""))
        # the slot is held from here: requests waiting for their first chunk count too
        slot = deps.streams.take()
        try:
            stream = deps.client.stream(
                name, body, timeout=deps.timeout(opts.timeout), response_type=bytes, **opts.routed()
            )
            await stream.__aenter__()  # its first frame: an error before it is an HTTP error
        except BaseException:
            slot.release()
            raise
        return StreamingResponse(
            _events(stream, deps.settings.sse_ping, slot),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return api


async def _events(stream: Stream, ping: float, slot: Slot) -> AsyncIterator[bytes]:
    """The chunks as events; the stream closed and its slot given back however this ends
    (the HTTP client gone included: the agent is told to stop)."""
    chunks = aiter(stream)
    waiting: asyncio.Task[bytes] | None = None
    try:
        with slot:
            while True:
                if waiting is None:
                    waiting = asyncio.ensure_future(anext(chunks))
                done, _ = await asyncio.wait({waiting}, timeout=ping)
                if not done:
                    yield b": ping\n\n"
                    continue
                got, waiting = waiting, None
                try:
                    chunk = got.result()
                except StopAsyncIteration:
                    end = {
                        "chunks": stream.chunks,
                        "agent_id": stream.agent_id,
                        "request_id": stream.request_id,
                    }
                    yield frame("end", end)
                    return
                except ReachError as exc:
                    yield frame("error", error_body(exc))
                    return
                yield _chunk(chunk, stream.chunks)
    finally:
        if waiting is not None:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, ReachError):
                await waiting
        await stream.aclose()


def _chunk(data: bytes, n: int) -> bytes:
    """A chunk's event: its JSON as it came when it is JSON (one line, as SSE needs:
    re-encoded when it spans lines), else base64."""
    try:
        value: Any = _json.decode(data) if data else None
    except msgspec.DecodeError:
        return frame("bytes", base64.b64encode(data).decode(), n)
    if b"\n" in data or b"\r" in data or not data:
        return frame("chunk", value, n)
    return b"id: %d\nevent: chunk\ndata: %s\n\n" % (n, data)
