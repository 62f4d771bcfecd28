"""The routing table over HTTP: ``GET /v1/agents``, ``GET /v1/capabilities`` and the seed's
route query ``POST /v1/route``, all read from the gateway client's live table (no extra
hop to a registry). Any valid token may read them."""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Query, Response
from pydantic import Field

from .._routing import Policy, Weights, explain_miss, rank
from ..errors import AgentUnavailable, CapabilityNotFound, CircuitOpen
from ..wire import AgentRecord, Priority, Status
from .deps import EdgeDeps
from .inputs import Selection, bad

__all__ = ["RouteBody", "capabilities_of", "router"]

_encode = msgspec.json.Encoder()


class RouteBody(Selection):
    """``POST /v1/route``: who should take this capability now?"""

    priority: Priority = Priority.NORMAL
    routing: Policy | None = Field(
        default=None, description="policy of the suggestion (default: the gateway's)"
    )
    limit: int = Field(default=5, ge=1, le=100, description="candidates at most")


def _record_json(rec: AgentRecord) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(rec)
    return out


def capabilities_of(records: list[AgentRecord]) -> list[dict[str, Any]]:
    """Instances grouped by capability (request capabilities and durable task ones apart)."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        info = rec.info
        for kind, caps in (("request", info.capabilities), ("task", info.tasks)):
            for cap in caps:
                group = groups.get((cap.name, kind))
                if group is None:
                    group = groups[(cap.name, kind)] = {
                        "name": cap.name,
                        "kind": kind,
                        "description": cap.description,
                        "versions": set(),
                        "tags": set(),
                        "agents": [],
                        "by_status": Counter(),
                    }
                group["description"] = group["description"] or cap.description
                group["versions"].add(cap.version)
                group["tags"].update(info.tags)
                group["agents"].append(info.agent_id)
                group["by_status"][rec.status.value] += 1
    out = []
    for key in sorted(groups):
        g = groups[key]
        out.append(
            {
                **g,
                "versions": sorted(g["versions"]),
                "tags": sorted(g["tags"]),
                "agents": sorted(g["agents"]),
                "instances": len(g["agents"]),
                "by_status": dict(g["by_status"]),
            }
        )
    return out


def _json(value: Any) -> Response:
    return Response(_encode.encode(value), media_type="application/json")


def router(deps: EdgeDeps) -> APIRouter:
    api = APIRouter(prefix="/v1", tags=["routing table"])
    client = deps.client
    guard = [deps.guard(None)]

    @api.get("/agents", dependencies=guard, summary="Every known instance, by agent id")
    async def list_agents(
        capability: Annotated[str | None, Query(max_length=128)] = None,
        status: Status | None = None,
        tag: Annotated[str | None, Query(max_length=128)] = None,
    ) -> Response:
        records = [
            r
            for r in await client.agents()
            if (
                capability is None
                or any(c.name == capability for c in (*r.info.capabilities, *r.info.tasks))
            )
            and (status is None or r.status is status)
            and (tag is None or tag in r.info.tags)
        ]
        return _json({"agents": [_record_json(r) for r in records]})

    @api.get("/capabilities", dependencies=guard, summary="The routing table by capability")
    async def list_capabilities() -> Response:
        return _json({"capabilities": capabilities_of(await client.agents())})

    @api.post(
        "/route",
        dependencies=guard,
        summary="Ranked candidates with scores, and the instance the next call would take",
    )
    async def route(body: RouteBody) -> Response:
        if body.routing is Policy.DIRECT:
            raise bad("routing 'direct' needs an agent id, which a route query does not name")
        records = await client.agents(body.capability)
        tags = tuple(body.tags)
        weights = Weights(**client.settings.routing_weights.get(body.capability, {}))
        ranked = rank(records, body.capability, body.version, tags, body.priority, weights)
        candidates = [
            {
                "agent_id": r.info.agent_id,
                "status": r.status.value,
                "score": round(score, 4),
                "reason": why,
            }
            for r, score, why in ranked[: body.limit]
        ]
        reason = (
            ""
            if candidates
            else explain_miss(records, body.capability, body.version, tags, body.priority)
        )
        policy = body.routing or client.routing
        try:
            picked = await client.pick(
                body.capability,
                version=body.version,
                required_tags=tags,
                priority=body.priority,
                routing=policy,
            )
            suggestion: dict[str, Any] | None = {
                "agent_id": picked,
                "via": "instance" if picked is not None else "queue group",
                "policy": policy.value,
            }
        except (AgentUnavailable, CapabilityNotFound, CircuitOpen) as exc:
            suggestion, reason = None, reason or exc.message
        return _json(
            {
                "capability": body.capability,
                "candidates": candidates,
                "suggestion": suggestion,
                "reason": reason,
            }
        )

    return api
