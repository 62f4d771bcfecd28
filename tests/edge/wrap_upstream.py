"""A tiny HTTP service for the wrapper's tests, served by uvicorn in the test's own loop on a
free loopback port. It records every request it gets (method, path, headers, query, body)."""

import asyncio
import contextlib
import gzip
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from reach.testing import eventually


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    query: dict[str, str]
    body: bytes


@dataclass
class Upstream:
    port: int = 0
    healthy: bool = True
    seen: list[Seen] = field(default_factory=list)
    health_probes: int = 0
    #: /hold parks here until released (the fixture releases it at teardown)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def last(self, path: str) -> Seen:
        return [s for s in self.seen if s.path == path][-1]

    def app(self) -> Starlette:
        async def record(request: Request) -> Seen:
            seen = Seen(
                request.method,
                request.url.path,
                dict(request.headers),
                dict(request.query_params),
                await request.body(),
            )
            self.seen.append(seen)
            return seen

        async def echo(request: Request) -> Response:
            seen = await record(request)
            return JSONResponse({"got": json.loads(seen.body) if seen.body else None})

        async def query(request: Request) -> Response:
            return JSONResponse((await record(request)).query)

        async def text(request: Request) -> Response:
            await record(request)
            return PlainTextResponse("plain words")

        async def empty(request: Request) -> Response:
            await record(request)
            return Response(status_code=204)

        async def status(request: Request) -> Response:
            await record(request)
            code = int(request.path_params["code"])
            size = int(request.query_params.get("size", "0"))
            detail = "x" * size if size else f"nope {code}"
            return JSONResponse({"detail": detail}, status_code=code)

        async def hold(request: Request) -> Response:
            await record(request)
            self.held += 1
            await self.release.wait()
            return JSONResponse({"held": True})

        async def big(request: Request) -> Response:
            """``size`` bytes of JSON (a string of x), gzip-encoded with ``gzip=1``."""
            await record(request)
            body = b'"' + b"x" * (int(request.query_params["size"]) - 2) + b'"'
            if request.query_params.get("gzip"):
                zipped = gzip.compress(body)
                headers = {"content-encoding": "gzip"}
                return Response(zipped, media_type="application/json", headers=headers)
            return Response(body, media_type="application/json")

        async def health(request: Request) -> Response:
            self.health_probes += 1
            return PlainTextResponse("ok" if self.healthy else "down", 200 if self.healthy else 503)

        return Starlette(
            routes=[
                Route("/echo", echo, methods=["POST", "PUT"]),
                Route("/query", query, methods=["GET"]),
                Route("/text", text, methods=["POST"]),
                Route("/empty", empty, methods=["POST"]),
                Route("/status/{code:int}", status, methods=["POST"]),
                Route("/hold", hold, methods=["POST"]),
                Route("/big", big, methods=["POST"]),
                Route("/health", health, methods=["GET"]),
            ]
        )


class _Server(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()  # the test process keeps its own signal handling


@contextlib.asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[int]:
    """Serve an ASGI app on a free loopback port (yielded) in this loop, until the block ends."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="off",
        ws="none",
        timeout_graceful_shutdown=2,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started or task.done())
        if task.done():
            task.result()  # it failed to start: say why
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def serve_upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    async with serve_app(up.app()) as port:
        up.port = port
        try:
            yield up
        finally:
            up.release.set()  # held requests end before the server waits for them


@contextlib.asynccontextmanager
async def serve_raw(answer: bytes) -> AsyncIterator[int]:
    """A bare TCP service on a free loopback port (yielded): it reads a request's head,
    writes ``answer`` (maybe a cut-short response, maybe nothing) and hangs up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def spec(*endpoints: dict[str, Any], **agent: Any) -> Any:
    from reach._wrap import build_spec

    return build_spec({"endpoints": list(endpoints), **agent})
