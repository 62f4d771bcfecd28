"""The fleet's contract over HTTP: ``GET /asyncapi.json``, an AsyncAPI 3.0 document of what
the gateway client's routing table holds now. Any valid token may read it."""

from __future__ import annotations

from typing import Annotated

import msgspec
from fastapi import APIRouter, Query, Response

from .._contracts.asyncapi import fleet_document
from .deps import EdgeDeps

__all__ = ["router"]

_encode = msgspec.json.Encoder()


def router(deps: EdgeDeps) -> APIRouter:
    api = APIRouter(tags=["contracts"])
    client = deps.client

    @api.get(
        "/asyncapi.json",
        dependencies=[deps.guard(None)],
        summary="AsyncAPI 3.0 document of the live fleet",
    )
    async def asyncapi(
        capability: Annotated[list[str] | None, Query(max_length=128)] = None,
        tag: Annotated[list[str] | None, Query(max_length=128)] = None,
    ) -> Response:
        """Every capability (request/reply), task capability and topic the fleet serves
        now; ``capability`` (globs) and ``tag`` choose, as ``reach asyncapi`` does."""
        doc = fleet_document(
            await client.agents(),
            subjects=client.subjects,
            url=client.url,
            names=capability or (),
            tags=tag or (),
        )
        return Response(_encode.encode(doc), media_type="application/json")

    return api
