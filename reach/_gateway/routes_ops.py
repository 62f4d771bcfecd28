"""``GET /healthz`` (is NATS connected? which process answered?) and ``GET /metrics``
(Prometheus text: the client's telemetry, which carries the gateway's HTTP metrics too).
Both are open, like the ``/metrics`` port of every Reach process: probes and scrapers
carry no token."""

from __future__ import annotations

import os

import msgspec
from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .deps import EdgeDeps

__all__ = ["router"]


def router(deps: EdgeDeps) -> APIRouter:
    api = APIRouter(tags=["operations"])
    client = deps.client

    @api.get("/healthz", summary="200 while connected to NATS, else 503")
    async def healthz() -> Response:
        ok, details = deps.telemetry.health()
        nats = client.connected
        body = {
            "status": "ok" if ok and nats else "unhealthy",
            "nats": nats,
            "pid": os.getpid(),  # which process answered: one of several with --workers
            **details,
        }
        return Response(
            msgspec.json.encode(body), 200 if ok and nats else 503, media_type="application/json"
        )

    @api.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(deps.telemetry.exposition(), media_type=CONTENT_TYPE_LATEST)

    return api
