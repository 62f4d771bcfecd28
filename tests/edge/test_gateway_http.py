"""The gateway through a real uvicorn on loopback (sockets, chunked bodies, live event
streams, a client that hangs up), and the ``reach gateway`` command as a process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import httpx

from reach import ReachSettings
from reach._gateway import EdgeDeps
from reach.testing import eventually

from .gateway_kit import echo_agent, error_of, job_agent, served


async def test_a_call_through_uvicorn_with_the_client_owned_by_the_lifespan(reach_settings):
    async with echo_agent(reach_settings, "echo-1"):
        async with served(reach_settings) as (url, deps), httpx.AsyncClient(base_url=url) as http:
            assert deps.client.connected
            r = await http.post("/v1/capabilities/demo.echo", json={"n": 1})
            assert r.status_code == 200, r.text
            assert r.json()["result"] == {"echo": {"n": 1}, "by": "echo-1"}
            r = await http.get("/healthz")
            assert r.status_code == 200
        assert not deps.client.connected  # closed at shutdown


async def test_a_chunked_body_over_the_limit_is_413_on_the_wire(reach_settings):
    async def chunks():
        for _ in range(64):
            yield b" " * 1024

    async with (
        served(reach_settings, max_body_bytes=4096) as (url, _),
        httpx.AsyncClient(base_url=url, headers={"content-type": "application/json"}) as http,
    ):
        r = await http.post("/v1/capabilities/demo.echo", content=chunks())
        assert r.request.headers["transfer-encoding"] == "chunked"
        assert (r.status_code, error_of(r)["code"]) == (413, "payload_too_large")
        r = await http.post("/v1/capabilities/demo.echo", content=b" " * 5000)
        assert r.status_code == 413
        # and the server still serves
        assert (await http.get("/healthz")).status_code == 200


async def test_events_stream_live_with_pings_until_the_end(reach_settings):
    settings = reach_settings.model_copy(update={"task_ack_wait": 2.0})
    gate, entered = asyncio.Event(), asyncio.Event()
    async with (
        job_agent(settings, gate, entered),
        served(settings, sse_ping=0.05) as (url, deps),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        r = await http.post("/v1/tasks", json={"capability": "demo.job", "payload": {"hold": True}})
        task_id = r.json()["task_id"]
        await asyncio.wait_for(entered.wait(), 30)
        seen: list[str] = []
        async with http.stream("GET", f"/v1/tasks/{task_id}/events") as stream:
            async for line in stream.aiter_lines():
                seen.append(line)
                # the task runs and the stream idles: pings come; then let the task end
                if line.startswith(":") and any('"RUNNING"' in s for s in seen):
                    gate.set()
        assert any(s.startswith("data:") and '"RUNNING"' in s for s in seen)
        assert seen[-3:] == [
            "event: end",
            f'data: {{"task_id":"{task_id}","state":"SUCCEEDED"}}',
            "",
        ]
        await eventually(lambda: deps.metrics.in_flight == 0)


async def test_a_client_that_hangs_up_ends_its_stream(reach_settings):
    settings = reach_settings.model_copy(update={"task_ack_wait": 2.0})
    gate, entered = asyncio.Event(), asyncio.Event()
    async with (
        job_agent(settings, gate, entered),
        served(settings, sse_ping=0.05) as (url, deps),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        r = await http.post("/v1/tasks", json={"capability": "demo.job", "payload": {"hold": True}})
        task_id = r.json()["task_id"]
        await asyncio.wait_for(entered.wait(), 30)
        nc = deps.client.nc
        before = len(nc._subs)  # the gateway's NATS subscriptions (nats-py keeps them here)
        async with http.stream("GET", f"/v1/tasks/{task_id}/events") as stream:
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("event: state"):
                pass
            assert len(nc._subs) > before  # the stream follows the record: a KV watch
        # hung up with the task still running: the watch stops
        await eventually(lambda: len(nc._subs) == before, timeout=30)
        assert deps.streams.open == 0
        gate.set()


async def test_event_streams_are_capped_across_tasks_and_a2a(reach_settings):
    settings = reach_settings.model_copy(update={"task_ack_wait": 2.0})
    gate, entered = asyncio.Event(), asyncio.Event()
    async with (
        job_agent(settings, gate, entered),
        served(settings, edge=True, max_streams=1) as (url, deps),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        try:
            await streams_capped(http, deps, entered)
        finally:
            gate.set()  # the task ends, and any stream still open with it


async def streams_capped(http: httpx.AsyncClient, deps: EdgeDeps, entered: asyncio.Event):
    r = await http.post("/v1/tasks", json={"capability": "demo.job", "payload": {"hold": True}})
    task_id = r.json()["task_id"]
    await asyncio.wait_for(entered.wait(), 30)
    events = f"/v1/tasks/{task_id}/events"
    a2a = {"A2A-Version": "1.0"}
    subscribe = {"jsonrpc": "2.0", "id": 1, "method": "SubscribeToTask", "params": {"id": task_id}}
    async with http.stream("GET", events) as stream:
        # held, not left to the garbage collector, which would close the connection
        lines = stream.aiter_lines()
        while not (await anext(lines)).startswith("event: state"):
            pass
        assert deps.streams.open == 1
        # another client: this one's connection is busy with the stream
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=30) as other:
            r = await other.get(events)
            err = error_of(r)
            assert (r.status_code, err["code"], err["retryable"]) == (
                503,
                "resource_exhausted",
                True,
            )
            assert r.headers["retry-after"] == "1"
            r = await other.post("/a2a/worker", json=subscribe, headers=a2a)
            assert (r.status_code, r.headers["retry-after"]) == (503, "1")
        assert deps.streams.refused == 2
    await eventually(lambda: deps.streams.open == 0)
    # the slot is free again, for either kind
    async with (
        httpx.AsyncClient(base_url=str(http.base_url), timeout=30) as other,
        other.stream("POST", "/a2a/worker", json=subscribe, headers=a2a) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        while not (await anext(lines)).startswith("data:"):
            pass  # then the task as it is: its watch follows
        await eventually(lambda: deps.streams.open == 1)
    await eventually(lambda: deps.streams.open == 0)


async def start_gateway(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "gateway",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )


async def test_the_reach_gateway_command_serves_until_sigterm(reach_settings: ReachSettings):
    env = {
        "REACH_NATS_URL": reach_settings.nats_url,
        "REACH_SUBJECT_PREFIX": reach_settings.subject_prefix,
        "REACH_GATEWAY_TOKENS": json.dumps({"t" * 24: ["call"]}),
    }
    proc = await start_gateway("--port", "0", env=env)
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(30):
            while True:
                line = (await proc.stderr.readline()).decode()
                assert line, "the gateway exited before it listened"
                if line.startswith("# gateway on http://"):
                    break
        url = line.split()[3]
        assert "1 tokens" in line
        async with echo_agent(reach_settings, "echo-1"), httpx.AsyncClient(base_url=url) as http:
            headers = {"Authorization": "Bearer " + "t" * 24}
            r = await http.post("/v1/capabilities/demo.echo", json={}, headers=headers)
            assert (r.status_code, r.json()["agent_id"]) == (200, "echo-1")
            assert (await http.post("/v1/capabilities/demo.echo")).status_code == 401
            cards = await http.get("/a2a/", headers=headers)  # and A2A, with the tokens
            assert (cards.status_code, cards.json()) == (200, {"agents": []})
            assert (await http.get("/a2a/")).status_code == 401
            page = await http.get("/")  # the status page is served at the root
            assert (page.status_code, page.headers["content-type"]) == (
                200,
                "text/html; charset=utf-8",
            )
            # an open event stream ends when the command stops (not after a grace period)
            async with http.stream("GET", "/v1/status/events", headers=headers) as stream:
                chunks = stream.aiter_bytes()
                assert b"retry:" in await anext(chunks)
                proc.send_signal(signal.SIGTERM)
                async with asyncio.timeout(30):
                    async for _ in chunks:
                        pass
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await proc.wait()
    assert proc.returncode == 0


async def test_the_command_will_not_serve_open_beyond_loopback(reach_settings: ReachSettings):
    proc = await start_gateway(
        "--host", "0.0.0.0", "--port", "0", env={"REACH_NATS_URL": reach_settings.nats_url}
    )
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "REACH_GATEWAY_TOKENS" in err.decode()
