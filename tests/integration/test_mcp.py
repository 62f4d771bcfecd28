"""``reach mcp`` (issue 24) with the MCP SDK's own client, over stdio and over streamable
HTTP, in both eras of the protocol (the initialize handshake, and 2026-07-28): it lists the
demo fleet's tools, calls one, gets a typed error, runs a durable task with progress, and
sees the list change when an agent leaves. Then, with the server in this process (the
SDK's in-memory transport, or uvicorn on a free port): streaming capabilities, which
connections hear of changes and for how long, the choice of tools, the resource's errors;
and the command's edges: a selection that matches nothing, a port that is taken, Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("mcp", reason="reach mcp needs: pip install 'agent-reach-nats[mcp]'")

import httpx2
import mcp_types as types
import uvicorn
from mcp import Client as McpClient
from mcp import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from reach import Agent, Client, ReachSettings, Registry
from reach._contracts.mcp_server import TASK_URI, FleetServer
from reach._tokens import Tokens
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
    async with reach_mcp_http(settings) as url, http_client(url, mode, changes, token) as client:
        yield client


@contextlib.asynccontextmanager
async def http_client(
    url: str, mode: str, changes: Changes | None = None, token: str = ADMIN_TOKEN
) -> AsyncIterator[McpClient]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http,
        McpClient(
            streamable_http_client(url, http_client=http),
            mode=mode,
            message_handler=changes.on_message if changes is not None else None,
        ) as client,
    ):
        yield client


@contextlib.asynccontextmanager
async def reach_mcp_http(settings: ReachSettings, *args: str) -> AsyncIterator[str]:
    """``reach mcp --http --port 0`` with tokens; the URL from its banner."""
    async with reach_mcp_http_process(settings, *args) as (_, url):
        yield url


@contextlib.asynccontextmanager
async def reach_mcp_http_process(
    settings: ReachSettings, *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """``reach mcp --http --port 0`` with tokens: the process, and the URL from its banner
    (the rest of its stderr is left to read)."""
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
        yield proc, found.group(1)
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
            values = [done for done, _ in notes]
            assert all(a < b for a, b in itertools.pairwise(values)), notes

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


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_over_http_a_token_is_needed_and_its_scopes_count(
    settings: ReachSettings, mode: str
) -> None:
    """No token: 401 with the challenge. A token lists the tools it may call (a call-only
    token sees no task tool, nor the task resource, and may not read a task: an
    ``unauthorized`` error, not an internal one); ``--capability`` chooses the names."""
    async with (
        demo_fleet(settings),
        reach_mcp_http(settings, "--capability", "logistics.*") as url,
    ):
        async with httpx2.AsyncClient() as http:
            r = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
            assert r.status_code == 401
            assert r.json()["error"] == {
                "code": "unauthorized",
                "message": "a bearer token is required",
            }
            assert r.headers["www-authenticate"] == 'Bearer realm="reach"'
        async with http_client(url, mode, token=ADMIN_TOKEN) as admin:
            listed = await admin.list_tools()
            assert sorted(t.name for t in listed.tools) == ["logistics.reroute", "logistics.track"]
            templates = await admin.list_resource_templates()
            assert [t.uri_template for t in templates.resource_templates] == [TASK_URI]
        async with http_client(url, mode, token=CALL_TOKEN) as client:
            listed = await client.list_tools()
            assert [t.name for t in listed.tools] == ["logistics.track"]
            templates = await client.list_resource_templates()
            assert templates.resource_templates == []
            tracked = await client.call_tool("logistics.track", {"order_id": "A-1"})
            assert not tracked.is_error
            refused = await client.call_tool("logistics.reroute", {"payload": {"order_id": "A"}})
            assert refused.is_error
            assert refused.structured_content is not None
            assert refused.structured_content["error"]["code"] == "unauthorized"
            with pytest.raises(MCPError) as read:
                await client.read_resource("reach://tasks/some-task")
            assert read.value.code == types.INVALID_REQUEST
            assert read.value.data["code"] == "unauthorized"


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


# -- the server in this process ---------------------------------------------------------


class QuietServer(uvicorn.Server):
    """uvicorn in a test: the test process's signals stay the test's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@contextlib.asynccontextmanager
async def served_over_http(fleet: FleetServer) -> AsyncIterator[str]:
    """``fleet`` over streamable HTTP on uvicorn in this process, on a free port; its URL."""
    app = fleet.http_app(host="127.0.0.1", tokens=Tokens({}))
    server = QuietServer(uvicorn.Config(app, log_config=None, lifespan="on"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            await eventually(lambda: server.started, timeout=30)
            yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
        finally:
            fleet.stop_requests()
            server.should_exit = True
            async with asyncio.timeout(30):
                await serving


def talker(settings: ReachSettings) -> Agent:
    """An agent whose capabilities answer in chunks."""
    agent = Agent("talker", settings=settings)

    @agent.capability("talk.words")
    async def words(text: str) -> AsyncIterator[str]:
        """Say it word by word."""
        for word in text.split():
            yield word + " "

    @agent.capability("talk.rows")
    async def rows(n: int) -> AsyncIterator[dict[str, int]]:
        for i in range(n):
            yield {"row": i}

    return agent


def greeter(settings: ReachSettings, name: str) -> Agent:
    agent = Agent(name, settings=settings)

    @agent.capability(f"{name}.greet")
    async def greet(who: str) -> str:
        return f"hello {who}"

    return agent


async def test_a_streaming_capability_is_a_tool_whose_chunks_come_as_progress(
    settings: ReachSettings,
) -> None:
    """A capability that streams is called with ``client.stream``: each chunk is a progress
    notification (1, 2, 3..., the chunk's text the message) as it comes, and the result is
    the chunks as one text when every chunk is text, else their list."""
    agent = talker(settings)
    async with Registry(settings=settings), agent, Client(settings=settings) as client:
        await listed(client, agent)
        async with FleetServer(client) as fleet, McpClient(fleet.server, mode="legacy") as mcp:
            tools = {t.name: t for t in (await mcp.list_tools()).tools}
            assert tools["talk.words"].meta is not None
            assert tools["talk.words"].meta["reach/kind"] == "stream"
            notes: list[tuple[float, str | None]] = []

            async def progress(done: float, total: float | None, message: str | None) -> None:
                notes.append((done, message))

            said = await mcp.call_tool(
                "talk.words", {"payload": "thanks for waiting"}, progress_callback=progress
            )
            assert not said.is_error, said
            text = said.content[0]
            assert isinstance(text, types.TextContent)
            assert text.text == "thanks for waiting "
            assert notes == [(1.0, "thanks "), (2.0, "for "), (3.0, "waiting ")]
            rows = await mcp.call_tool("talk.rows", {"payload": 2})
            assert not rows.is_error, rows
            assert rows.structured_content == {"chunks": [{"row": 0}, {"row": 1}]}


async def test_capability_globs_and_tags_choose_the_tools(settings: ReachSettings) -> None:
    """``--capability`` globs (any of them) and ``--tag`` (every one, on the instance)."""
    chosen = [
        (("logistics.*",), (), ["logistics.reroute", "logistics.track"]),
        (("*.refund", "support.*"), (), ["aftersales.refund", "support.ask"]),
        ((), ("eu",), ["logistics.reroute", "logistics.track"]),
        ((), ("frontdesk",), ["support.ask"]),
        (("logistics.*",), ("frontdesk",), []),
    ]
    async with demo_fleet(settings), Client(settings=settings) as client:
        for names, tags, tools in chosen:
            async with (
                FleetServer(client, names=names, tags=tags) as fleet,
                McpClient(fleet.server, mode="legacy") as mcp,
            ):
                listed = await mcp.list_tools()
                assert sorted(t.name for t in listed.tools) == tools, (names, tags)


@pytest.mark.parametrize(("mode", "code"), [("legacy", -32002), ("auto", types.INVALID_PARAMS)])
async def test_a_resource_that_is_not_there_has_the_code_of_the_protocol_version(
    settings: ReachSettings, mode: str, code: int
) -> None:
    """A task that is not there: -32002 before 2026-07-28, INVALID_PARAMS since (SEP-2164),
    with the URI as the error's data."""
    async with (
        Client(settings=settings) as client,
        FleetServer(client) as fleet,
        McpClient(fleet.server, mode=mode) as mcp,
    ):
        for uri in ("reach://tasks/no-such-task", "reach://elsewhere/x"):
            with pytest.raises(MCPError) as missing:
                await mcp.read_resource(uri, cache_mode="bypass")
            assert missing.value.code == code
            assert missing.value.data == {"uri": uri}


async def test_the_stdio_connection_hears_of_changes_however_long_it_was_silent(
    settings: ReachSettings,
) -> None:
    """The stdio connection lasts as long as the process serves it: a host that listed the
    tools once, then stays silent past the idle time of HTTP sessions, is still told."""
    idle, now = 0.05, [0.0]
    first, second = greeter(settings, "first"), greeter(settings, "second")
    changes = Changes()
    async with Registry(settings=settings), first, Client(settings=settings) as client:
        await listed(client, first)
        async with (
            FleetServer(client, session_idle=idle, clock=lambda: now[0]) as fleet,
            McpClient(fleet.server, mode="legacy", message_handler=changes.on_message) as mcp,
        ):
            assert [t.name for t in (await mcp.list_tools()).tools] == ["first.greet"]
            now[0] += 4 * idle  # silent past the idle time: the test
            async with second:
                await eventually(lambda: changes.count > 0, timeout=30)
            assert fleet.sessions == 1


async def test_an_http_session_hears_of_changes_while_it_lasts_and_is_forgotten_after(
    settings: ReachSettings,
) -> None:
    """An HTTP session that listed the tools is told of changes as long as the SDK keeps it
    (here: its event stream stays open, well past the idle time), however long it sends
    nothing; the session its client ends is forgotten at once."""
    idle = 0.3
    first, second = greeter(settings, "first"), greeter(settings, "second")
    changes = Changes()
    async with Registry(settings=settings), first, Client(settings=settings) as client:
        await listed(client, first)
        async with (
            FleetServer(client, session_idle=idle) as fleet,
            served_over_http(fleet) as url,
        ):
            async with http_client(url, "legacy", changes) as mcp:
                assert [t.name for t in (await mcp.list_tools()).tools] == ["first.greet"]
                called = await mcp.call_tool("first.greet", {"payload": "ada"})
                assert not called.is_error, called
                await asyncio.sleep(4 * idle)  # silent past the idle time: the test
                async with second:
                    await eventually(lambda: changes.count > 0, timeout=30)
                    now = await mcp.list_tools(cache_mode="bypass")
                    assert sorted(t.name for t in now.tools) == ["first.greet", "second.greet"]
                assert fleet.sessions == 1
            await eventually(lambda: fleet.sessions == 0, timeout=30)


# -- the command's edges ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def reach_mcp_stdio(settings: ReachSettings, *args: str) -> AsyncIterator[Any]:
    """``reach mcp`` over stdio, its stdin held open by the test; the process and the
    stderr lines before its "mcp server on stdio" line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "mcp",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=reach_env(settings),
    )
    try:
        assert proc.stderr is not None
        before: list[str] = []
        async with asyncio.timeout(30):
            while "mcp server on stdio" not in (line := (await proc.stderr.readline()).decode()):
                assert line, f"reach mcp ended before serving: {before}"
                before.append(line.rstrip("\n"))
        yield proc, before
    finally:
        if proc.returncode is None:
            proc.kill()
        async with asyncio.timeout(30):
            await proc.wait()


async def test_a_glob_that_matches_nothing_served_is_said_once(settings: ReachSettings) -> None:
    async with (
        demo_fleet(settings),
        reach_mcp_stdio(settings, "--capability", "nomatch.*", "--capability", "logistics.*") as (
            proc,
            before,
        ),
    ):
        assert [line for line in before if line.startswith("#")] == [
            "# nothing served now matches --capability 'nomatch.*': serving all the same (the"
            " tools follow the fleet)"
        ]
        proc.stdin.close()  # the host goes: the server ends, as it should
        async with asyncio.timeout(30):
            assert await proc.wait() == 0


async def test_ctrl_c_stops_reach_mcp_over_stdio_while_stdin_stays_open(
    settings: ReachSettings,
) -> None:
    """The SDK reads stdin in a thread that no cancellation reaches: Ctrl-C ends the server
    all the same, within a bound (the hang guard), with one line and status 130."""
    async with reach_mcp_stdio(settings) as (proc, _):
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            rest = await proc.stderr.read()
            assert await proc.wait() == 130
    assert rest.decode().splitlines() == ["# mcp server stopped (SIGINT)"]


async def test_ctrl_c_stops_reach_mcp_over_http_with_every_answer_complete(
    settings: ReachSettings,
) -> None:
    """With a session's event stream open and a call waiting, Ctrl-C ends every answer
    before the server stops: no "ASGI callable returned without completing response", no
    traceback; one line, status 130."""
    began, hold = asyncio.Event(), asyncio.Event()
    agent = Agent("holder", settings=settings)

    @agent.task("hold.task")
    async def held(payload: dict[str, Any]) -> dict[str, Any]:
        began.set()
        await hold.wait()
        return {}

    async with Registry(settings=settings), agent, Client(settings=settings) as client:
        await listed(client, agent)
        async with reach_mcp_http_process(settings) as (proc, url):
            assert proc.stderr is not None
            async with http_client(url, "legacy") as mcp:
                assert "hold.task" in {t.name for t in (await mcp.list_tools()).tools}
                calling = asyncio.create_task(mcp.call_tool("hold.task", {"payload": {}}))
                try:
                    async with asyncio.timeout(30):
                        await began.wait()
                    proc.send_signal(signal.SIGINT)
                    async with asyncio.timeout(30):
                        rest = (await proc.stderr.read()).decode()
                        code = await proc.wait()
                finally:
                    calling.cancel()  # whatever the client makes of it, it ends here
                    await asyncio.gather(calling, return_exceptions=True)
        hold.set()  # the task ends: the agent stops without waiting for it
    assert code == 130
    assert "ASGI callable returned without completing response" not in rest
    assert "Traceback" not in rest
    assert rest.splitlines()[-1] == "# mcp server stopped (SIGINT)"


async def test_reach_mcp_over_http_refuses_a_port_that_is_taken(settings: ReachSettings) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = await reach_cli(settings, "mcp", "--http", "--port", str(port))
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        f"error: bad_request: cannot listen on 127.0.0.1:{port}: the port is taken (another"
        " server runs there?): stop it, or pass --port 0 for a free port"
    ]
