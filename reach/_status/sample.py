"""Taking one sample of the fleet: the client's routing table, every reachable agent's
``$SRV.STATS`` counters, and the task census.

The counters are asked of each agent by name and id (``$SRV.STATS.<name>.<id>``), never
with a bare ``$SRV.STATS`` broadcast: that would reach every service on the account, other
prefixes' included. The requests run concurrently, at most ``_CONCURRENCY`` at a time, each
bounded by ``timeout``; DOWN agents are not asked. An agent that does not answer is left
out of the rates (the summary counts it as unmeasured).
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from .._client import Client
from .._codec import now_ms
from .._nats import TRANSIENT
from .._tasks.counts import TaskCensus, census
from .._tasks.store import TaskStore
from ..wire import AgentRecord, Status
from .model import AgentCounters, Counters, Sample

__all__ = ["read_counters", "take"]

_CONCURRENCY = 64


class _Endpoint(msgspec.Struct):
    name: str
    num_requests: int = 0
    num_errors: int = 0
    processing_time: int = 0


class _Stats(msgspec.Struct):
    id: str = ""
    started: str = ""
    endpoints: list[_Endpoint] = msgspec.field(default_factory=list)


_stats_decoder = msgspec.json.Decoder(_Stats)
_UNANSWERED: tuple[type[BaseException], ...] = (*TRANSIENT, msgspec.DecodeError)


async def take(client: Client, *, timeout: float = 1.0, task_scan: int = 10_000) -> Sample:
    """One sample, through ``client`` (connected). ``task_scan`` bounds the task records
    read (0: no task census)."""
    records = await client.agents()
    counters = await read_counters(client, records, timeout)
    tasks, notes = await _tasks(client, task_scan)
    return Sample(
        at=time.monotonic(),
        wall_ms=now_ms(),
        records=records,
        counters=counters,
        tasks=tasks,
        notes=notes,
    )


async def read_counters(
    client: Client, records: list[AgentRecord], timeout: float
) -> dict[str, AgentCounters]:
    """The counters of every agent in ``records`` that is not DOWN and answers in time."""
    gate = asyncio.Semaphore(_CONCURRENCY)
    nc = client.nc

    async def one(rec: AgentRecord) -> tuple[str, AgentCounters] | None:
        agent_id = rec.info.agent_id
        async with gate:
            try:
                msg = await nc.request(
                    f"$SRV.STATS.{rec.info.name}.{agent_id}", b"", timeout=timeout
                )
                stats = _stats_decoder.decode(msg.data)
            except _UNANSWERED:
                return None  # gone, busy, or not speaking ADR-32: unmeasured
            at = time.monotonic()
        if stats.id and stats.id != agent_id:
            return None
        endpoints = {
            e.name: Counters(e.num_requests, e.num_errors, e.processing_time)
            for e in stats.endpoints
        }
        return agent_id, AgentCounters(at=at, started=stats.started, endpoints=endpoints)

    asked = [one(r) for r in records if r.status is not Status.DOWN]
    return dict(got for got in await asyncio.gather(*asked) if got is not None)


async def _tasks(client: Client, task_scan: int) -> tuple[TaskCensus | None, list[str]]:
    if task_scan <= 0:
        return None, []
    store = TaskStore(client.nc.jetstream(), client.subjects, client.settings, nc=client.nc)
    try:
        return await census(store, task_scan), []
    except TRANSIENT as exc:
        return None, [f"task counts unavailable: {exc or type(exc).__name__}"]
