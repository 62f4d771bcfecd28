"""The gateway's request/reply route, its error mapping, auth, limits, the routing table
routes, /healthz and /metrics: real nats-server, real agents, the app over ASGI."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from reach import Client, ReachSettings, Registry
from reach._gateway import build_app
from reach.testing import eventually

from .gateway_kit import ADMIN, CALL, SUBMIT, TOKENS, asgi, echo_agent, error_of

CALL_URL = "/v1/capabilities/demo.echo"
JSON = {"content-type": "application/json"}


async def test_a_call_answers_with_the_result_and_who_served_it(reach_settings, reach_client):
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client) as (http, _):
        r = await http.post(CALL_URL, json={"text": "hi"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["result"] == {"echo": {"text": "hi"}, "by": "echo-1"}
        assert body["agent_id"] == "echo-1"
        assert body["request_id"]
        assert body["latency_ms"] > 0
        # no body is a null payload; raw bytes pass through as octet-stream
        r = await http.post(CALL_URL)
        assert r.json()["result"] == {"echo": None, "by": "echo-1"}
        r = await http.post(
            CALL_URL, content=b'"raw"', headers={"content-type": "application/octet-stream"}
        )
        assert r.json()["result"]["echo"] == "raw"


async def test_options_come_from_the_query_or_x_reach_headers(reach_settings, reach_client):
    async with (
        echo_agent(reach_settings, "echo-1"),
        echo_agent(reach_settings, "echo-2"),
        asgi(reach_client) as (http, _),
    ):
        for _ in range(3):
            r = await http.post(CALL_URL, params={"agent_id": "echo-2", "priority": "high"})
            assert r.json()["agent_id"] == "echo-2"
            r = await http.post(CALL_URL, headers={"X-Reach-Agent": "echo-1"})
            assert r.json()["agent_id"] == "echo-1"
        # the query wins over the header
        r = await http.post(
            CALL_URL, params={"agent_id": "echo-2"}, headers={"X-Reach-Agent": "echo-1"}
        )
        assert r.json()["agent_id"] == "echo-2"
        r = await http.post(
            CALL_URL,
            params={"timeout": "5", "version": "1.0", "tags": "eu", "routing": "queue"},
            headers={"X-Reach-Priority": "low"},
        )
        assert r.status_code == 200, r.text


async def test_reach_errors_map_to_http_statuses_with_the_json_error_body(
    reach_settings, reach_client
):
    gate, entered = asyncio.Event(), asyncio.Event()
    async with (
        echo_agent(reach_settings, "echo-1", gate, entered, max_concurrency=1, max_queue=0),
        asgi(reach_client) as (http, _),
    ):
        # the agent says bad_request: 400
        r = await http.post(CALL_URL, json={"do": "refuse"})
        assert (r.status_code, error_of(r)["code"]) == (400, "bad_request")
        assert error_of(r)["agent_id"] == "echo-1"
        # the handler raised: 502 failed, and no internal detail leaks
        r = await http.post(CALL_URL, json={"do": "boom"})
        assert (r.status_code, error_of(r)["code"]) == (502, "failed")
        assert "secret" not in r.text
        # an application's own code passes through
        r = await http.post(CALL_URL, json={"do": "busy"})
        err = error_of(r)
        assert (r.status_code, err["code"], err["application_code"]) == (502, "busy_now", True)
        # nobody offers it: 404
        r = await http.post("/v1/capabilities/demo.nobody", json={})
        err = error_of(r)
        assert (r.status_code, err["code"], err["capability"]) == (
            404,
            "capability_not_found",
            "demo.nobody",
        )
        # a direct call to an instance that is not there: 503
        r = await http.post(CALL_URL, params={"agent_id": "ghost-1"})
        assert r.status_code == 503, r.text
        assert error_of(r)["code"] == "agent_unavailable"
        assert r.headers["retry-after"] == "1"
        # one worker, no queue: a second call while one is held is refused at once, 429
        held = asyncio.create_task(http.post(CALL_URL, json={"do": "wait"}, timeout=30))
        await asyncio.wait_for(entered.wait(), 30)
        r = await http.post(CALL_URL, json={}, params={"agent_id": "echo-1"})
        assert (r.status_code, error_of(r)["code"]) == (429, "resource_exhausted")
        gate.set()
        assert (await held).status_code == 200


async def test_a_call_that_times_out_is_504(reach_settings, reach_client):
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client) as (http, _):
        r = await http.post(CALL_URL, json={"do": "wait"}, params={"timeout": "0.2"})
        err = error_of(r)
        assert (r.status_code, err["code"], err["retryable"]) == (504, "timeout", True)


@pytest.mark.parametrize(
    ("url", "params", "headers", "content", "needle"),
    [
        ("/v1/capabilities/Demo.Echo", {}, {}, b"{}", "lowercase"),
        ("/v1/capabilities/demo..echo", {}, {}, b"{}", "empty token"),
        (CALL_URL, {"priority": "urgent"}, {}, b"{}", "priority"),
        (CALL_URL, {"timeout": "-1"}, {}, b"{}", "positive"),
        (CALL_URL, {"timeout": "nan"}, {}, b"{}", "positive"),
        (CALL_URL, {"timeout": "9999"}, {}, b"{}", "limit"),
        (CALL_URL, {}, {"X-Reach-Timeout": "soon"}, b"{}", "number"),
        (CALL_URL, {"agent_id": "a.b"}, {}, b"{}", "agent_id"),
        (CALL_URL, {"version": "v 1"}, {}, b"{}", "version"),
        (CALL_URL, {"routing": "random"}, {}, b"{}", "routing"),
        (CALL_URL, {"routing": "direct"}, {}, b"{}", "agent_id"),
        (CALL_URL, {}, {}, b"{not json", "not JSON"),
    ],
)
async def test_invalid_input_is_400_before_anything_is_sent(
    reach_settings, url, params, headers, content, needle
):
    # No agent runs: had the request reached NATS it would be 404, not 400; and the
    # client never checked a capability for a call (its first step on every call).
    async with Client(settings=reach_settings) as client, asgi(client) as (http, _):
        headers = {"content-type": "application/json", **headers}
        r = await http.post(url, params=params, headers=headers, content=content)
        err = error_of(r)
        assert (r.status_code, err["code"]) == (400, "bad_request"), r.text
        assert needle in err["message"]
        assert client.footprint()["capabilities.checked"] == 0  # no call reached the client
        r = await http.post(CALL_URL, json={})  # whereas a valid one does, and finds nobody
        assert (r.status_code, client.footprint()["capabilities.checked"]) == (404, 1)


async def test_bodies_over_the_limit_are_413_with_or_without_a_content_length(reach_client):
    async with asgi(reach_client, max_body_bytes=64, headers=JSON) as (http, _):
        r = await http.post(CALL_URL, content=b"[" + b"1," * 40 + b"1]")
        assert (r.status_code, error_of(r)["code"]) == (413, "payload_too_large")

        async def chunks():
            for _ in range(10):
                yield b" " * 16

        r = await http.post(CALL_URL, content=chunks())
        assert "content-length" not in r.request.headers
        assert (r.status_code, error_of(r)["code"]) == (413, "payload_too_large")
        r = await http.post("/v1/tasks", content=chunks())
        assert r.status_code == 413
        r = await http.post("/v1/tasks", json={"capability": "x", "payload": "y" * 100})
        assert r.status_code == 413


async def test_tokens_and_scopes(reach_settings, reach_client):
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client, tokens=TOKENS) as (http, _):
        r = await http.post(CALL_URL, json={})
        assert (r.status_code, error_of(r)["code"]) == (401, "unauthorized")
        assert r.headers["www-authenticate"].startswith("Bearer")
        for bad in ("Bearer " + "x" * 20, "Basic " + CALL, CALL, "Bearer "):
            r = await http.post(CALL_URL, json={}, headers={"Authorization": bad})
            assert r.status_code == 401, bad
        r = await http.post(CALL_URL, json={}, headers={"Authorization": f"Bearer {SUBMIT}"})
        assert (r.status_code, error_of(r)["code"]) == (403, "forbidden")
        r = await http.post("/v1/tasks", json={"capability": "x.y"}, headers=auth(CALL))
        assert r.status_code == 403
        for token in (CALL, ADMIN):
            r = await http.post(CALL_URL, json={}, headers=auth(token))
            assert r.status_code == 200, token
        # the routing table takes any valid token; probes and scrapes take none
        assert (await http.get("/v1/agents")).status_code == 401
        assert (await http.get("/v1/agents", headers=auth(SUBMIT))).status_code == 200
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_without_tokens_everything_is_allowed(reach_settings, reach_client):
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client) as (http, deps):
        assert deps.settings.open
        r = await http.post(CALL_URL, json={}, headers=auth("anything-at-all-here"))
        assert r.status_code == 200


async def test_agents_capabilities_and_the_route_query(reach_settings: ReachSettings):
    settings = reach_settings
    async with (
        Registry(settings=settings),
        echo_agent(settings, "echo-1"),
        echo_agent(settings, "echo-2"),
        Client(settings=settings) as client,
        asgi(client) as (http, _),
    ):

        async def both_known() -> bool:
            return len(await client.agents("demo.echo")) == 2

        await eventually(both_known)
        r = await http.get("/v1/agents")
        ids = [a["info"]["agent_id"] for a in r.json()["agents"]]
        assert ids == ["echo-1", "echo-2"]
        r = await http.get("/v1/agents", params={"capability": "demo.nobody"})
        assert r.json() == {"agents": []}
        r = await http.get("/v1/agents", params={"status": "SLEEPY"})
        assert (r.status_code, error_of(r)["code"]) == (422, "bad_request")

        caps = (await http.get("/v1/capabilities")).json()["capabilities"]
        assert caps == [
            {
                "name": "demo.echo",
                "kind": "request",
                "description": "says it back",
                "versions": ["1.2"],
                "tags": ["eu"],
                "agents": ["echo-1", "echo-2"],
                "instances": 2,
                "by_status": {"UP": 2},
            }
        ]

        r = await http.post("/v1/route", json={"capability": "demo.echo", "tags": ["eu"]})
        route = r.json()
        assert [c["agent_id"] for c in route["candidates"]] == ["echo-1", "echo-2"]
        assert all(c["score"] > 0 and c["status"] == "UP" for c in route["candidates"])
        assert route["suggestion"]["agent_id"] in {"echo-1", "echo-2"}
        assert route["suggestion"]["policy"] == "balanced"
        r = await http.post(
            "/v1/route", json={"capability": "demo.echo", "routing": "scored", "limit": 1}
        )
        assert len(r.json()["candidates"]) == 1
        assert r.json()["suggestion"]["policy"] == "scored"
        r = await http.post("/v1/route", json={"capability": "demo.echo", "tags": ["us"]})
        route = r.json()
        assert route["candidates"] == []
        assert route["suggestion"] is None
        assert "lack tag 'us'" in route["reason"]
        r = await http.post("/v1/route", json={"capability": "Not Valid"})
        err = error_of(r)
        assert (r.status_code, err["code"]) == (422, "bad_request")
        assert err["fields"][0]["loc"] == ["body", "capability"]


async def test_healthz_follows_the_nats_connection(reach_settings):
    client = Client(settings=reach_settings)
    await client.connect()
    async with asgi(client) as (http, _):
        r = await http.get("/healthz")
        assert (r.status_code, r.json()["nats"]) == (200, True)
        await client.close()
        r = await http.get("/healthz")
        assert (r.status_code, r.json()["status"], r.json()["nats"]) == (503, "unhealthy", False)


async def test_metrics_carry_the_http_routes_and_the_client(reach_settings, reach_client):
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client) as (http, _):
        await http.post(CALL_URL, json={})
        await http.post("/v1/capabilities/demo.nobody", json={})
        await http.get("/v1/no/such/route")
        text = (await http.get("/metrics")).text
    route = 'route="/v1/capabilities/{capability}"'
    assert f'reach_gateway_http_requests_total{{code="200",method="POST",{route}}} 1.0' in text
    assert f'reach_gateway_http_requests_total{{code="404",method="POST",{route}}} 1.0' in text
    assert 'code="404",method="GET",route="unmatched"' in text
    assert f"reach_gateway_http_request_duration_seconds_count{{{route}}} 2.0" in text
    assert (
        'reach_client_requests_total{capability="demo.echo",outcome="ok",policy="balanced"}' in text
    )


async def test_unknown_paths_and_methods_answer_in_the_same_shape(reach_client):
    async with asgi(reach_client) as (http, _):
        r = await http.get("/v1/nothing")
        assert (r.status_code, error_of(r)["code"]) == (404, "not_found")
        r = await http.get(CALL_URL)
        assert (r.status_code, error_of(r)["code"]) == (405, "method_not_allowed")
        assert (await http.get("/docs")).status_code == 200
        paths = (await http.get("/openapi.json")).json()["paths"]
        assert "/v1/capabilities/{capability}" in paths
        params = {
            p["name"]
            for p in paths[CALL_URL.replace("demo.echo", "{capability}")]["post"]["parameters"]
        }
        assert {"timeout", "priority", "agent_id", "tags", "version", "routing"} <= params


async def test_a_body_sent_as_a_form_is_refused(reach_settings, reach_client):
    """What `curl -d` sends, and what a page on another site may send without asking:
    415, the gateway reads JSON bodies only (test_gateway_guard has the rest)."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client) as (http, _):
        r = await http.post("/v1/route", content=b'{"capability": "demo.echo"}', headers=form)
        assert (r.status_code, error_of(r)["code"]) == (415, "unsupported_media_type")
        r = await http.post(CALL_URL, content=b'{"n": 1}', headers=form)
        assert r.status_code == 415


async def test_the_call_route_answers_alike_through_starlettes_router(reach_settings, reach_client):
    """With a root_path the fast path steps aside: the same endpoint, through the router."""
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client) as (_, deps):
        app = build_app(deps)
        transport = httpx.ASGITransport(app=app, root_path="/edge")
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            r = await http.post(CALL_URL, json={"n": 2})
            assert (r.status_code, r.json()["result"]["echo"]) == (200, {"n": 2})
            r = await http.post(CALL_URL, params={"priority": "urgent"})
            assert (r.status_code, error_of(r)["code"]) == (400, "bad_request")
            r = await http.post(CALL_URL, content=b"[" + b"1," * 10**6 + b"1]", headers=JSON)
            assert r.status_code == 413
        labels = {"route": "/v1/capabilities/{capability}", "method": "POST", "code": "200"}
        assert deps.metrics.requests[tuple(labels.values())] >= 1


async def test_an_unexpected_error_is_a_500_in_the_json_shape(reach_client, monkeypatch, caplog):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(reach_client, "call", broken)
    async with asgi(reach_client) as (http, deps):
        r = await http.post(CALL_URL, json={})
        err = error_of(r)
        assert (r.status_code, err["code"], err["message"]) == (500, "failed", "internal error")
        assert "a bug" not in r.text
        assert deps.metrics.in_flight == 0
    assert any("a bug" in (rec.exc_text or "") or rec.exc_info for rec in caplog.records)


async def test_the_route_query_refuses_direct_routing(reach_settings, reach_client):
    """``direct`` needs the instance to call, which a route query does not name."""
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client) as (http, _):
        r = await http.post("/v1/route", json={"capability": "demo.echo", "routing": "direct"})
        err = error_of(r)
        assert (r.status_code, err["code"]) == (400, "bad_request")
        assert "direct" in err["message"]


async def test_a_route_query_says_why_when_every_fitting_instance_is_gone(reach_settings):
    """A lease whose instance is gone (nobody listens on its subject): once a call found
    that out, a route query with tags answers no suggestion and the reason, not a 503."""
    import nats

    from tests.integration.registry_wire import info, register

    nc = await nats.connect(reach_settings.nats_url)
    try:
        async with Registry(settings=reach_settings), Client(settings=reach_settings) as client:
            ghost = info("ghost-1", capability="demo.echo", tags=("eu",))
            assert b"ERROR" not in (await register(nc, reach_settings, ghost)).data
            await eventually(lambda: _knows(client, "demo.echo"), timeout=10)
            async with asgi(client) as (http, _):
                r = await http.post(CALL_URL, params={"tags": "eu"}, json={})
                assert (r.status_code, error_of(r)["code"]) == (503, "agent_unavailable")
                r = await http.post("/v1/route", json={"capability": "demo.echo", "tags": ["eu"]})
                assert r.status_code == 200, r.text
                assert r.json()["suggestion"] is None
                assert "gone" in r.json()["reason"]
    finally:
        await nc.close()


async def _knows(client: Client, capability: str) -> bool:
    return bool(await client.agents(capability))
