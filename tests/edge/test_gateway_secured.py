"""The gateway as deployed: the ``client`` user of the shipped secured config
(services/nats/nats-server.conf) can do everything the gateway's routes do, with no
permission refused anywhere (the server's log included)."""

from __future__ import annotations

from reach import Client, Registry
from reach.testing import NatsServer, eventually
from tests.integration.test_auth import as_user, logistics, secured, tasks_init, violations

from .gateway_kit import asgi, parse_sse

__all__ = ["secured"]  # the module-scoped server fixture, shared with test_auth


async def test_the_gateway_works_as_the_client_user(secured: NatsServer):
    await tasks_init(secured)
    before = len(violations(secured))
    async with (
        Registry(settings=as_user(secured, "registry")),
        logistics(as_user(secured, "logistics-1")),
        Client(settings=as_user(secured, "client"), name="reach-gateway") as client,
        asgi(client) as (http, _),
    ):

        async def listed() -> bool:
            return len((await http.get("/v1/agents")).json()["agents"]) == 1

        await eventually(listed, 10)
        r = await http.post("/v1/capabilities/logistics.track", json={"order_id": "A-1"})
        assert (r.status_code, r.json()["result"]["by"]) == (200, "logistics-1")
        r = await http.post(
            "/v1/capabilities/logistics.track",
            json={"order_id": "A-2"},
            params={"agent_id": "logistics-1"},
        )
        assert r.status_code == 200
        r = await http.post("/v1/route", json={"capability": "logistics.track"})
        assert r.json()["candidates"][0]["agent_id"] == "logistics-1"
        assert (await http.get("/v1/capabilities")).status_code == 200
        r = await http.post(
            "/v1/tasks",
            json={"capability": "logistics.reroute", "payload": {"order_id": "A-3"}},
            headers={"Idempotency-Key": "reroute-A-3"},
        )
        task_id = r.json()["task_id"]
        events = parse_sse((await http.get(f"/v1/tasks/{task_id}/events")).text)
        assert events[-1] == ("end", {"task_id": task_id, "state": "SUCCEEDED"})
        r = await http.post(f"/v1/tasks/{task_id}/cancel")  # harmless once it ended
        assert (r.status_code, r.json()["state"]) == (200, "SUCCEEDED")
        await client.flush()
        assert client.stats.permission_violations == 0
    assert violations(secured)[before:] == []
