"""``build_app(deps)``: the gateway's FastAPI application (OpenAPI at ``/docs``).

``GET /`` and ``/a2a`` are left to the status page and the A2A endpoint, which are mounted
by passing their routers or apps in ``routers`` and ``mounts``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, cast

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from . import routes_call, routes_contracts, routes_fleet, routes_ops, routes_stream, routes_tasks
from .deps import EdgeDeps
from .errors import install_error_handlers
from .middleware import EdgeMiddleware

__all__ = ["GatewayApp", "Part", "build_app"]

_DESCRIPTION = """\
HTTP in front of an Agent-Reach fleet: call capabilities, submit and follow durable tasks,
read the routing table. Errors are `{"error": {"code", "message", "retryable", ...}}` with
the HTTP status of their code. With tokens configured, send `Authorization: Bearer <token>`.
"""


class GatewayApp(FastAPI):
    """FastAPI, with the hot route's fast path (``routes_call.FastPath``) taken first, as
    long as the app's middleware is the gateway's own: once an embedder adds some (auth,
    CORS, logging), every request goes through it."""

    fast_path: routes_call.FastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_path
        if fast is not None and self._only_ours() and fast.takes(scope):
            await fast(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _only_ours(self) -> bool:
        mine = self.user_middleware
        return len(mine) == 1 and mine[0].cls is cast(Any, EdgeMiddleware)


class Part(Protocol):
    """Background work of a mounted piece (the status page's feed, the A2A endpoint):
    started after the client connects, closed before it closes."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def build_app(
    deps: EdgeDeps,
    *,
    routers: Sequence[APIRouter] = (),
    mounts: Mapping[str, ASGIApp] | None = None,
    parts: Sequence[Part] = (),
    manage_client: bool = False,
) -> FastAPI:
    """The app. ``manage_client``: connect ``deps.client`` at startup and close it at
    shutdown (the CLI); otherwise the caller owns the client's connection. ``parts`` are
    started and closed with the app, in order and in reverse."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_client:
            await deps.client.connect()
        started: list[Part] = []
        try:
            for part in parts:
                await part.start()
                started.append(part)
            yield
        finally:
            for part in reversed(started):
                await part.close()
            deps.detach_metrics()
            if manage_client:
                await deps.client.close()

    app = GatewayApp(
        title="Agent-Reach gateway",
        version=__version__,
        description=_DESCRIPTION,
        docs_url="/docs",
        redoc_url=None,
        lifespan=lifespan,
        # spans per request when a tracer provider is set; metrics are the gateway's own
        telemetry={"metrics": False, "logs": False},
    )
    install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, metrics=deps.metrics, settings=deps.settings)
    deps.attach_metrics()
    call = routes_call.call_route(deps)
    app.fast_path = routes_call.FastPath(call, deps)
    app.router.routes.append(call)
    for part in (routes_stream, routes_tasks, routes_fleet, routes_contracts, routes_ops):
        app.include_router(part.router(deps))
    for extra in routers:
        app.include_router(extra)
    for path, sub in (mounts or {}).items():
        app.mount(path, sub)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, plus the plain-ASGI call route and bearer auth."""
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schema["paths"] = {**routes_call.OPENAPI_PATHS, **schema["paths"]}
            components = schema.setdefault("components", {})
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
