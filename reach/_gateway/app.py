"""``build_app(deps)``: the gateway's FastAPI application (OpenAPI at ``/docs``).

``GET /`` and ``/a2a`` are left to the status page and the A2A endpoint, which are mounted
by passing their routers or apps in ``routers`` and ``mounts``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from starlette.types import ASGIApp

from .. import __version__
from . import routes_call, routes_fleet, routes_ops, routes_tasks
from .deps import EdgeDeps
from .errors import install_error_handlers
from .middleware import EdgeMiddleware

__all__ = ["build_app"]

_DESCRIPTION = """\
HTTP in front of an Agent-Reach fleet: call capabilities, submit and follow durable tasks,
read the routing table. Errors are `{"error": {"code", "message", "retryable", ...}}` with
the HTTP status of their code. With tokens configured, send `Authorization: Bearer <token>`.
"""


def build_app(
    deps: EdgeDeps,
    *,
    routers: Sequence[APIRouter] = (),
    mounts: Mapping[str, ASGIApp] | None = None,
    manage_client: bool = False,
) -> FastAPI:
    """The app. ``manage_client``: connect ``deps.client`` at startup and close it at
    shutdown (the CLI); otherwise the caller owns the client's connection."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_client:
            await deps.client.connect()
        try:
            yield
        finally:
            deps.detach_metrics()
            if manage_client:
                await deps.client.close()

    app = FastAPI(
        title="Agent-Reach gateway",
        version=__version__,
        description=_DESCRIPTION,
        docs_url="/docs",
        redoc_url=None,
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, metrics=deps.metrics, max_body=deps.settings.max_body_bytes)
    deps.attach_metrics()
    for part in (routes_call, routes_tasks, routes_fleet, routes_ops):
        app.include_router(part.router(deps))
    for extra in routers:
        app.include_router(extra)
    for path, sub in (mounts or {}).items():
        app.mount(path, sub)
    return app
