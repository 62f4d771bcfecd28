"""What keeps a browser page from using a gateway it can reach: JSON bodies only (a form
or text/plain body needs no preflight), no cross-site requests, and, on an open gateway,
only Host names of loopback or the configured host (DNS rebinding). Both ways in: the fast
path of the call route and Starlette's stack. An embedder's own middleware is never
bypassed."""

from __future__ import annotations

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from reach._gateway import EdgeDeps, GatewaySettings, build_app

from .gateway_kit import CALL, TOKENS, asgi, echo_agent, error_of

CALL_URL = "/v1/capabilities/demo.echo"


@pytest.fixture(params=["fast", "router"])
async def http(request, reach_settings, reach_client):
    """The open gateway, reached by the fast path, or by the router (a root_path)."""
    root = "" if request.param == "fast" else "/edge"
    async with echo_agent(reach_settings, "echo-1"):
        app = build_app(EdgeDeps(reach_client, GatewaySettings()))
        transport = httpx.ASGITransport(app=app, root_path=root)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as c:
            yield c


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
async def test_bodies_a_browser_sends_without_preflight_are_415(http, content_type):
    headers = {"content-type": content_type}
    for path in (CALL_URL, "/v1/tasks", "/v1/route", "/a2a/echo"):
        r = await http.post(path, content=b'{"capability": "demo.echo"}', headers=headers)
        assert (r.status_code, error_of(r)["code"]) == (415, "unsupported_media_type"), path
    r = await http.post("/v1/tasks", content=b'"x"', headers={"content-type": "application/x"})
    assert r.status_code == 415  # octet-stream is for the call route only
    r = await http.post(
        "/v1/tasks", content=b"{}", headers={"content-type": "application/octet-stream"}
    )
    assert r.status_code == 415


async def test_json_octets_and_empty_bodies_pass(http):
    r = await http.post(CALL_URL, content=b'{"n": 1}', headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["result"]["echo"]) == (200, {"n": 1})
    r = await http.post(CALL_URL, content=b"[1]", headers={"content-type": "application/x+json"})
    assert r.status_code == 200
    r = await http.post(CALL_URL)  # no body, no type: curl -X POST
    assert r.status_code == 200
    r = await http.post(
        CALL_URL, content=b'"raw"', headers={"content-type": "application/octet-stream"}
    )
    assert r.status_code == 200
    r = await http.post(CALL_URL, content=b'{"n": 1}', headers={"content-type": ""})
    assert r.status_code == 415  # a body with no type


async def test_cross_site_requests_are_403(http):
    for headers in (
        {"origin": "http://evil.example"},
        {"origin": "null"},
        {"origin": "http://127.0.0.1:9999"},  # another port is another origin
        {"sec-fetch-site": "cross-site"},
    ):
        r = await http.post(CALL_URL, json={}, headers=headers)
        assert (r.status_code, error_of(r)["code"]) == (403, "forbidden"), headers
        r = await http.get("/v1/agents", headers=headers)
        assert r.status_code == 403, headers
    r = await http.post(CALL_URL, json={}, headers={"origin": "http://127.0.0.1:8080"})
    assert r.status_code == 200
    r = await http.get("/v1/agents", headers={"sec-fetch-site": "same-origin"})
    assert r.status_code == 200
    # a link from another site to the page is a navigation, not a script
    nav = {"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate"}
    assert (await http.get("/healthz", headers=nav)).status_code == 200
    assert (await http.post(CALL_URL, json={}, headers=nav)).status_code == 403


async def test_an_open_gateway_answers_only_to_loopback_or_its_own_host_names(http):
    for host in ("evil.example", "evil.example:8080", "203.0.113.3:8080"):
        r = await http.post(CALL_URL, json={}, headers={"host": host})
        assert (r.status_code, error_of(r)["code"]) == (421, "misdirected_request"), host
        assert (await http.get("/v1/agents", headers={"host": host})).status_code == 421
    for host in ("localhost:8080", "127.0.0.1", "[::1]:8080", "127.0.0.2:80"):
        r = await http.post(CALL_URL, json={}, headers={"host": host})
        assert r.status_code == 200, host


async def test_with_tokens_any_host_name_may_be_used(reach_settings, reach_client):
    async with echo_agent(reach_settings, "echo-1"), asgi(reach_client, tokens=TOKENS) as (c, _):
        headers = {"host": "gw.example", "authorization": f"Bearer {CALL}"}
        r = await c.post(CALL_URL, json={}, headers=headers)
        assert r.status_code == 200


async def test_the_configured_host_and_public_url_are_allowed(reach_settings, reach_client):
    async with (
        echo_agent(reach_settings, "echo-1"),
        asgi(
            reach_client, host="gw.internal", allow_open=True, public_url="https://gw.example"
        ) as (c, _),
    ):
        for host in ("gw.internal:8080", "gw.example"):
            assert (await c.post(CALL_URL, json={}, headers={"host": host})).status_code == 200
        # the page served at the public URL may post to it through a proxy
        headers = {"origin": "https://gw.example", "host": "gw.internal:8080"}
        assert (await c.post(CALL_URL, json={}, headers=headers)).status_code == 200
        assert (await c.get("/v1/agents", headers={"host": "evil.example"})).status_code == 421


async def test_a_content_length_of_too_many_digits_is_400(http):
    headers = {"content-length": "9" * 40, "content-type": "application/json"}
    r = await http.post(CALL_URL, content=b"", headers=headers)
    assert (r.status_code, error_of(r)["code"]) == (400, "bad_request")


class Refuse:
    """An embedder's middleware: refuses every request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})


async def test_middleware_an_embedder_adds_is_not_bypassed_by_the_fast_path(
    reach_settings, reach_client
):
    async with echo_agent(reach_settings, "echo-1"):
        deps = EdgeDeps(reach_client, GatewaySettings())
        app = build_app(deps)
        app.add_middleware(Refuse)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            r = await c.post(CALL_URL, json={})
            assert (r.status_code, r.text) == (418, "no")
