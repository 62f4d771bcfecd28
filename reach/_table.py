"""A client's live copy of the registry: the ``reach_agents`` bucket, pushed by a KV watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsConnection

from . import _kv
from ._routing import eligible
from .wire import AgentRecord, Priority

log = logging.getLogger("reach.table")

_decoder = msgspec.json.Decoder(AgentRecord)


class RoutingTable:
    """agent_id -> record, indexed by capability; rebuilt from a snapshot after reconnects.

    When the bucket or the watch is unavailable the last table is kept and marked stale:
    routing on slightly old data beats failing requests.
    """

    def __init__(self, nc: NatsConnection, bucket: str, *, silence_limit: float) -> None:
        self._nc = nc
        self.bucket = bucket
        self.records: dict[str, AgentRecord] = {}
        self._by_cap: dict[str, set[str]] = {}
        self.stale = True
        self._silence_limit = silence_limit
        self._watcher: Any = None
        self._consumer: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._last_update = time.monotonic()
        self._rebuilding: asyncio.Task[bool] | None = None
        self._listeners: list[asyncio.Queue[AgentRecord | str]] = []
        # Eligibility depends on status, version and tags only, not on load: cache the
        # eligible ids per query and invalidate them per capability when that shape changes.
        self._cap_gen: dict[str, int] = {}
        self._eligible: dict[tuple[Any, ...], tuple[int, list[str]]] = {}

    # -- reading -----------------------------------------------------------------------

    def offers(self, capability: str) -> bool:
        """Does any known instance (in any status) offer it? O(1), for the request path."""
        return bool(self._by_cap.get(capability))

    def offering(self, capability: str) -> list[AgentRecord]:
        ids = self._by_cap.get(capability)
        if not ids:
            return []
        return [self.records[i] for i in ids]

    def eligible_ids(
        self, capability: str, version: str | None, tags: tuple[str, ...], priority: Priority
    ) -> list[str]:
        """Ids of the instances that may take this request (cached until their shape changes)."""
        gen = self._cap_gen.get(capability, 0)
        key = (capability, version, tags, priority)
        hit = self._eligible.get(key)
        if hit is not None and hit[0] == gen:
            return hit[1]
        ids = sorted(
            r.info.agent_id
            for r in eligible(self.offering(capability), capability, version, tags, priority)
        )
        if len(self._eligible) > 4096:
            self._eligible.clear()
        self._eligible[key] = (gen, ids)
        return ids

    def listen(self) -> asyncio.Queue[AgentRecord | str]:
        """A queue of changes: a record when it is written, the agent id when it goes."""
        q: asyncio.Queue[AgentRecord | str] = asyncio.Queue()
        self._listeners.append(q)
        return q

    def unlisten(self, q: asyncio.Queue[AgentRecord | str]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(q)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, timeout: float) -> bool:
        """Load a snapshot and follow changes; False (stale) when the bucket is unavailable."""
        ok = await self.rebuild(timeout)
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch_dog())
        return ok

    async def stop(self) -> None:
        for task in (self._watchdog, self._consumer, self._rebuilding):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._watchdog = self._consumer = self._rebuilding = None
        await self._stop_watcher()

    async def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def rebuild_soon(self) -> None:
        """After a reconnect: a fresh watcher, reconciled against a fresh snapshot."""
        if self._rebuilding is None or self._rebuilding.done():
            self._rebuilding = asyncio.ensure_future(self.rebuild(5.0))

    async def rebuild(self, timeout: float) -> bool:
        if self._consumer is not None:
            self._consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._consumer
            self._consumer = None
        await self._stop_watcher()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                kv = await _kv.agents_bucket(self._nc.jetstream(), self.bucket, create=False)
                self._watcher = await kv.watchall()
                self._consumer = asyncio.ensure_future(self._consume(self._watcher, ready))
                await ready
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError) as exc:
            log.debug("routing table for %s unavailable: %s", self.bucket, exc)
            self.stale = True
            return False
        self.stale = False
        return True

    async def _consume(self, watcher: Any, ready: asyncio.Future[None]) -> None:
        snapshot: dict[str, AgentRecord] = {}
        initial = True
        async for entry in watcher:
            self._last_update = time.monotonic()
            if entry is None:
                if initial:
                    initial = False
                    self._replace(snapshot)
                    if not ready.done():
                        ready.set_result(None)
                continue
            record = None
            if entry.operation is None and entry.value:
                try:
                    record = _decoder.decode(entry.value)
                except msgspec.DecodeError:
                    log.warning("routing table: undecodable record %s ignored", entry.key)
                    continue
            if initial:
                if record is not None:
                    snapshot[entry.key] = record
                else:
                    snapshot.pop(entry.key, None)
            else:
                self._set(entry.key, record)

    def _replace(self, snapshot: dict[str, AgentRecord]) -> None:
        gone = set(self.records) - set(snapshot)
        for key in gone:
            for cap in self.records[key].info.capabilities:
                self._cap_gen[cap.name] = self._cap_gen.get(cap.name, 0) + 1
        self.records = {}
        self._by_cap = {}
        for key, record in snapshot.items():
            self._set(key, record)
        for key in gone:
            self._notify(key)

    def _set(self, key: str, record: AgentRecord | None) -> None:
        old = self.records.pop(key, None)
        if old is None or record is None or _shape(old) != _shape(record):
            names = {c.name for r in (old, record) if r is not None for c in r.info.capabilities}
            for name in names:
                self._cap_gen[name] = self._cap_gen.get(name, 0) + 1
        if old is not None:
            for cap in old.info.capabilities:
                ids = self._by_cap.get(cap.name)
                if ids is not None:
                    ids.discard(key)
                    if not ids:
                        del self._by_cap[cap.name]
        if record is None:
            if old is not None:
                self._notify(key)
            return
        self.records[key] = record
        for cap in record.info.capabilities:
            self._by_cap.setdefault(cap.name, set()).add(key)
        self._notify(record)

    def _notify(self, change: AgentRecord | str) -> None:
        for q in self._listeners:
            q.put_nowait(change)

    async def _watch_dog(self) -> None:
        """A watcher can go silent after a reconnect; heartbeats make silence suspicious."""
        while True:
            await asyncio.sleep(self._silence_limit / 3)
            if time.monotonic() - self._last_update > self._silence_limit:
                self._last_update = time.monotonic()
                if self._nc.is_connected:
                    await self.rebuild(5.0)


def _shape(record: AgentRecord) -> tuple[Any, ...]:
    """What eligibility depends on (a heartbeat's load and latency do not change it)."""
    info = record.info
    return (record.status, tuple(info.tags), tuple((c.name, c.version) for c in info.capabilities))
