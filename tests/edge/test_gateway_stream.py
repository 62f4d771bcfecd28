"""``POST /v1/capabilities/{cap}/stream``: a streaming capability as Server-Sent Events, one
event per chunk as it comes; errors before the first chunk as HTTP statuses, after it as
an ``error`` event; an HTTP client that goes away cancels the handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx

from reach import Agent, Client, ReachSettings
from reach.testing import eventually

from .gateway_kit import asgi, error_of, parse_sse, served


def writer(settings: ReachSettings, ended: list[str], first: asyncio.Event) -> Agent:
    """``text.write`` yields ``n`` pages; ``text.fail`` one, then fails; ``text.hold`` one,
    then waits until cancelled (``ended`` says how it ended)."""
    agent = Agent("writer", "writer-1", settings=settings)

    @agent.capability("text.write")
    async def write(req: dict[str, Any]) -> AsyncIterator[Any]:
        for i in range(req["n"]):
            yield {"page": i}
        yield "the end"

    @agent.capability("text.fail")
    async def fail(req: Any) -> AsyncIterator[Any]:
        yield {"page": 0}
        raise RuntimeError("out of ink")

    @agent.capability("text.hold")
    async def hold(req: Any) -> AsyncIterator[Any]:
        try:
            yield {"page": 0}
            first.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    return agent


async def test_each_chunk_is_an_event_then_the_end(reach_settings):
    ended: list[str] = []
    async with (
        writer(reach_settings, ended, asyncio.Event()),
        Client(settings=reach_settings) as client,
        asgi(client) as (http, _),
    ):
        r = await http.post("/v1/capabilities/text.write/stream", json={"n": 3})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.text)
        ids = [line for line in r.text.splitlines() if line.startswith("id: ")]
        # an error before the first chunk is an HTTP error, as on the call route
        missing = await http.post("/v1/capabilities/text.nobody/stream", json={})
        not_json = await http.post(
            "/v1/capabilities/text.write/stream",
            content=b"{oops",
            headers={"content-type": "application/json"},
        )
        failing = await http.post("/v1/capabilities/text.fail/stream", json={})
    assert events[:4] == [("chunk", {"page": i}) for i in range(3)] + [("chunk", "the end")]
    assert events[4][0] == "end"
    assert events[4][1]["chunks"] == 4
    assert events[4][1]["agent_id"] == "writer-1"
    assert ids == ["id: 1", "id: 2", "id: 3", "id: 4"]
    assert (missing.status_code, error_of(missing)["code"]) == (404, "capability_not_found")
    assert (not_json.status_code, error_of(not_json)["code"]) == (400, "bad_request")
    # an error after a chunk ends the stream with an error event
    assert failing.status_code == 200
    (kind0, page), (kind1, err) = parse_sse(failing.text)
    assert (kind0, page) == ("chunk", {"page": 0})
    assert kind1 == "error"
    assert err["code"] == "failed"
    assert "after 1 chunk received" in err["message"]
    assert "out of ink" not in err["message"]


async def test_an_http_client_that_goes_away_cancels_the_handler(reach_settings):
    ended: list[str] = []
    first = asyncio.Event()
    async with (
        writer(reach_settings, ended, first) as agent,
        served(reach_settings) as (url, deps),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        async with http.stream("POST", "/v1/capabilities/text.hold/stream", json={}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            assert await anext(lines) == "id: 1"
            await first.wait()
        # the connection is closed: the gateway closes the stream, the agent stops it
        await eventually(lambda: ended == ["cancelled"] and deps.streams.open == 0)
        assert agent.stats.streams_cancelled == 1
    assert ended == ["cancelled"]


async def test_streams_waiting_for_their_first_chunk_hold_their_slots(reach_settings):
    """The stream limit counts a stream from before its call is sent: of three requests
    sent at once with room for one, one reaches the agent and two are refused with 503,
    even while the first still waits for its first chunk."""
    gate = asyncio.Event()
    entered: list[str] = []
    agent = Agent("slow", "slow-1", settings=reach_settings)

    @agent.capability("text.slow")
    async def slow(req: Any) -> AsyncIterator[Any]:
        entered.append("in")
        await gate.wait()
        yield {"page": 0}

    async with (
        agent,
        served(reach_settings, max_streams=1) as (url, deps),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        calls = [
            asyncio.create_task(http.post("/v1/capabilities/text.slow/stream", json={}))
            for _ in range(3)
        ]
        # the handler runs once per request that was not refused
        await eventually(lambda: len(entered) + deps.streams.refused >= 3)
        gate.set()
        answers = await asyncio.gather(*calls)
        assert sorted(r.status_code for r in answers) == [200, 503, 503]
        refused = [r for r in answers if r.status_code == 503]
        assert {error_of(r)["code"] for r in refused} == {"resource_exhausted"}
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert (entered, deps.streams.refused) == (["in"], 2)
        [ok] = [r for r in answers if r.status_code == 200]
        assert [kind for kind, _ in parse_sse(ok.text)] == ["chunk", "end"]
        await eventually(lambda: deps.streams.open == 0)
        # a call refused before its first chunk gives its slot back
        missing = await http.post("/v1/capabilities/text.nobody/stream", json={})
        assert (missing.status_code, deps.streams.open) == (404, 0)


async def test_an_idle_stream_sends_pings(reach_settings):
    """While no chunk comes, a ``: ping`` comment every ``sse_ping`` seconds, and the
    stream goes on after it."""
    ended: list[str] = []
    first = asyncio.Event()
    async with (
        writer(reach_settings, ended, first),
        served(reach_settings, sse_ping=0.05) as (url, deps),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        async with http.stream("POST", "/v1/capabilities/text.hold/stream", json={}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            assert [await anext(lines) for _ in range(4)] == [
                "id: 1",
                "event: chunk",
                'data: {"page":0}',
                "",
            ]
            # the handler waits: nothing but pings come, each a comment then a blank line
            pings = [await anext(lines) for _ in range(6)]
        assert pings == [": ping", ""] * 3
        await eventually(lambda: ended == ["cancelled"] and deps.streams.open == 0)
