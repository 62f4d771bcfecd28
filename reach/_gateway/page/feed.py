"""The status page's data source: samples of the fleet while someone watches, and the
registry's changes as they happen, fanned out to the page's event streams.

Two owned loops. ``_follow`` reads ``client.changes()`` (the routing table's own feed, no
extra NATS traffic) and sends an ``agent`` event at once when an agent appears, goes, or
changes status (a heartbeat's renewal alone is not news: it would be thousands of events a
second in a large fleet); it also marks the snapshot stale. ``_sample`` takes a sample
(``reach status``'s: the table, each agent's ``$SRV.STATS`` counters, the task census) every
``interval`` while at least one stream is open and sends a ``snapshot``; in between, a stale
snapshot is rebuilt from the in-memory table and the last sample (no I/O), at most once per
``coalesce`` seconds, so a burst of changes costs one rebuild, not one per change.

``GET /v1/status`` reuses a sample younger than ``interval`` or takes one; the lock makes
concurrent callers share it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..._background import Background
from ..._client import Client
from ..._nats import TRANSIENT
from ..._status import Sample, take
from ..._tasks.store import TaskStore
from ...errors import ReachError
from ...wire import AgentRecord
from .hub import Hub, Subscriber, frame
from .snapshot import agent_row, latest_dead_letters, view

__all__ = ["StatusFeed"]

log = logging.getLogger("reach.gateway.page")

_REMEMBERED = 1024  # capability names kept after their last instance went (as reach top)
_UNAVAILABLE: tuple[type[BaseException], ...] = (ReachError, *TRANSIENT)


class StatusFeed:
    """Samples, changes and subscribers of one status page; ``start()`` then ``close()``."""

    def __init__(
        self,
        client: Client,
        *,
        interval: float = 2.0,
        stats_timeout: float = 1.0,
        task_scan: int = 10_000,
        dlq_shown: int = 10,
        agents_shown: int = 500,
        max_streams: int = 32,
        queue_size: int = 64,
        coalesce: float = 0.1,
    ) -> None:
        if interval <= 0 or coalesce < 0:
            raise ValueError("interval must be positive and coalesce not negative")
        self.client = client
        self.interval = interval
        self.stats_timeout = stats_timeout
        self.task_scan = task_scan
        self.dlq_shown = dlq_shown
        self.agents_shown = agents_shown
        self.coalesce = coalesce
        self.hub = Hub(max_streams=max_streams, queue_size=queue_size)
        self._owner = Background("status page")
        self._lock = asyncio.Lock()
        self._watching = asyncio.Event()  # set while a stream is open
        self._stale = asyncio.Event()  # the table changed since the last snapshot sent
        self._before: Sample | None = None
        self._last: Sample | None = None
        self._dead: list[dict[str, Any]] = []
        self._remembered: dict[str, None] = {}  # an ordered set, oldest first
        self._statuses: dict[str, str] = {}  # agent id -> the status last announced
        self._problem = ""
        #: samples that could not be taken (the connection was down, say)
        self.sample_errors = 0

    async def start(self) -> None:
        self._owner.keep(self._follow, "changes")
        self._owner.keep(self._sample, "samples")

    def shutdown(self) -> None:
        """End every stream now (synchronous, for a server's exit signal: the server waits
        for open responses before its lifespan ends)."""
        self.hub.close()

    async def close(self) -> None:
        self.shutdown()
        left = await self._owner.close(timeout=5.0)
        if left:
            log.error("status page: %d coroutine(s) did not stop", left)

    @property
    def stats(self) -> dict[str, int]:
        """Counters for the snapshot and for tests."""
        return {
            "streams": self.hub.subscribers,
            "streams_refused": self.hub.refused,
            "frames_dropped": self.hub.dropped,
            "sample_errors": self.sample_errors,
        }

    # -- streams -----------------------------------------------------------------------

    def join(self) -> Subscriber:
        """A new stream (``ResourceExhausted`` when too many are open); its first frame,
        a snapshot of the table now, follows (``greet``)."""
        sub = self.hub.subscribe()
        self._watching.set()
        return sub

    async def greet(self, sub: Subscriber) -> None:
        sub.offer(frame("snapshot", await self.snapshot()))

    def leave(self, sub: Subscriber) -> None:
        self.hub.unsubscribe(sub)
        if not self.hub.subscribers:
            self._watching.clear()

    # -- snapshots ---------------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        """The page's JSON now: the routing table as it is, the rates and tasks of a
        sample younger than ``interval`` (taken now if there is none)."""
        await self._refresh(self.interval)
        return await self._view()

    async def refresh(self) -> None:
        """Take a sample now (the next snapshot's rates are measured up to it)."""
        await self._refresh(0.0)

    async def _view(self) -> dict[str, Any]:
        records: list[AgentRecord] = await self.client.agents()
        extra: dict[str, Any] = {
            "prefix": self.client.subjects.prefix,
            "interval_s": self.interval,
            "page": self.stats,
        }
        if self._problem:
            extra["problem"] = self._problem
        return view(
            self._before,
            self._last,
            records,
            remembered=list(self._remembered),
            dead_letters=self._dead,
            agents_shown=self.agents_shown,
            extra=extra,
        )

    async def _refresh(self, max_age: float) -> None:
        """Take a sample unless one younger than ``max_age`` seconds exists."""
        async with self._lock:
            last = self._last
            if last is not None and time.monotonic() - last.at < max_age:
                return
            try:
                sample = await take(
                    self.client, timeout=self.stats_timeout, task_scan=self.task_scan
                )
                dead = await self._dead_letters(sample)
            except _UNAVAILABLE as exc:
                self.sample_errors += 1
                self._problem = f"sample failed: {exc or type(exc).__name__}"
                log.warning("status page: %s", self._problem)
                return
            self._problem = ""
            self._before, self._last, self._dead = last, sample, dead
            self._remember(sample)

    async def _dead_letters(self, sample: Sample) -> list[dict[str, Any]]:
        if self.dlq_shown <= 0 or sample.tasks is None or sample.tasks.dead == 0:
            return []
        client = self.client
        store = TaskStore(client.nc.jetstream(), client.subjects, client.settings)
        return await latest_dead_letters(store, self.dlq_shown)

    def _remember(self, sample: Sample) -> None:
        names = [c.name for r in sample.records for c in (*r.info.capabilities, *r.info.tasks)]
        for name in names:
            self._remembered.pop(name, None)
            self._remembered[name] = None
        while len(self._remembered) > _REMEMBERED:
            del self._remembered[next(iter(self._remembered))]
        present = {r.info.agent_id for r in sample.records}
        for agent_id in self._statuses.keys() - present:
            del self._statuses[agent_id]  # its removal was lost (changes() dropped it)

    # -- the loops ---------------------------------------------------------------------

    async def _follow(self) -> None:
        async for item in self.client.changes():
            if isinstance(item, str):
                if self._statuses.pop(item, None) is not None:
                    self.hub.publish(frame("agent", {"gone": item}))
                    self._stale.set()
                continue
            agent_id, status = item.info.agent_id, item.status.value
            if self._statuses.get(agent_id) != status:
                self._statuses[agent_id] = status
                self.hub.publish(frame("agent", {"agent": agent_row(item)}))
                self._stale.set()

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._watching.wait()
            self._stale.clear()
            await self._refresh(self.interval / 2)  # a /v1/status may have just taken one
            self.hub.publish(frame("snapshot", await self._view()))
            next_sample = loop.time() + self.interval
            while self.hub.subscribers and (left := next_sample - loop.time()) > 0:
                try:
                    await asyncio.wait_for(self._stale.wait(), left)
                except TimeoutError:
                    break
                self._stale.clear()
                self.hub.publish(frame("snapshot", await self._view()))
                await asyncio.sleep(self.coalesce)  # changes meanwhile: one rebuild
