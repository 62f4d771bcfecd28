"""The status page's HTTP side against a real fleet and a real uvicorn: the JSON snapshot,
the assets, the event stream (first a snapshot, then status changes), the cap on streams,
a reader that stalls, and shutdown."""

import asyncio
import contextlib
import json
import socket

import httpx
from fastapi import FastAPI

from reach._gateway.page import page_routes
from reach.testing import eventually

from .fleet import ECHO, TASK, fleet
from .server import serve


async def sse(response):
    """(event, data) pairs of a server-sent event stream."""
    event, data = "message", []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            data.append(line[len("data: ") :])


async def next_event(events, name):
    async for event, data in events:
        if event == name:
            return data
    raise AssertionError(f"the stream ended before a {name!r} event")


async def test_status_json_has_fleet_rates_tasks_and_dead_letters(reach_settings):
    async with (
        fleet(reach_settings, interval=60) as f,
        serve(f.app()) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        first = (await http.get("/v1/status")).json()
        assert first["interval"] is None  # one sample so far: no rates
        await f.traffic(ok=20, failing=3)
        assert await (await f.client.submit(TASK, {"n": 1})).result(timeout=30) == {"n": 2}
        failing = await f.client.submit(TASK, {"n": 2, "fail": True}, max_attempts=1)
        await failing.wait(timeout=30)
        await f.feed.refresh()  # the second sample: rates over the traffic above
        got = await http.get("/v1/status")

    assert got.status_code == 200
    assert got.headers["content-type"] == "application/json"
    s = got.json()
    assert s["prefix"] == reach_settings.subject_prefix
    assert {a["id"]: a["status"] for a in s["agents"]} == {
        "builder-1": "UP",
        "echo-1": "UP",
        "echo-2": "UP",
    }
    caps = {c["name"]: c for c in s["capabilities"]}
    echo = caps[ECHO]
    assert (echo["instances"]["UP"], echo["kinds"]) == (2, ["request"])
    assert (echo["traffic"]["requests"], echo["traffic"]["errors"]) == (23, 3)
    assert echo["traffic"]["requests_per_s"] > 0
    assert s["fleet"]["traffic"]["errors_per_s"] > 0
    assert caps[TASK]["tasks"] == {"waiting": 0, "running": 0, "dead": 1}
    assert s["tasks"]["states"] == {"SUCCEEDED": 1, "FAILED": 1}
    assert s["dlq"]["size"] == 1
    [dead] = s["dlq"]["latest"]
    assert (dead["task_id"], dead["capability"], dead["reason"], dead["attempts"]) == (
        failing.task_id,
        TASK,
        "failed",
        1,
    )
    assert "month does not exist" in dead["error"]
    assert s["page"]["sample_errors"] == 0


async def test_the_page_and_its_assets_are_served_from_the_package(reach_settings):
    async with (
        fleet(reach_settings) as f,
        serve(f.app()) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        page = await http.get("/")
        js = await http.get("/static/app.js")
        css = await http.get("/static/style.css")
        missing = [await http.get(p) for p in ("/static/nope.js", "/static/..%2Fhub.py")]
        docs = (await http.get("/openapi.json")).json()
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="static/app.js" defer></script>' in page.text
    assert js.headers["content-type"].startswith("text/javascript")
    assert "v1/status/events" in js.text
    assert css.headers["content-type"].startswith("text/css")
    assert [r.status_code for r in missing] == [404, 404]
    assert missing[0].json()["error"]["code"] == "not_found"
    assert {"/v1/status", "/v1/status/events"} <= docs["paths"].keys()
    assert "/" not in docs["paths"]


async def test_stream_sends_a_snapshot_then_status_changes(reach_settings):
    async with (
        fleet(reach_settings, interval=60) as f,
        serve(f.app(), on_exit=f.feed.shutdown) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        http.stream("GET", "/v1/status/events") as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
        first = await next_event(events, "snapshot")
        assert {a["id"] for a in first["agents"]} == {"builder-1", "echo-1", "echo-2"}
        await f.agents["echo-2"].pause()
        while (change := await next_event(events, "agent"))["agent"]["id"] != "echo-2":
            pass  # the others' first records since the feed started
        assert change["agent"]["status"] == "PAUSED"
        fresh = await next_event(events, "snapshot")  # soon after a change, not at 60 s
        assert {a["id"]: a["status"] for a in fresh["agents"]}["echo-2"] == "PAUSED"
        await f.agents["echo-1"].stop()
        while (await next_event(events, "agent")).get("gone") != "echo-1":
            pass
        f.feed.shutdown()  # the server's exit: open streams end
        assert [e async for e in events] == []
        assert f.feed.hub.subscribers == 0


async def test_streams_beyond_the_cap_are_refused(reach_settings):
    async with (
        fleet(reach_settings, max_streams=1) as f,
        serve(f.app(), on_exit=f.feed.shutdown) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        http.stream("GET", "/v1/status/events") as held,
    ):
        await next_event(sse(held), "snapshot")
        refused = await http.get("/v1/status/events")
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "2"
        error = refused.json()["error"]
        assert (error["code"], error["retryable"]) == ("resource_exhausted", True)
        assert "too many status streams" in error["message"]
        assert f.feed.stats["streams_refused"] == 1
        assert (await http.get("/v1/status")).status_code == 200  # the JSON is not capped


SMALL_BUFFER = 4096  # bytes: the kernel's buffers hold a frame or so, on any machine


async def test_a_reader_that_stalls_costs_a_bounded_queue_then_is_let_go(reach_settings):
    async with (
        fleet(reach_settings, queue_size=8, interval=60) as f,
        serve(f.app(), on_exit=f.feed.shutdown, sndbuf=SMALL_BUFFER) as url,
    ):
        host, port = url.removeprefix("http://").split(":")
        # Both ends' buffers are set small (the receive buffer before connecting: it sets
        # the window), so how much the kernel holds is not the machine's default sizes.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        except BaseException:
            sock.close()
            raise
        _, writer = await asyncio.open_connection(sock=sock)
        hub = f.feed.hub
        try:
            writer.write(b"GET /v1/status/events HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            await eventually(lambda: hub.subscribers == 1)
            big = b"event: pad\ndata: " + b"x" * 65536 + b"\n\n"

            def stalled():  # the socket's buffers fill, then the queue, then frames drop
                hub.publish(big)
                return hub.dropped > 0

            await eventually(stalled, timeout=60)
            # What a stalled reader costs: its queue, full, never more however much is
            # published; each frame past it drops the oldest one (counted).
            assert hub.backlog == hub.queue_size == 8
            dropped = hub.dropped
            for _ in range(100):
                hub.publish(big)
            assert hub.backlog == 8
            assert hub.dropped == dropped + 100
        finally:
            writer.transport.abort()  # the reader goes away without reading
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await eventually(lambda: f.feed.hub.subscribers == 0)


async def test_a_router_without_a_feed_runs_its_own_for_the_app_lifespan(reach_settings):
    async with fleet(reach_settings) as f:
        before = asyncio.all_tasks()
        app = FastAPI()
        app.include_router(page_routes(f.client, interval=60))
        async with (
            serve(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            async with http.stream("GET", "/v1/status/events") as response:
                events = sse(response)
                await next_event(events, "snapshot")
                await f.agents["echo-1"].pause()
                while (change := await next_event(events, "agent"))["agent"]["id"] != "echo-1":
                    pass
                assert change["agent"]["status"] == "PAUSED"
            # the stream closed by its reader: the server can stop, and its lifespan
            # closes the feed it made
        assert not [t.get_name() for t in asyncio.all_tasks() - before if not t.done()]
