"""A client's background work: the routing-table and config watches, both
``reach._kv.BucketMirror``s, and every coroutine they run, held by one ``Background``.

Started once, on first use (an agent that never calls anything never watches), by a single
flight that concurrent callers share; closed (cancelled and awaited) by ``Client.close``.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NatsConnection

from .. import _kv
from .._background import Background
from .._subjects import Subjects
from ..errors import NotStarted
from ..settings import ReachSettings
from .config import ConfigSink, config_bucket
from .table import RoutingTable

__all__ = ["CLOSE_TIMEOUT", "Watches"]

#: seconds a client's close waits for its background coroutines to end once cancelled
CLOSE_TIMEOUT = 5.0


class Watches:
    def __init__(
        self,
        name: str,
        settings: ReachSettings,
        subjects: Subjects,
        table: RoutingTable,
        config: ConfigSink,
    ) -> None:
        self.owner = Background(f"client {name}")
        #: seconds ``close`` waits for the tasks, then for each watcher, at most (the
        #: client's close bound: its streams' loop gets as long, ``Streams.close``)
        self.close_timeout = CLOSE_TIMEOUT
        self._settings = settings
        self._subjects = subjects
        self._table = table
        self._config = config
        self.mirrors: list[_kv.BucketMirror] = []
        self._start: asyncio.Task[None] | None = None

    async def ensure(self, nc: NatsConnection) -> None:
        """Start both watches unless started; every caller waits for the one start."""
        start = self._start
        if start is None:
            start = self._start = self.owner.spawn(self._run(nc), "watches start")
        try:
            await asyncio.shield(start)  # a caller's timeout does not abandon it for others
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if start.cancelled() and task is not None and not task.cancelling():
                raise NotStarted("client closed while it started routing") from None
            raise
        except Exception:
            if self._start is start:
                self._start = None  # the next caller tries again
            raise

    async def _run(self, nc: NatsConnection) -> None:
        js = nc.jetstream()
        timeout = self._settings.connect_timeout
        agents, config = self._subjects.bucket("agents"), self._subjects.bucket("config")
        table = _kv.BucketMirror(
            lambda: _kv.agents_bucket(js, agents, create=False),
            self._table,
            self.owner,
            name=f"routing table {agents}",
            silence_limit=max(3 * self._settings.heartbeat_interval, 1.0),
            rebuild_timeout=timeout,
            connected=lambda: nc.is_connected,
        )
        watch = _kv.BucketMirror(
            lambda: config_bucket(js, config, create=False),
            self._config,
            self.owner,
            name=f"config {config}",
            # Config is silent by nature; the watchdog rebuilds only when the watch is
            # stale or the bucket moved while it stayed silent, so silence costs nothing.
            silence_limit=max(3 * self._settings.heartbeat_interval, 1.0),
            rebuild_timeout=timeout,
            connected=lambda: nc.is_connected,
        )
        self.mirrors = [table, watch]
        # No bucket yet means no registry (or no config) yet: requests use the queue group
        # and the watchdog keeps looking. Routing on a stale table beats failing requests.
        try:
            await table.start(timeout)
            await watch.start(timeout)
        except BaseException:
            self.mirrors = []  # the next caller starts afresh; leave nothing of this try
            for mirror in (table, watch):
                await mirror.stop()
            raise

    def rebuild_soon(self) -> None:
        """After a reconnect: fresh watchers, reconciled against fresh snapshots."""
        for mirror in self.mirrors:
            mirror.rebuild_soon()

    @property
    def rebuilds(self) -> int:
        return self.mirrors[0].rebuilds if self.mirrors else 0

    @property
    def errors(self) -> int:
        return sum(m.errors for m in self.mirrors)

    async def close(self) -> None:
        """Halt the mirrors (their loops end at their next look, even one whose cancel
        nats-py swallowed), cancel and await every task (a rebuild cut short cleans up its
        own watcher), then stop the watchers that were running. Each wait is bounded by
        ``close_timeout``: what does not end is logged by name and left behind."""
        mirrors, self.mirrors, self._start = self.mirrors, [], None
        for mirror in mirrors:
            mirror.halt()
        await self.owner.close(self.close_timeout)
        for mirror in mirrors:
            await mirror.stop(self.close_timeout)

    def reopen(self) -> None:
        self.owner.reopen()
