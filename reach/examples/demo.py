"""The customer-service desk of the example agents, start to finish, on an embedded nats-server.

    reach demo                (or python -m reach.examples.demo; `make demo` in a checkout)

It runs the example agents beside it (intent, aftersales, two logistics instances in this
process, a third as a separate process that gets killed) with a registry, and uses only the
public `reach` API. Leases are short so failure handling shows in seconds, not minutes.
"""

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from reach import (
    Agent,
    Batch,
    CapabilityNotFound,
    Client,
    ReachError,
    ReachSettings,
    Registry,
)
from reach.examples import aftersales, intent, logistics
from reach.testing import NatsServer, eventually
from reach.wire import AgentEvent, Control

QUESTIONS = [
    intent.Question(customer="ada", text="Where is my parcel?", order_id="A-100"),
    intent.Question(customer="bob", text="I want a refund for a broken mug", order_id="A-101"),
    intent.Question(customer="cy", text="when will my order arrive", order_id="A-102"),
    intent.Question(customer="dee", text="Refund please, wrong size", order_id="A-103"),
    intent.Question(customer="eve", text="track my delivery", order_id="A-104"),
    intent.Question(customer="fay", text="What are your opening hours?"),
]

# `python -m reach.examples.logistics` as its own process; it exits with the demo however
# the demo ends (its stdin is a pipe from us, closed when we end).
CRASHY = """
import os, runpy, sys, threading
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def line(text: str = "") -> None:
    print(text, flush=True)


class Desk:
    """What the demo watches: status events from the registry, order-status broadcasts."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.events: list[tuple[str, str]] = []
        self.heard: Counter[str] = Counter()
        self.delivered: set[str] = set()

    def stamp(self) -> str:
        return f"[{time.monotonic() - self.started:5.2f}s]"

    async def on_event(self, msg: Msg) -> None:
        ev = msgspec.json.decode(msg.data, type=AgentEvent)
        old = ev.old.value if ev.old else "-"
        new = "gone" if ev.removed else ev.new.value
        self.events.append((ev.agent_id, new))
        line(f"  {self.stamp()} {ev.agent_id:<14} {old:>8} -> {new:<8} ({ev.reason})")

    def listener(self, who: str) -> Callable[[dict[str, Any], str], Awaitable[None]]:
        async def hear(update: dict[str, Any], topic: str) -> None:
            self.heard[who] += 1
            if update.get("status") == "delivered":
                self.delivered.add(who)

        return hear

    async def on_broadcast(self, msg: Msg) -> None:
        await self.listener("desk")(msgspec.json.decode(msg.data), msg.subject)


def build_agents(settings: ReachSettings, desk: Desk) -> list[Agent]:
    return [
        intent.build(settings, "intent-1"),
        aftersales.build(settings, "aftersales-1", on_status=desk.listener("aftersales-1")),
        logistics.build(settings, "logistics-1", max_concurrency=2),
        logistics.build(settings, "logistics-2", max_concurrency=2),
    ]


async def main() -> int:
    desk = Desk()
    async with NatsServer() as server:
        settings = ReachSettings(
            nats_url=server.url,
            timeout_ms=3000,
            heartbeat_interval=0.5,
            lease_ttl=2,
            probe_timeout=0.5,
            down_grace=2,
            task_ack_wait=2,  # a dead instance's tasks come back within 2 s
        )
        line(f"nats-server {server.url} (pid {server.pid}, JetStream in a temp dir)")
        async with contextlib.AsyncExitStack() as stack:
            registry = await stack.enter_async_context(Registry(settings=settings))
            line(f"registry {registry.registry_id}, leases in KV bucket {registry.bucket_name}")
            client = await stack.enter_async_context(Client(settings=settings, name="demo-desk"))
            events = await client.nc.subscribe(client.subjects.event("*"), cb=desk.on_event)
            await client.nc.subscribe(client.subjects.topic("order.*"), cb=desk.on_broadcast)
            await client.flush()
            line("\nAgents start and register (status events from the registry):")
            agents = build_agents(settings, desk)
            for agent in agents:
                await agent.start()
                stack.push_async_callback(agent.stop)
            crashy = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CRASHY,
                logistics.__name__,
                "logistics-3",
                env={
                    **os.environ,
                    "REACH_NATS_URL": server.url,
                    "REACH_HEARTBEAT_INTERVAL": "0.5",
                    "REACH_LEASE_TTL": "2",
                    "REACH_TASK_ACK_WAIT": "2",
                },
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            stack.push_async_callback(end, crashy)
            stack.push_async_callback(events.unsubscribe)  # quiet while everything stops
            await scenario(client, agents, crashy, desk)
    line("\nAll agents drained and stopped; server stopped. Demo OK.")
    return 0


async def scenario(
    client: Client, agents: list[Agent], crashy: asyncio.subprocess.Process, desk: Desk
) -> None:
    async def known() -> bool:
        return len(await client.agents()) >= 5

    await eventually(known, timeout=30)
    found = await discover(client)
    line(f"\n$SRV.PING (standard NATS tooling) sees: {', '.join(sorted(found))}")
    line("\nThe routing table every client holds (pushed by a KV watch):")
    for r in await client.agents():
        caps = ", ".join(c.name for c in r.info.capabilities)
        line(f"  {r.info.agent_id:<14} {r.status.value:<9} {caps}")

    line("\nCustomers ask the front desk (support.ask):")
    for q in QUESTIONS:
        reply = await client.call("support.ask", q)
        v = reply.value
        via = f" -> {v['served_by']}" if "served_by" in v else ""
        line(
            f"  {q.customer:<4} {q.text!r:<38} {v['intent']:<18}{via:<17}"
            f" {reply.latency_ms:6.1f} ms"
        )

    await burst(client, "60 tracking requests at once, spread over three instances:")

    await client.publish("order.status", {"order_id": "A-100", "status": "delivered"})
    await client.flush()
    # Every earlier broadcast reached the server before this one, so whoever heard it
    # has heard them all.
    await eventually(lambda: desk.delivered == {"desk", "aftersales-1"})
    line("\nBroadcast order.status updates heard (fan-out, every subscriber):")
    for who in ("desk", "aftersales-1"):
        line(f"  {who:<14} heard {desk.heard[who]}")

    line("\n12 durable reroute tasks are submitted (logistics.reroute, 1 s of work each):")
    batch = await client.submit_batch(
        "logistics.reroute", [{"order_id": f"R-{i}"} for i in range(12)]
    )

    async def running_on_3() -> bool:
        running = await client.list_tasks(state="running", capability="logistics.reroute")
        return any(r.agent_id == "logistics-3" for r in running)

    await eventually(running_on_3, timeout=30)
    line(f"\n{desk.stamp()} logistics-3 is killed (SIGKILL, pid {crashy.pid}) mid-task:")
    crashy.kill()  # by PID
    await crashy.wait()
    await burst(client, "requests keep being served meanwhile:")
    await eventually(lambda: ("logistics-3", "gone") in desk.events, timeout=30)
    await tasks_report(batch)

    line(f"\n{desk.stamp()} logistics-2 is drained (reach drain logistics-2):")
    await client.nc.request(
        client.subjects.ctl("logistics-2"),
        msgspec.json.encode(Control(command="drain")),
        timeout=5,
    )
    await next(a for a in agents if a.agent_id == "logistics-2").stop()
    await eventually(lambda: ("logistics-2", "gone") in desk.events, timeout=30)
    await burst(client, "logistics-1 now takes everything:")

    try:
        await client.request("billing.invoice", {})
    except CapabilityNotFound as exc:
        line(f"\nA capability nobody serves fails fast: {exc}")
    try:
        await client.request("logistics.track", {"order_id": "x"}, required_tags=["gpu"])
    except CapabilityNotFound as exc:
        line(f"Asking for what no instance has says why: {exc}")
    metrics_report(client)


def metrics_report(client: Client) -> None:
    """What the desk's client counted, as Prometheus would scrape it (client.telemetry)."""
    shown = {
        "reach_client_requests_total": ("requests", ("capability", "outcome")),
        "reach_client_failovers_total": ("failovers", ("capability",)),
        "reach_client_tasks_finished_total": ("tasks", ("capability", "state")),
    }
    rows: dict[tuple[str, str], list[str]] = {}
    for family in client.telemetry.registry.collect():
        for sample in family.samples:
            if sample.name in shown and sample.value:
                what, labels = shown[sample.name]
                cap, *rest = (sample.labels[k] for k in labels)
                detail = f"{rest[0]} {sample.value:.0f}" if rest else f"{sample.value:.0f}"
                rows.setdefault((what, cap), []).append(detail)
    line("\nWhat the desk's client counted (its metrics, as /metrics would serve them):")
    for (what, cap), details in sorted(rows.items()):
        line(f"  {what:<10}{cap:<20}{', '.join(details)}")


async def tasks_report(batch: Batch) -> None:
    results = await batch.results(timeout=60)
    records = [await ref.status() for ref in batch.refs]
    by: Counter[str] = Counter(r["by"] for r in results if isinstance(r, dict))
    again = [r for r in records if len(r.attempts) > 1]
    finished = ", ".join(f"{a} finished {n}" for a, n in sorted(by.items()))
    line(f"\nThe {len(batch)} reroute tasks: {finished}")
    for rec in again:
        tries = " then ".join(f"{a.agent_id} ({a.outcome})" for a in rec.attempts)
        line(f"  {rec.task_id[-6:]} ran {len(rec.attempts)} times: {tries}")
    lost = len(batch) - batch.progress.done
    line(f"  {batch.progress.done} of {len(batch)} succeeded, {lost} lost")


async def burst(client: Client, title: str) -> None:
    line(f"\n{title}")
    served: Counter[str] = Counter()
    latencies: list[float] = []
    failed: Counter[str] = Counter()

    async def one(i: int) -> None:
        try:
            r = await client.call("logistics.track", {"order_id": f"B-{i}"})
        except ReachError as exc:
            failed[exc.code] += 1
            return
        served[r.agent_id] += 1
        latencies.append(r.latency_ms)

    await asyncio.gather(*(one(i) for i in range(60)))
    line("  " + (", ".join(f"{a} served {n}" for a, n in sorted(served.items())) or "none served"))
    fails = ", ".join(f"{n} {code}" for code, n in failed.items()) or "none failed"
    if latencies:
        line(f"  p50 {statistics.median(latencies):.1f} ms, max {max(latencies):.1f} ms; {fails}")
    else:
        line(f"  every request failed: {fails}")


async def discover(client: Client) -> set[str]:
    """Who answers the NATS services discovery ping, as `nats micro list` would ask."""
    nc = client.nc
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.PING", b"", reply=inbox)
    found: set[str] = set()
    try:
        while True:
            msg = await sub.next_msg(timeout=0.3)
            found.add(msgspec.json.decode(msg.data)["id"])
    except nats.errors.TimeoutError:
        pass  # no more answers
    await sub.unsubscribe()
    return found


async def end(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()  # by PID
        await proc.wait()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
