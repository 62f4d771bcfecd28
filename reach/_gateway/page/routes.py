"""The status page's routes: the page and its three assets, a JSON snapshot, and the live
stream of server-sent events the page follows.

The assets are read once from the package (they ship as package data; no build step) and
served from memory, each with a fixed content type: a name outside the three is a 404, so
no path from the URL ever reaches the file system. The page sets a Content-Security-Policy
that allows only its own script, style and event stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, params
from fastapi.responses import Response, StreamingResponse

from ..._client import Client
from ...errors import ResourceExhausted
from ..errors import error_response
from .feed import StatusFeed
from .hub import frame

__all__ = ["page_routes"]

_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_json = msgspec.json.Encoder()
_RETRY_MS = 2000  # how soon a browser reconnects a stream that ended


def _assets() -> dict[str, bytes]:
    root = resources.files(__package__ or "reach._gateway.page") / "static"
    return {name: (root / name).read_bytes() for name in _TYPES}


def _error(status: int, code: str, message: str, **headers: str) -> Response:
    """An error in the gateway's shape."""
    body = {"code": code, "message": message, "retryable": status == 503}
    return error_response(status, body, headers)


def _refused(exc: ResourceExhausted) -> Response:
    return _error(503, exc.code, exc.message, **{"Retry-After": str(_RETRY_MS // 1000)})


def page_routes(
    client: Client,
    *,
    feed: StatusFeed | None = None,
    dependencies: Sequence[params.Depends] = (),
    **options: Any,
) -> APIRouter:
    """The status page on ``client``'s fleet: ``GET /``, ``GET /static/{name}``,
    ``GET /v1/status`` and ``GET /v1/status/events``.

    Without ``feed``, the router makes one (``options`` go to ``StatusFeed``) and starts
    and closes it in its lifespan. A server that must end the page's streams before it
    waits for open responses (uvicorn does, before the lifespan ends) passes its own feed
    and calls ``feed.shutdown()`` when it begins to stop. ``dependencies`` (auth, say)
    apply to the JSON and the stream, not to the page and its assets, which hold no data.
    """
    own = feed is None
    page_feed = feed if feed is not None else StatusFeed(client, **options)
    assets = _assets()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if own:
            await page_feed.start()
        try:
            yield
        finally:
            if own:
                await page_feed.close()

    router = APIRouter(lifespan=lifespan)
    guarded = list(dependencies)

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return Response(
            assets["index.html"],
            media_type=_TYPES["index.html"],
            headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"},
        )

    @router.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets or name == "index.html":
            return _error(404, "not_found", f"no asset {name!r}")
        return Response(
            assets[name], media_type=_TYPES[name], headers={"Cache-Control": "no-cache"}
        )

    @router.get(
        "/v1/status",
        tags=["status"],
        dependencies=guarded,
        response_class=Response,
        responses={200: {"content": {"application/json": {}}, "description": "the snapshot"}},
    )
    async def status() -> Response:
        """The fleet now: agents and capabilities by status, request and error rates since
        the previous sample, tasks by state, the dead-letter queue's size and newest
        entries (the same JSON as the page's ``snapshot`` events)."""
        return Response(_json.encode(await page_feed.snapshot()), media_type="application/json")

    @router.get("/v1/status/events", tags=["status"], dependencies=guarded)
    async def events() -> Response:
        """Server-sent events: ``snapshot`` (the JSON of ``GET /v1/status``) at once, then
        every few seconds and soon after the table changes; ``agent`` when an agent
        appears, goes (``{"gone": id}``) or changes status. A reader too slow for the
        stream loses its oldest events (a later snapshot makes it whole); 503 when too
        many streams are open."""
        if page_feed.hub.full():
            return _refused(page_feed.hub.refusal())
        return StreamingResponse(
            _stream(page_feed),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return router


async def _stream(feed: StatusFeed) -> AsyncIterator[bytes]:
    # Joined here, not in the route: a generator the server never starts (the client left
    # first) never runs its ``finally``, and its subscriber would stay forever.
    yield f"retry: {_RETRY_MS}\n\n".encode()
    try:
        sub = feed.join()
    except ResourceExhausted as exc:  # lost a race for the last place
        yield frame("error", {"code": exc.code, "message": exc.message})
        return
    try:
        await feed.greet(sub)
        while (data := await sub.next()) is not None:
            yield data
    finally:
        feed.leave(sub)
