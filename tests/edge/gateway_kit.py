"""What the gateway tests share: a fleet of in-process agents on the session nats-server,
and the gateway app in front of a real client, reached with httpx over ASGI (no socket)
or through a real uvicorn on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn

import reach
from reach import Agent, Client, Context, ReachSettings
from reach._gateway import EdgeDeps, GatewaySettings, build_app
from reach._gateway.edge import build_edge
from reach.testing import eventually

CALL = "c" * 20  # tokens of the auth tests, one per scope set
SUBMIT = "s" * 20
ADMIN = "a" * 20
TOKENS = {CALL: ["call"], SUBMIT: ["submit"], ADMIN: ["admin"]}


class Busy(reach.RemoteError):
    code = "busy_now"
    status = 503
    retryable = True


def echo_agent(
    settings: ReachSettings,
    agent_id: str,
    gate: asyncio.Event | None = None,
    entered: asyncio.Event | None = None,
    **kw: Any,
) -> Agent:
    """``demo.echo`` (1.2, tag ``eu``), answering with what it got, or refusing on demand;
    ``{"do": "wait"}`` sets ``entered`` and holds until ``gate`` is set."""
    agent = Agent("echo", agent_id, settings=settings, tags=["eu"], **kw)
    gate = gate or asyncio.Event()
    entered = entered or asyncio.Event()

    @agent.capability("demo.echo", version="1.2", description="says it back")
    async def echo(payload: Any, ctx: Context) -> Any:
        match payload:
            case {"do": "refuse"}:
                raise reach.BadRequest("cannot echo that")
            case {"do": "busy"}:
                raise Busy("come back later")
            case {"do": "boom"}:
                raise RuntimeError("secret internal detail")
            case {"do": "wait"}:
                entered.set()
                await gate.wait()
        return {"echo": payload, "by": ctx.agent_id}

    return agent


@contextlib.asynccontextmanager
async def asgi(
    client: Client, *, headers: dict[str, str] | None = None, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, EdgeDeps]]:
    """The gateway app over httpx's ASGI transport (the client connected by the caller);
    ``headers`` go with every request."""
    deps = EdgeDeps(client, GatewaySettings(**settings))
    app = build_app(deps)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://127.0.0.1:8080", headers=headers
    ) as http:
        yield http, deps


@contextlib.asynccontextmanager
async def served(
    reach_settings: ReachSettings, *, edge: bool = False, **settings: Any
) -> AsyncIterator[tuple[str, EdgeDeps]]:
    """The gateway on a real uvicorn (loopback, a free port), owning its client through
    the app's lifespan: connected at startup, closed at shutdown. ``edge``: the whole
    edge (``build_edge``: the page and A2A too), as ``reach gateway`` serves it."""
    deps = EdgeDeps(Client(settings=reach_settings, name="gw"), GatewaySettings(**settings))
    app = build_edge(deps, manage_client=True).app if edge else build_app(deps, manage_client=True)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_config=None)
    server = uvicorn.Server(config)
    sock = config.bind_socket()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: server.started or task.done())
        assert server.started, "uvicorn did not start"
        port = sock.getsockname()[1]
        yield f"http://127.0.0.1:{port}", deps
    finally:
        server.should_exit = True
        await task
        sock.close()


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert {"code", "message", "retryable"} <= set(err), err
    return err


def job_agent(
    settings: ReachSettings, gate: asyncio.Event | None = None, entered: asyncio.Event | None = None
) -> Agent:
    """Durable ``demo.job``: reports progress, answers ``{"done": payload}``; a payload
    with ``"hold": true`` sets ``entered`` and waits for ``gate`` (or a cancel)."""
    agent = Agent("worker", "worker-1", settings=settings)
    gate = gate or asyncio.Event()
    entered = entered or asyncio.Event()

    @agent.task("demo.job", description="a durable job")
    async def job(payload: Any, ctx: reach.TaskContext) -> Any:
        if isinstance(payload, dict) and payload.get("hold"):
            entered.set()
            await gate.wait()
        await ctx.progress(0.5, "half way")
        return {"done": payload}

    return agent


def parse_sse(text: str) -> list[tuple[str, Any]]:
    """(event, data) of each event in a text/event-stream body; comments skipped."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":")
        )
        if "event" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out
