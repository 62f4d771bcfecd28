"""Auth through ``build_edge``, the wiring ``reach gateway`` serves: the status page's data,
task event streams and the A2A endpoint with the gateway's own ``Auth``; and the cards'
URLs from ``REACH_GATEWAY_PUBLIC_URL``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from reach import Client, ReachSettings, Registry
from reach._gateway import EdgeDeps, GatewaySettings
from reach._gateway.edge import build_edge
from reach.testing import eventually

from .gateway_kit import ADMIN, CALL, SUBMIT, TOKENS, echo_agent, error_of, job_agent


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextlib.asynccontextmanager
async def edge(settings: ReachSettings, **gateway: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An echo agent (name ``echo``), a durable job (name ``worker``), and the whole edge
    over ASGI in front of a connected client."""
    async with (
        Registry(settings=settings),
        echo_agent(settings, "echo-1"),
        job_agent(settings),
        Client(settings=settings) as client,
    ):

        async def listed() -> bool:
            return {r.info.name for r in await client.agents()} == {"echo", "worker"}

        await eventually(listed, timeout=30)
        app = build_edge(EdgeDeps(client, GatewaySettings(**gateway))).app
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            yield http


def rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}


def message(capability: str, **extra: Any) -> dict[str, Any]:
    msg = {"role": "ROLE_USER", "messageId": "m-1", "parts": [{"text": "a"}], **extra}
    return {"message": {**msg, "metadata": {"capability": capability}}}


A2A = {"A2A-Version": "1.0"}


async def test_the_status_data_needs_a_token(reach_settings):
    async with edge(reach_settings, tokens=TOKENS) as http:
        for path in ("/v1/status", "/v1/status/events"):
            r = await http.get(path)
            assert (r.status_code, error_of(r)["code"]) == (401, "unauthorized"), path
        assert (await http.get("/")).status_code == 200  # the page holds no data


async def test_task_events_need_the_submit_scope(reach_settings):
    async with edge(reach_settings, tokens=TOKENS) as http:
        r = await http.post("/v1/tasks", json={"capability": "demo.job"}, headers=auth(SUBMIT))
        task_id = r.json()["task_id"]
        r = await http.get(f"/v1/tasks/{task_id}/events", headers=auth(CALL))
        assert (r.status_code, error_of(r)["code"]) == (403, "forbidden")
        assert (await http.get(f"/v1/tasks/{task_id}/events")).status_code == 401


async def test_a2a_scopes_come_from_the_gateway_tokens(reach_settings):
    async with edge(reach_settings, tokens=TOKENS) as http:
        card = "/a2a/worker/.well-known/agent-card.json"
        assert (await http.get(card)).status_code == 401
        assert (await http.get(card, headers=auth(CALL))).status_code == 200
        job = rpc("SendMessage", message("demo.job"))
        r = await http.post("/a2a/worker", json=job, headers=A2A)
        assert r.status_code == 401
        r = await http.post("/a2a/worker", json=job, headers={**A2A, **auth(CALL)})
        assert r.status_code == 403
        # a follow-up to a task is refused for the scope before the task is looked up
        follow = rpc("SendMessage", message("demo.job", taskId="no-such-task"))
        r = await http.post("/a2a/worker", json=follow, headers={**A2A, **auth(CALL)})
        assert r.status_code == 403
        echo = rpc("SendMessage", message("demo.echo"))
        r = await http.post("/a2a/echo", json=echo, headers={**A2A, **auth(CALL)})
        assert (r.status_code, "result" in r.json()) == (200, True), r.text
        r = await http.post("/a2a/echo", json=echo, headers={**A2A, **auth(SUBMIT)})
        assert r.status_code == 403
        r = await http.post("/a2a/worker", json=job, headers={**A2A, **auth(ADMIN)})
        assert (r.status_code, "result" in r.json()) == (200, True), r.text


async def test_cards_carry_the_public_url(reach_settings):
    async with edge(reach_settings, public_url="https://gw.example/edge/") as http:
        r = await http.get("/a2a/echo/.well-known/agent-card.json", headers={"host": "gw.example"})
        urls = [i["url"] for i in r.json()["supportedInterfaces"]]
        assert set(urls) == {"https://gw.example/edge/a2a/echo"}


async def test_a2a_message_ids_are_per_token(reach_settings):
    """The message id is the submit's idempotency key, scoped to the token: two callers
    sending the same id get two tasks, one caller sending it again gets the same one."""
    async with edge(reach_settings, tokens=TOKENS) as http:
        params = {**message("demo.job"), "configuration": {"returnImmediately": True}}
        ids = []
        for token in (SUBMIT, ADMIN, SUBMIT):
            r = await http.post(
                "/a2a/worker", json=rpc("SendMessage", params), headers={**A2A, **auth(token)}
            )
            ids.append(r.json()["result"]["task"]["id"])
        assert ids[0] == ids[2] != ids[1]
