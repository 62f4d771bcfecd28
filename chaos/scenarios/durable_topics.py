"""10. Durable topics under load: a sensor publishes reports durably and steadily while the
instances of the agent name that must see every one (``chaos``, three processes subscribed
to ``chaos.report.>``) are SIGSTOPped, SIGKILLed and restarted, cut off behind a paused
proxy, and the nats-server itself is SIGKILLed and restarted on its store; a second name
(``archive``, in this process) subscribes to the same reports.

Goals: every report the server acknowledged is handled by the ``chaos`` name and by the
``archive`` name (0 lost; duplicates are allowed, and counted: at-least-once); a publish
that was not acknowledged raised a clear ``ReachError`` (``NotStored``); nothing was
dead-lettered.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from typing import Any

import reach
from reach.testing import NatsServer, eventually

from ..harness import AgentProc, Ledger, Result, known, settings_for
from ..proxy import Proxy
from ..tools_a import every, executions


class TopicAgent(AgentProc):
    """An agent process that also subscribes durably to ``chaos.report.>``."""

    def extra_env(self) -> dict[str, str]:
        s = self.settings
        return {
            "CHAOS_DURABLE_TOPIC": "1",
            "REACH_TOPIC_ACK_WAIT": str(s.topic_ack_wait),
            "REACH_TOPIC_MAX_DELIVER": str(s.topic_max_deliver),
            "REACH_TOPIC_RETRY_BASE": str(s.topic_retry_base),
            "REACH_TASK_PATIENCE": str(s.task_patience),
        }


class Sensor:
    """Publishes ``{"n": n}`` durably every ``pause`` seconds until stopped; knows which
    reports the server acknowledged and which publishes raised (and with what)."""

    def __init__(self, client: reach.Client, ledger: Ledger, pause: float = 0.005) -> None:
        self.client = client
        self.ledger = ledger
        self.pause = pause
        self.stored: set[int] = set()
        self.raised: set[int] = set()
        self.unclear: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Sensor:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.ledger.sent += 1
            began = time.perf_counter()
            try:
                await self.client.publish(f"chaos.report.{n % 8}", {"n": n}, durable=True)
            except reach.NotStored as exc:
                self.raised.add(n)
                self.ledger.refused(f"not_stored {exc.reason}")
            except reach.ReachError as exc:
                self.raised.add(n)
                self.ledger.refused(exc.code)
            except Exception as exc:  # not a ReachError: unclear, and counted as such
                self.raised.add(n)
                self.unclear[type(exc).__name__] = self.unclear.get(type(exc).__name__, 0) + 1
                self.ledger.refused("unclear")
            else:
                self.stored.add(n)
                step = int((time.perf_counter() - began) * 10_000)  # the ledger's p99: PubAcks
                self.ledger.latencies[step] = self.ledger.latencies.get(step, 0) + 1
            await asyncio.sleep(self.pause)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


def handled(runs: Path) -> dict[int, int]:
    """Per report, how many times the ``chaos`` name handled it."""
    return {int(r[1:]): len(v) for r, v in executions(runs).items() if r.startswith("r")}


async def run(work: Path, short: bool) -> Result:
    result = Result("durable_topics")
    ledger = Ledger()
    runs = work / "runs"
    phase, down = (2.0, 3.0) if short else (6.0, 10.0)
    archive_seen: dict[int, int] = {}
    async with NatsServer() as server:
        proxy = await Proxy(server.url).start()
        settings = settings_for(
            server.url,
            "chaos",
            topic_ack_wait=2.0,
            topic_max_deliver=20,
            topic_retry_base=0.1,
            task_patience=30.0,
        )
        behind = settings.model_copy(update={"nats_url": proxy.url})
        agents = [
            TopicAgent(settings, "alarm-0", runs),
            TopicAgent(settings, "alarm-1", runs),
            TopicAgent(behind, "alarm-2", runs),
        ]
        archive = reach.Agent("archive", settings=settings)

        @archive.on_topic("chaos.report.>", durable=True)
        async def keep(body: dict[str, Any]) -> None:
            archive_seen[body["n"]] = archive_seen.get(body["n"], 0) + 1

        try:
            async with (
                reach.Registry(settings=settings),
                reach.Client(settings=settings) as client,
                archive,
            ):
                for a in agents:
                    await a.start()
                try:
                    # UP in the table: registered, so their subscription exists
                    await eventually(lambda: known(client, "chaos.echo", 3), timeout=60)
                    sensor = Sensor(client, ledger).start()
                    try:
                        await asyncio.sleep(phase)
                        agents[0].signal(signal.SIGSTOP)  # hung, holding its messages
                        await asyncio.sleep(down)
                        agents[0].signal(signal.SIGCONT)
                        await asyncio.sleep(phase)
                        await agents[1].kill()  # dead mid-message
                        await asyncio.sleep(down)
                        await agents[1].start()
                        await asyncio.sleep(phase)
                        proxy.pause()  # a partition, then the connection goes
                        await asyncio.sleep(down)
                        proxy.cut()
                        proxy.resume()
                        await asyncio.sleep(phase)
                        await server.akill()  # the server itself, restarted on its store
                        await asyncio.sleep(down / 2)
                        await server.astart()
                        await asyncio.sleep(2 * phase)
                    finally:
                        await sensor.stop()
                    started = time.monotonic()

                    async def settled() -> bool:
                        done = handled(runs)
                        return all(n in done and n in archive_seen for n in sensor.stored)

                    with contextlib.suppress(TimeoutError):  # what is missing is reported
                        await eventually(every(0.5, settled), timeout=180)
                    took = time.monotonic() - started
                    letters = await client.dead_letters(topic="chaos.report.>")
                finally:
                    for a in agents:
                        await a.stop()
        finally:
            await proxy.close()

    done = handled(runs)
    stored = sensor.stored
    missing = sorted(n for n in stored if n not in done)
    missing_archive = sorted(n for n in stored if n not in archive_seen)
    ledger.ok = len(stored) - len(missing)
    ledger.into(result)
    result.duplicated = sum(v - 1 for n, v in done.items() if n in stored and v > 1)
    late = len(sensor.raised & set(done))
    result.check(
        "every acknowledged report was handled by the chaos name",
        not missing,
        f"{len(stored)} acknowledged, {len(missing)} never handled"
        + (f" (first: {missing[:10]})" if missing else "")
        + f"; settled {took:.1f} s after the load stopped",
    )
    result.check(
        "and by the archive name",
        not missing_archive,
        f"{len(missing_archive)} never handled"
        + (f" (first: {missing_archive[:10]})" if missing_archive else ""),
    )
    result.check(
        "every publish that was not acknowledged raised a clear ReachError",
        not sensor.unclear,
        f"{len(sensor.raised)} raised ({late} of them were stored after all and handled:"
        " a timeout says it may be)" + (f"; unclear: {sensor.unclear}" if sensor.unclear else ""),
    )
    result.check("nothing was dead-lettered", not letters, f"{len(letters)} dead letters")
    result.notes.append(
        f"handled twice or more by chaos: {result.duplicated} (at-least-once: SIGSTOP, SIGKILL"
        " and the partition redeliver what the instance held)"
    )
    return result
