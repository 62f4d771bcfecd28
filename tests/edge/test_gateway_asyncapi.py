"""``GET /asyncapi.json`` (issue 24): the gateway serves the live fleet's AsyncAPI 3.0
document, valid against the official schema, to any valid token."""

from __future__ import annotations

from reach import Client, ReachSettings

from ..asyncapi_schema import unresolved_refs, validation_errors
from ..demo_fleet import CAPABILITIES, TASKS, demo_fleet
from .gateway_kit import CALL, TOKENS, asgi


async def test_the_gateway_serves_the_fleet_s_asyncapi_document(
    reach_settings: ReachSettings, reach_client: Client
) -> None:
    async with (
        demo_fleet(reach_settings),
        asgi(reach_client, tokens=TOKENS) as (http, _),
    ):
        r = await http.get("/asyncapi.json")
        assert r.status_code == 401, r.text
        r = await http.get("/asyncapi.json", headers={"authorization": f"Bearer {CALL}"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        doc = r.json()
        assert validation_errors(doc) == []
        assert unresolved_refs(doc) == []
        ops = doc["operations"]
        assert {f"cap.{c}" for c in CAPABILITIES} | {f"task.{t}" for t in TASKS} <= set(ops)
        assert doc["servers"]["nats"]["protocol"] == "nats"

        r = await http.get(
            "/asyncapi.json",
            params={"capability": ["support.*", "aftersales.*"], "tag": "frontdesk"},
            headers={"authorization": f"Bearer {CALL}"},
        )
        assert r.status_code == 200, r.text
        assert sorted(r.json()["operations"]) == ["agent.support.ask", "cap.support.ask"]
