"""The whole edge in one app: the gateway's routes, the status page at ``/`` and the A2A
endpoint under ``/a2a``, with their background work started and stopped with the app.
What ``reach gateway`` serves; an application embedding the edge calls ``build_edge``."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from .a2a import a2a_routes
from .app import build_app
from .deps import EdgeDeps
from .page import StatusFeed, page_routes

__all__ = ["Edge", "build_edge"]


@dataclass
class Edge:
    app: FastAPI
    feed: StatusFeed

    def shutdown(self) -> None:
        """End the open event streams now: a server waits for open responses before the
        app's lifespan ends, so its exit signal calls this first."""
        self.feed.shutdown()


def build_edge(deps: EdgeDeps, *, manage_client: bool = False) -> Edge:
    feed = StatusFeed(deps.client)
    page = page_routes(deps.client, feed=feed, dependencies=[deps.guard(None)])
    settings = deps.settings
    a2a = a2a_routes(
        deps.client,
        settings.public_url or "",
        scopes_of=None if settings.open else deps.auth.scopes_of,
        max_timeout=settings.max_timeout,
        streams=deps.streams,
    )
    app = build_app(deps, routers=[page, a2a], parts=[feed], manage_client=manage_client)
    return Edge(app, feed)
