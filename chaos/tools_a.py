"""Helpers shared by the task and slow-handler scenarios: executions counted from the run
files, task load and its accounting, calls that note who answered, the routing table's
status history, client metrics, and agent processes whose metrics can be scraped."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

import reach

from .harness import AgentProc, Ledger

__all__ = [
    "MeteredAgent",
    "StatusLog",
    "calls",
    "client_metric",
    "duplicates",
    "every",
    "executions",
    "settle_tasks",
    "task_load",
]


def executions(runs: Path) -> dict[str, list[tuple[int, int]]]:
    """Per task id, its executions as (attempt, pid), from ``<task_id>.<attempt>.<pid>``."""
    out: dict[str, list[tuple[int, int]]] = {}
    if not runs.exists():
        return out
    for f in runs.iterdir():
        task_id, attempt, pid = f.name.rsplit(".", 2)
        out.setdefault(task_id, []).append((int(attempt), int(pid)))
    return out


def duplicates(runs: Path, task_ids: set[str] | None = None) -> int:
    """Executions beyond one per task (of ``task_ids``; None: every task)."""
    return sum(len(r) - 1 for t, r in executions(runs).items() if task_ids is None or t in task_ids)


def every(
    seconds: float, condition: Callable[[], Awaitable[bool]]
) -> Callable[[], Awaitable[bool]]:
    """``condition`` looked at no more often than every ``seconds`` (``eventually`` polls
    every millisecond; reading records from the server that often would load the machine
    this suite means to measure)."""
    last = 0.0

    async def check() -> bool:
        nonlocal last
        now = time.monotonic()
        if now - last < seconds:
            return False
        last = now
        return await condition()

    return check


async def task_load(
    client: reach.Client,
    ledger: Ledger,
    refs: list[reach.TaskRef],
    stop: asyncio.Event,
    *,
    ms: int = 200,
    pause: float = 0.05,
) -> None:
    """Submit one ``chaos.job`` every ``pause`` seconds until ``stop``; a submit that
    fails counts as failed at once (with its code)."""
    n = 0
    while not stop.is_set():
        n += 1
        ledger.sent += 1
        try:
            refs.append(await client.submit("chaos.job", {"n": n, "ms": ms}))
        except reach.ReachError as exc:
            ledger.refused(f"submit {exc.code}")
        await asyncio.sleep(pause)


async def settle_tasks(
    client: reach.Client, refs: list[reach.TaskRef], ledger: Ledger, timeout: float
) -> dict[str, reach.TaskRecord]:
    """Wait for every task's final record: SUCCEEDED counts as ok, another final state as
    failed (by state); a task not final within ``timeout`` stays unaccounted (lost)."""

    async def one(ref: reach.TaskRef) -> reach.TaskRecord | None:
        try:
            return await ref.wait(timeout)
        except reach.ReachError:
            return None

    records = await asyncio.gather(*(one(r) for r in refs))
    final: dict[str, reach.TaskRecord] = {}
    for rec in records:
        if rec is None:
            continue
        final[rec.task_id] = rec
        if rec.state is reach.TaskState.SUCCEEDED:
            ledger.ok += 1
        else:
            ledger.refused(f"task {rec.state.value}")
    return final


async def calls(
    client: reach.Client,
    capability: str,
    ledger: Ledger,
    stop: asyncio.Event,
    payload: dict[str, Any],
    by: Counter[str],
    *,
    concurrency: int = 8,
    timeout: float = 3.0,
    pause: float = 0.005,
) -> None:
    """Like ``harness.steady_load``, with ``payload`` merged into every request (change it
    between phases) and ``by`` counting who answered."""

    async def caller(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            ledger.sent += 1
            started = time.perf_counter()
            try:
                reply = await client.call(  # the echo may run twice (another instance)
                    capability, {"caller": n, "i": i, **payload}, timeout=timeout, idempotent=True
                )
            except reach.ReachError as exc:
                ledger.refused(exc.code)
            else:
                ledger.answered(time.perf_counter() - started)
                by[reply.agent_id] += 1
            await asyncio.sleep(pause)

    await asyncio.gather(*(caller(n) for n in range(concurrency)))


def client_metric(client: reach.Client, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples (e.g. ``reach_client_attempts_total``) whose labels
    include ``labels``."""
    total = 0.0
    for family in client.telemetry.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class StatusLog:
    """Every status the routing table showed for each agent id, in order (``None``: it
    left the table), with when it was seen, from ``client.changes()`` followed in a task
    of its own."""

    def __init__(self, client: reach.Client) -> None:
        self.client = client
        self.seen: dict[str, list[tuple[float, reach.Status | None]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StatusLog:
        for r in await self.client.agents():
            self.seen[r.info.agent_id] = [(time.monotonic(), r.status)]
        self._task = asyncio.ensure_future(self._follow())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _follow(self) -> None:
        async for change in self.client.changes():
            agent_id, status = (
                (change, None) if isinstance(change, str) else (change.info.agent_id, change.status)
            )
            history = self.seen.setdefault(agent_id, [])
            if not history or history[-1][1] is not status:
                history.append((time.monotonic(), status))

    def statuses(self, agent_id: str, mark: int = 0) -> list[reach.Status | None]:
        """What it was shown as, in order, from the ``mark``-th change on."""
        return [s for _, s in self.seen.get(agent_id, [])[mark:]]

    def now(self, agent_id: str) -> reach.Status | None:
        history = self.seen.get(agent_id)
        return history[-1][1] if history else None

    def ever(self, agent_id: str, *statuses: reach.Status | None) -> bool:
        return any(s in statuses for s in self.statuses(agent_id))

    def mark(self, agent_id: str) -> int:
        return len(self.seen.get(agent_id, []))

    def story(self, agent_id: str, origin: float) -> str:
        """``UP -> DEGRADED at 1.5 s -> ...``, times from ``origin`` (monotonic)."""
        parts = [
            f"{s.value if s else 'gone'} at {t - origin:.1f} s"
            for t, s in self.seen.get(agent_id, [])
        ]
        return " -> ".join(parts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class MeteredAgent(AgentProc):
    """An ``AgentProc`` that serves its own ``/metrics`` on a loopback port (to see, from
    outside, what the agent's task runner did)."""

    metrics_port = 0

    def extra_env(self) -> dict[str, str]:
        self.metrics_port = free_port()  # a fresh one at each start
        return {"REACH_METRICS_PORT": str(self.metrics_port)}

    async def samples(self, name: str) -> list[tuple[dict[str, str], float]] | None:
        """The samples of ``name`` on the agent's ``/metrics``; None when it does not
        answer."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.metrics_port)
        except OSError:
            return None
        try:
            writer.write(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(5):
                raw = await reader.read()
        except (OSError, TimeoutError):
            return None
        finally:
            writer.close()
        text = raw.partition(b"\r\n\r\n")[2].decode()
        return [
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ]

    async def metric(self, name: str, **labels: str) -> float | None:
        """The sum of ``name``'s samples with ``labels``; None when it does not answer."""
        found = await self.samples(name)
        if found is None:
            return None
        return sum(v for ls, v in found if all(ls.get(k) == x for k, x in labels.items()))
