"""``reach mcp`` (issue 24) with the MCP SDK's own client, over stdio and over streamable
HTTP, in both eras of the protocol (the initialize handshake, and 2026-07-28): it lists the
demo fleet's tools, calls one, gets a typed error, runs a durable task with progress, and
sees the list change when an agent leaves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("mcp", reason="reach mcp needs: pip install 'agent-reach-nats[mcp]'")

import httpx2
import mcp_types as types
from mcp import Client as McpClient
from mcp import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from reach import Agent, Client, ReachSettings, Registry
from reach.testing import eventually

from ..demo_fleet import CAPABILITIES, TASKS, demo_fleet, listed
from .registry_wire import fast_settings
from .test_fleet_view import reach_cli

CALL_TOKEN = "c" * 24
ADMIN_TOKEN = "a" * 24
TOKENS = f'{{"{CALL_TOKEN}": ["call"], "{ADMIN_TOKEN}": ["admin"]}}'


@pytest.fixture
def settings(nats_server: Any) -> ReachSettings:
    return fast_settings(nats_server.url)


def reach_env(settings: ReachSettings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    return env | {
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        **extra,
    }


class Changes:
    """When the server says the tool list changed, in either era."""

    def __init__(self) -> None:
        self.count = 0

    async def on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self.count += 1

    @contextlib.asynccontextmanager
    async def listening(self, client: McpClient) -> AsyncIterator[None]:
        """2026-07-28: a subscriptions/listen stream; the handshake era needs none."""
        if client.protocol_version == "2026-07-28":
            async with client.listen(tools_list_changed=True) as sub:

                async def drain() -> None:
                    async for _ in sub:
                        self.count += 1

                task = asyncio.create_task(drain())
                try:
                    yield
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        else:
            yield


@contextlib.asynccontextmanager
async def mcp_over_stdio(
    settings: ReachSettings, mode: str, changes: Changes
) -> AsyncIterator[McpClient]:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "reach.cli", "mcp"], env=reach_env(settings)
    )
    async with McpClient(params, mode=mode, message_handler=changes.on_message) as client:
        yield client


@contextlib.asynccontextmanager
async def mcp_over_http(
    settings: ReachSettings, mode: str, changes: Changes, token: str = ADMIN_TOKEN
) -> AsyncIterator[McpClient]:
    async with reach_mcp_http(settings) as url:
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http,
            McpClient(
                streamable_http_client(url, http_client=http),
                mode=mode,
                message_handler=changes.on_message,
            ) as client,
        ):
            yield client


@contextlib.asynccontextmanager
async def reach_mcp_http(settings: ReachSettings, *args: str) -> AsyncIterator[str]:
    """``reach mcp --http --port 0`` with tokens; the URL from its banner."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "mcp",
        "--http",
        "--port",
        "0",
        *args,
        stderr=asyncio.subprocess.PIPE,
        env=reach_env(settings, REACH_GATEWAY_TOKENS=TOKENS),
    )
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(30):
            while not (line := (await proc.stderr.readline()).decode()).startswith("# mcp"):
                assert line, "reach mcp ended before serving"
        found = re.search(r"(http://\S+/mcp)", line)
        assert found is not None, line
        yield found.group(1)
    finally:
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()


def logistics(agents: list[Agent]) -> Agent:
    return next(a for a in agents if a.name == "logistics")


@pytest.mark.parametrize("mode", ["legacy", "auto"])
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_an_mcp_client_lists_calls_and_follows_the_demo_fleet(
    settings: ReachSettings, transport: str, mode: str
) -> None:
    changes = Changes()
    connect = mcp_over_stdio if transport == "stdio" else mcp_over_http
    async with demo_fleet(settings) as agents, connect(settings, mode, changes) as client:
        assert (client.protocol_version == "2026-07-28") is (mode == "auto")
        assert client.server_capabilities.tools is not None
        async with changes.listening(client):
            listed = await client.list_tools()
            tools = {t.name: t for t in listed.tools}
            assert sorted(tools) == sorted(CAPABILITIES + TASKS)
            track = tools["logistics.track"]
            assert track.description == "where is an order"
            assert track.input_schema["type"] == "object"
            assert track.input_schema["required"] == ["order_id"]
            reroute = tools["logistics.reroute"]
            assert set(reroute.input_schema["properties"]) == {"payload", "wait"}

            # a call routes like client.request
            result = await client.call_tool("logistics.track", {"order_id": "A-1"})
            assert not result.is_error, result
            assert result.structured_content is not None
            assert result.structured_content["order_id"] == "A-1"
            assert result.structured_content["eta_days"] == 2

            # a Reach error is a tool error with its code
            refused = await client.call_tool("aftersales.refund", {"order_id": ""})
            assert refused.is_error
            assert refused.structured_content == {
                "error": {
                    "code": "bad_request",
                    "message": "aftersales.refund: order_id is empty",
                    "retryable": False,
                }
            }
            first = refused.content[0]
            assert isinstance(first, types.TextContent)
            assert first.text.startswith("bad_request: ")

            # a durable task: submit and wait, with progress from ctx.progress
            notes: list[tuple[float, str | None]] = []

            async def progress(done: float, total: float | None, message: str | None) -> None:
                notes.append((done, message))

            ran = await client.call_tool(
                "logistics.reroute",
                {"payload": {"order_id": "A-2"}},
                progress_callback=progress,
            )
            assert not ran.is_error, ran
            assert ran.structured_content is not None
            assert ran.structured_content["order_id"] == "A-2"
            assert ran.structured_content["booking"].startswith("BK-")
            assert notes[0][1] is not None
            assert notes[0][1].startswith("task ")
            assert any(note == "step 2 of 4" for _, note in notes), notes

            # ... or the task id at once, and the task as a resource
            queued = await client.call_tool(
                "logistics.reroute", {"payload": {"order_id": "A-3"}, "wait": False}
            )
            assert queued.structured_content is not None
            uri = queued.structured_content["uri"]
            assert uri == f"reach://tasks/{queued.structured_content['task_id']}"

            async def done() -> bool:
                read = await client.read_resource(uri, cache_mode="bypass")
                text = read.contents[0]
                assert isinstance(text, types.TextResourceContents)
                return '"state":"SUCCEEDED"' in text.text

            await eventually(done, timeout=30)

            # an agent leaves: its tools go, and the client is told
            await logistics(agents).stop()
            await eventually(lambda: changes.count > 0, timeout=30)
            listed = await client.list_tools(cache_mode="bypass")
            assert sorted(t.name for t in listed.tools) == ["aftersales.refund", "support.ask"]
            gone = await client.call_tool("logistics.track", {"order_id": "A-1"})
            assert gone.is_error
            assert gone.structured_content is not None
            assert gone.structured_content["error"]["code"] == "capability_not_found"


async def test_over_http_a_token_is_needed_and_its_scopes_count(
    settings: ReachSettings,
) -> None:
    changes = Changes()
    async with demo_fleet(settings):
        async with reach_mcp_http(settings, "--capability", "logistics.*") as url:
            async with httpx2.AsyncClient() as http:
                r = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "unauthorized"
                assert r.headers["www-authenticate"] == 'Bearer realm="reach"'
        async with mcp_over_http(settings, "auto", changes, token=CALL_TOKEN) as client:
            listed = await client.list_tools()
            assert sorted(t.name for t in listed.tools) == sorted(CAPABILITIES + TASKS)
            tracked = await client.call_tool("logistics.track", {"order_id": "A-1"})
            assert not tracked.is_error
            refused = await client.call_tool("logistics.reroute", {"payload": {"order_id": "A"}})
            assert refused.is_error
            assert refused.structured_content is not None
            assert refused.structured_content["error"]["code"] == "unauthorized"


async def test_reach_mcp_over_http_without_tokens_stays_on_loopback(
    settings: ReachSettings,
) -> None:
    code, _, err = await reach_cli(settings, "mcp", "--http", "--host", "0.0.0.0")
    assert code == 2
    assert "no REACH_GATEWAY_TOKENS set and host '0.0.0.0' is not loopback" in err


async def test_a_task_tool_waits_at_most_task_wait_then_answers_with_the_task_id(
    settings: ReachSettings,
) -> None:
    """docs/mcp.md: a task tool called with ``wait`` waits at most ``--task-wait`` seconds
    (300 by default), then answers with the task id while the task goes on. The task here
    runs until the test lets it end, so only the option ends the wait: the call must
    answer within 30 s (the hang guard), and not before the second it was given."""
    hold = asyncio.Event()
    agent = Agent("holder", settings=settings)

    @agent.task("hold.task")
    async def held(payload: dict) -> dict:
        await hold.wait()
        return {"done": True}

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "reach.cli", "mcp", "--task-wait", "1"],
        env=reach_env(settings),
    )
    async with Registry(settings=settings), agent, Client(settings=settings) as client:
        await listed(client, agent)
        async with McpClient(params, mode="legacy") as mcp:

            async def offered() -> bool:
                tools = await mcp.list_tools(cache_mode="bypass")
                return "hold.task" in {t.name for t in tools.tools}

            await eventually(offered, timeout=30)
            loop = asyncio.get_running_loop()
            began = loop.time()
            async with asyncio.timeout(30):
                ran = await mcp.call_tool("hold.task", {"payload": {}})
            took = loop.time() - began
            assert not ran.is_error, ran
            assert ran.structured_content is not None
            task_id = ran.structured_content["task_id"]
            assert ran.structured_content["uri"] == f"reach://tasks/{task_id}"
            assert ran.structured_content["state"] in ("PENDING", "RUNNING")
            first = ran.content[0]
            assert isinstance(first, types.TextContent)
            assert "after 1s; it goes on" in first.text
            assert took >= 1.0
            hold.set()
            assert await (await client.task(task_id)).result(timeout=30) == {"done": True}
