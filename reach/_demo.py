"""``reach demo``: a customer-service desk on an embedded nats-server, start to finish."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from ._agent import Agent, Context
from ._client import Client
from ._codec import encode_json
from ._registry import Registry
from ._server import NatsServer
from ._wait import eventually
from .errors import CapabilityNotFound, ReachError
from .settings import ReachSettings
from .wire import AgentEvent, Control


class Question(msgspec.Struct):
    customer: str
    text: str
    order_id: str = ""


class OrderRef(msgspec.Struct):
    order_id: str


QUESTIONS = [
    Question(customer="ada", text="Where is my parcel?", order_id="A-100"),
    Question(customer="bob", text="I want a refund for a broken mug", order_id="A-101"),
    Question(customer="cy", text="when will my order arrive", order_id="A-102"),
    Question(customer="dee", text="Refund please, wrong size", order_id="A-103"),
    Question(customer="eve", text="track my delivery", order_id="A-104"),
    Question(customer="fay", text="What are your opening hours?"),
]


def build_agents(settings: ReachSettings, heard: Counter[str]) -> list[Agent]:
    """The scenario's agents: intent routing to after-sales and two logistics instances."""
    intent = Agent("intent", "intent-1", tags=["frontdesk"], settings=settings)

    @intent.capability("support.ask", description="classify a question and route it")
    async def ask(q: Question, ctx: Context) -> dict[str, Any]:
        text = q.text.lower()
        if "refund" in text:
            target = "aftersales.refund"
        elif any(w in text for w in ("parcel", "track", "arrive", "delivery")):
            target = "logistics.track"
        else:
            return {"intent": "smalltalk", "answer": "We are open 9-17, Monday to Friday."}
        reply = await ctx.client.call(
            target, OrderRef(order_id=q.order_id), timeout=ctx.remaining() or 2.0
        )
        return {"intent": target, "served_by": reply.agent_id, "answer": reply.value}

    aftersales = Agent("aftersales", "aftersales-1", settings=settings)

    @aftersales.capability("aftersales.refund")
    async def refund(ref: OrderRef, ctx: Context) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        heard["published"] += 1
        await ctx.client.publish("order.status", {"order_id": ref.order_id, "status": "refunding"})
        return {"order_id": ref.order_id, "refund": "approved"}

    logistics = []
    for n in (1, 2):
        agent = Agent("logistics", f"logistics-{n}", max_concurrency=2, settings=settings)

        @agent.capability("logistics.track")
        async def track(ref: OrderRef, ctx: Context) -> dict[str, Any]:
            await asyncio.sleep(0.02)
            heard["published"] += 1
            await ctx.client.publish(
                "order.status", {"order_id": ref.order_id, "status": "in transit"}
            )
            return {"order_id": ref.order_id, "eta_days": 2}

        logistics.append(agent)

    def listen(agent: Agent) -> None:
        @agent.on_topic("order.*")
        async def on_status(update: dict[str, Any], topic: str) -> None:
            heard[agent.agent_id] += 1

    listen(intent)
    listen(aftersales)

    return [intent, aftersales, *logistics]


def _line(text: str = "") -> None:
    print(text, flush=True)


CRASHY_AGENT = """
import asyncio, os, sys, threading
from reach import Agent
# Exit with the demo, however the demo ends: our stdin closes when it does.
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
agent = Agent("logistics", "logistics-3", max_concurrency=2)

@agent.capability("logistics.track")
async def track(ref: dict) -> dict:
    await asyncio.sleep(0.02)
    return {"order_id": ref["order_id"], "eta_days": 3}

agent.run()
"""


async def run_demo() -> int:
    started = time.monotonic()

    def stamp() -> str:
        return f"[{time.monotonic() - started:5.2f}s]"

    with NatsServer() as server:
        # Short leases so the demo shows failure handling in seconds, not minutes.
        settings = ReachSettings(
            nats_url=server.url,
            timeout_ms=3000,
            heartbeat_interval=0.5,
            lease_ttl=2,
            probe_timeout=0.5,
            down_grace=2,
        )
        _line(f"nats-server {server.url} (pid {server.pid}, JetStream in a temp dir)")
        registry = Registry(settings=settings)
        await registry.start()
        _line(f"registry {registry.registry_id} keeps leases in KV bucket {registry.bucket_name}")
        heard: Counter[str] = Counter()
        agents = build_agents(settings, heard)
        async with Client(settings=settings, name="demo-desk") as client:
            seen: list[tuple[str, str]] = []
            events = await client.nc.subscribe(client.subjects.event("*"), cb=_printer(stamp, seen))
            await client.flush()
            _line("\nAgents start and register (status events from the registry):")
            for agent in agents:
                await agent.start()
            crashy = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CRASHY_AGENT,
                env={
                    **os.environ,
                    "REACH_NATS_URL": server.url,
                    "REACH_HEARTBEAT_INTERVAL": "0.5",
                    "REACH_LEASE_TTL": "2",
                },
                stdin=subprocess.PIPE,  # closes when the demo ends, however it ends
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await eventually(lambda: _known(client, 5), timeout=30)

            found = await _discover(client)
            _line(f"\n$SRV.PING (standard NATS tooling) sees: {', '.join(sorted(found))}")
            _line("\nThe routing table every client holds (pushed by a KV watch):")
            for r in await client.agents():
                caps = ", ".join(c.name for c in r.info.capabilities)
                _line(f"  {r.info.agent_id:<14} {r.status.value:<9} {caps}")

            _line("\nCustomers ask the front desk (support.ask):")
            for q in QUESTIONS:
                reply = await client.call("support.ask", q)
                v = reply.value
                via = f" -> {v['served_by']}" if "served_by" in v else ""
                _line(
                    f"  {q.customer:<4} {q.text!r:<38} {v['intent']:<18}{via:<17}"
                    f" {reply.latency_ms:6.1f} ms"
                )

            await _burst(client, "60 tracking requests at once, spread over three instances:")

            heard["published"] += 1
            await client.publish("order.status", {"order_id": "A-100", "status": "delivered"})
            await client.flush()
            await eventually(
                lambda: all(heard[a] == heard["published"] for a in ("intent-1", "aftersales-1"))
            )
            _line("\nBroadcast order.status updates heard (fan-out, every subscriber):")
            _line(f"  {heard['published']} published")
            for agent_id in ("intent-1", "aftersales-1"):
                _line(f"  {agent_id:<14} heard {heard[agent_id]}")

            _line(f"\n{stamp()} logistics-3 is killed (SIGKILL, pid {crashy.pid}):")
            crashy.kill()  # by PID
            await crashy.wait()
            await _burst(client, "requests keep being served meanwhile:")
            await eventually(lambda: ("logistics-3", "gone") in seen, timeout=30)

            _line(f"\n{stamp()} logistics-2 is drained (reach drain logistics-2):")
            await client.nc.request(
                client.subjects.ctl("logistics-2"),
                encode_json(Control(command="drain")),
                timeout=5,
            )
            drained = next(a for a in agents if a.agent_id == "logistics-2")
            await drained.wait_drain_requested()
            await drained.stop()
            await eventually(lambda: ("logistics-2", "gone") in seen, timeout=30)
            await _burst(client, "logistics-1 now takes everything:")

            try:
                await client.request("billing.invoice", {})
            except CapabilityNotFound as exc:
                _line(f"\nA capability nobody serves fails fast: {exc}")
            try:
                await client.request("logistics.track", {"order_id": "x"}, required_tags=["gpu"])
            except CapabilityNotFound as exc:
                _line(f"Asking for what no instance has says why: {exc}")
            await events.unsubscribe()

        for agent in agents:
            await agent.stop()
        await registry.stop()
        _line("\nAll agents drained and stopped; server stopped. Demo OK.")
    return 0


async def _known(client: Client, n: int) -> bool:
    return len(await client.agents()) >= n


def _printer(
    stamp: Callable[[], str], seen: list[tuple[str, str]]
) -> Callable[[Msg], Awaitable[None]]:
    async def show(msg: Msg) -> None:
        ev = msgspec.json.decode(msg.data, type=AgentEvent)
        old = ev.old.value if ev.old else "-"
        new = "gone" if ev.removed else ev.new.value
        seen.append((ev.agent_id, new))
        _line(f"  {stamp()} {ev.agent_id:<14} {old:>8} -> {new:<8} ({ev.reason})")

    return show


async def _burst(client: Client, title: str) -> None:
    _line(f"\n{title}")
    served: Counter[str] = Counter()
    latencies: list[float] = []
    failed: Counter[str] = Counter()

    async def one(i: int) -> None:
        try:
            r = await client.call("logistics.track", OrderRef(order_id=f"B-{i}"))
        except ReachError as exc:
            failed[exc.code] += 1
            return
        served[r.agent_id] += 1
        latencies.append(r.latency_ms)

    await asyncio.gather(*(one(i) for i in range(60)))
    _line("  " + ", ".join(f"{a} served {n}" for a, n in sorted(served.items())))
    fails = ", ".join(f"{n} {code}" for code, n in failed.items()) or "none failed"
    _line(f"  p50 {statistics.median(latencies):.1f} ms, max {max(latencies):.1f} ms; {fails}")


async def _discover(client: Client) -> set[str]:
    nc = client.nc
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.PING", b"", reply=inbox)
    found: set[str] = set()
    try:
        while True:
            msg = await sub.next_msg(timeout=0.3)
            found.add(msgspec.json.decode(msg.data)["id"])
    except Exception:
        pass
    await sub.unsubscribe()
    return found
