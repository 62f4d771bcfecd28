"""A client's background work: the config watch and the routing table's watches (one per
capability called, or one of the whole fleet), all ``reach._kv.BucketMirror``s, and every
coroutine they run, held by one ``Background``.

Each starts on first use (an agent that never calls anything never watches) by a single
flight that concurrent callers share; all are closed (cancelled and awaited) by
``Client.close``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats.js.errors
from nats.aio.client import Client as NatsConnection
from nats.js.kv import KeyValue

from .. import _kv
from .._background import Background
from .._nats import TRANSIENT, refusals
from .._subjects import Subjects
from ..errors import NotStarted
from ..settings import ReachSettings
from .config import ConfigSink, config_bucket
from .table import RoutingTable

__all__ = ["CLOSE_TIMEOUT", "MAX_FOLLOWED", "Watches"]

log = logging.getLogger("reach.table")

#: seconds a client's close waits for its background coroutines to end once cancelled
CLOSE_TIMEOUT = 5.0
#: capabilities a client follows one by one; calling more follows the whole fleet instead
#: (one watch, not a watch per capability, for a client that calls everything)
MAX_FOLLOWED = 64
#: views a reconnect rebuilds at once (each is a consumer created and a snapshot read)
REBUILDING = 4


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
        self._config_mirror: _kv.BucketMirror | None = None
        self._whole: _kv.BucketMirror | None = None
        self._views: dict[str, _kv.BucketMirror] = {}
        self._starts: dict[str | None, asyncio.Task[None]] = {}  # "" config, None whole
        self._rebuilding = asyncio.Semaphore(REBUILDING)

    @property
    def mirrors(self) -> list[_kv.BucketMirror]:
        table = [self._whole] if self._whole is not None else list(self._views.values())
        config = [self._config_mirror] if self._config_mirror is not None else []
        return [*table, *config]

    async def ensure(self, nc: NatsConnection) -> None:
        """Start the config watch unless started; every caller waits for the one start."""
        await self._once("", nc)

    async def follow(self, nc: NatsConnection, capability: str) -> None:
        """Follow ``capability``'s instances from now on (the whole fleet past
        ``MAX_FOLLOWED`` capabilities)."""
        if self._whole is not None or (
            capability not in self._views and len(self._views) >= MAX_FOLLOWED
        ):
            await self._once(None, nc)
        else:
            await self._once(capability, nc)

    async def follow_all(self, nc: NatsConnection) -> None:
        """Follow every agent from now on (the one-capability watches stop)."""
        await self._once(None, nc)

    async def _once(self, what: str | None, nc: NatsConnection) -> None:
        start = self._starts.get(what)
        if start is None:
            if self.owner.closed:
                raise NotStarted("client closed while it started routing")
            start = self._starts[what] = self.owner.spawn(
                self._start(what, nc),
                f"watch {'config' if what == '' else what or 'the whole fleet'}",
            )
        try:
            await asyncio.shield(start)  # a caller's timeout does not abandon it for others
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if start.cancelled() and task is not None and not task.cancelling():
                raise NotStarted("client closed while it started routing") from None
            raise
        except Exception:
            if self._starts.get(what) is start:
                del self._starts[what]  # the next caller tries again
            raise

    def _mirror(
        self,
        bind: Callable[[], Awaitable[KeyValue]],
        sink: _kv.MirrorSink,
        name: str,
        nc: NatsConnection,
        keys: str = ">",
        last_of: Callable[[], Awaitable[int | None]] | None = None,
        gate: asyncio.Semaphore | None = None,
    ) -> _kv.BucketMirror:
        return _kv.BucketMirror(
            bind,
            sink,
            self.owner,
            name=name,
            # Config and a quiet capability are silent by nature; the watchdog rebuilds
            # only when the watch is stale or its keys moved while it stayed silent.
            silence_limit=max(3 * self._settings.heartbeat_interval, 1.0),
            rebuild_timeout=self._settings.connect_timeout,
            connected=lambda: nc.is_connected,
            keys=keys,
            last_of=last_of,
            gate=gate,
        )

    async def _start(self, what: str | None, nc: NatsConnection) -> None:
        js = nc.jetstream()
        timeout = self._settings.connect_timeout
        if what == "":
            bucket = self._subjects.bucket("config")
            mirror = self._mirror(
                lambda: config_bucket(js, bucket, create=False),
                self._config,
                f"config {bucket}",
                nc,
            )
            await self._started(mirror, timeout)
            self._config_mirror = mirror
            return
        if what is None:
            bucket = self._subjects.bucket("agents")
            mirror = self._mirror(
                lambda: _kv.agents_bucket(js, bucket, create=False),
                self._table,
                f"routing table {bucket}",
                nc,
            )
            self._whole = mirror
            try:
                await self._started(mirror, timeout)
            finally:
                # the views have nothing left to do; if the whole fleet's first snapshot is
                # not in yet (the watchdog keeps looking), what they held is let go rather
                # than routed on frozen: the queue group serves until it comes
                views, self._views = self._views, {}
                await asyncio.gather(*(v.stop(self.close_timeout) for v in views.values()))
                if not self._table.whole:
                    self._table.reset()
            return
        if self._whole is not None:
            return  # the whole fleet began to be followed meanwhile: it covers this one
        bucket = self._subjects.bucket("routes")
        if await self._without_routes(nc, bucket):
            # a registry from before the routes bucket (or one not allowed to make it),
            # or routes this client may not read: follow the leases, all of them
            await self._once(None, nc)
            return
        if self._whole is not None:
            return  # (it began while we looked)

        async def last_of() -> int | None:
            try:
                msg = await js.get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{what}.*")
            except nats.js.errors.NotFoundError as exc:
                # no message on those keys yet: 0; no stream at all (10059): unknown, so
                # the watchdog rebuilds and finds out
                return None if exc.err_code == _kv.JsErrorCode.STREAM_NOT_FOUND else 0
            return int(msg.seq or 0)

        mirror = self._mirror(
            lambda: _kv.routes_bucket(js, bucket, create=False),
            self._table.view(what),
            f"routes of {what}",
            nc,
            keys=f"{what}.*",
            last_of=last_of,
            gate=self._rebuilding,
        )
        self._views[what] = mirror
        try:
            await self._started(mirror, timeout)
        except BaseException:
            if self._views.get(what) is mirror:
                del self._views[what]
            self._table.unfollow(what)
            raise
        if self._views.get(what) is not mirror:  # the whole fleet took over meanwhile
            await mirror.stop(self.close_timeout)
            return
        self._table.loaded(what)

    async def _without_routes(self, nc: NatsConnection, routes: str) -> bool:
        """Whether to follow the leases instead of the routes: the routes bucket is
        missing while the leases bucket is there, or the server refused this client the
        routes. Anything else (both there; neither yet, before any registry; no answer)
        follows the routes."""
        js, mark = nc.jetstream(), refusals(nc)
        try:
            await _kv.routes_bucket(js, routes, create=False)
            return False
        except nats.js.errors.BucketNotFoundError:
            pass
        except TRANSIENT:
            if refusals(nc) == mark:
                return False
            log.warning(
                "%s: the server refused this user bucket %r (allow it as in "
                "services/nats/nats-server.conf): following the whole fleet",
                self.owner.owner,
                routes,
            )
            return True
        try:
            await _kv.agents_bucket(js, self._subjects.bucket("agents"), create=False)
        except TRANSIENT:
            return False
        log.warning(
            "%s: bucket %r is missing but the leases are there (a registry from "
            "before it, or not allowed to make it): following the whole fleet",
            self.owner.owner,
            routes,
        )
        return True

    async def _started(self, mirror: _kv.BucketMirror, timeout: float) -> None:
        """No bucket yet means no registry (or no config) yet: requests use the queue
        group and the watchdog keeps looking. Routing on a stale table beats failing."""
        try:
            await mirror.start(timeout)
        except BaseException:
            await mirror.stop()  # leave nothing of this try
            raise

    def rebuild_soon(self) -> None:
        """After a reconnect: fresh watchers, reconciled against fresh snapshots."""
        for mirror in self.mirrors:
            mirror.rebuild_soon()

    @property
    def rebuilds(self) -> int:
        """Rebuilds of the routing table's watches."""
        table = [self._whole] if self._whole is not None else list(self._views.values())
        return sum(m.rebuilds for m in table)

    @property
    def errors(self) -> int:
        return sum(m.errors for m in self.mirrors)

    async def close(self) -> None:
        """Halt the mirrors (their loops end at their next look, even one whose cancel
        nats-py swallowed), cancel and await every task (a rebuild cut short cleans up its
        own watcher), then stop the watchers that were running. Each wait is bounded by
        ``close_timeout``: what does not end is logged by name and left behind."""
        mirrors = self.mirrors
        self._config_mirror = self._whole = None
        self._views, self._starts = {}, {}
        self._table.reset()
        for mirror in mirrors:
            mirror.halt()
        await self.owner.close(self.close_timeout)
        for mirror in mirrors:
            await mirror.stop(self.close_timeout)

    def reopen(self) -> None:
        self.owner.reopen()
