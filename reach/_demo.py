"""``reach demo``: a customer-service desk on an embedded nats-server, start to finish."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from typing import Any

import msgspec

from ._agent import Agent
from ._client import Client
from ._handlers import Context
from ._server import NatsServer
from ._wait import eventually
from .errors import CapabilityNotFound, ResourceExhausted
from .settings import ReachSettings


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


async def run_demo() -> int:
    with NatsServer() as server:
        settings = ReachSettings(nats_url=server.url, timeout_ms=3000)
        _line(f"nats-server {server.url} (pid {server.pid}, JetStream in a temp dir)")
        heard: Counter[str] = Counter()
        agents = build_agents(settings, heard)
        for agent in agents:
            await agent.start()
            caps = ", ".join(c.name for c in agent.capabilities)
            _line(f"  started {agent.agent_id:<14} serving {caps}")
        async with Client(settings=settings, name="demo-desk") as client:
            found = await _discover(client)
            _line(f"\n$SRV.PING (standard NATS tooling) sees: {', '.join(sorted(found))}")

            _line("\nCustomers ask the front desk (support.ask):")
            for q in QUESTIONS:
                reply = await client.call("support.ask", q)
                v = reply.value
                via = f" -> {v['served_by']}" if "served_by" in v else ""
                _line(
                    f"  {q.customer:<4} {q.text!r:<38} {v['intent']:<18}{via:<17}"
                    f" {reply.latency_ms:6.1f} ms"
                )

            _line("\n40 tracking requests at once, shared by the two logistics instances:")
            served: Counter[str] = Counter()
            latencies: list[float] = []
            busy = 0

            async def one(i: int) -> None:
                nonlocal busy
                try:
                    r = await client.call("logistics.track", OrderRef(order_id=f"B-{i}"))
                except ResourceExhausted:
                    busy += 1
                    return
                served[r.agent_id] += 1
                latencies.append(r.latency_ms)

            await asyncio.gather(*(one(i) for i in range(40)))
            for agent_id, n in sorted(served.items()):
                _line(f"  {agent_id:<12} served {n}")
            _line(
                f"  p50 {statistics.median(latencies):.1f} ms, max {max(latencies):.1f} ms,"
                f" {busy} refused as resource_exhausted (queues full)"
            )

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

            try:
                await client.request("billing.invoice", {})
            except CapabilityNotFound as exc:
                _line(f"\nA capability nobody serves fails fast: {exc}")

        for agent in agents:
            await agent.stop()
        _line("\nAll agents drained and stopped; server stopped. Demo OK.")
    return 0


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
