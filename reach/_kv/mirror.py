"""A live copy of one KV bucket: a snapshot, then every change, pushed by a KV watch.

One implementation for the three followers (a client's routing table, a registry's view
of the leases, the config watch). What they share is the hard part: nats-py's watcher can
go silent after a reconnect (NATS-FACTS.md), so the mirror rebuilds on request (reconnect)
and when a watchdog sees silence longer than ``silence_limit``; a rebuild reconciles
against a fresh snapshot, and only one rebuild runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nats.js.kv import KeyValue

from .._nats import TRANSIENT
from .._owner import TaskOwner

__all__ = ["BucketMirror", "KvEntry", "MirrorSink"]

log = logging.getLogger("reach.kv")


@dataclass(frozen=True, slots=True)
class KvEntry:
    """One key's newest message: ``value`` is None for a delete, purge or expiry marker."""

    revision: int
    value: bytes | None
    operation: str | None  # None (a put), "DEL" or "PURGE" (expiry markers included)


class MirrorSink(Protocol):
    """What a mirror feeds: the whole snapshot once per (re)build, then each change."""

    def replace(self, snapshot: dict[str, KvEntry]) -> None: ...

    def update(self, key: str, entry: KvEntry) -> None: ...


class BucketMirror:
    """Follows one bucket into a sink; its tasks belong to the caller's ``TaskOwner``."""

    def __init__(
        self,
        bind: Callable[[], Awaitable[KeyValue]],
        sink: MirrorSink,
        owner: TaskOwner,
        *,
        name: str,
        silence_limit: float | None = None,
        rebuild_timeout: float = 5.0,
        connected: Callable[[], bool] = lambda: True,
    ) -> None:
        self._bind = bind
        self._sink = sink
        self._owner = owner
        self.name = name
        self.silence_limit = silence_limit
        self.rebuild_timeout = rebuild_timeout
        self._connected = connected
        self.stale = True
        self.rebuilds = 0
        self.errors = 0
        self.last_update = time.monotonic()
        self._lock = asyncio.Lock()
        self._watcher: Any = None
        self._consumer: asyncio.Task[Any] | None = None
        self._watchdog: asyncio.Task[Any] | None = None
        self._soon: asyncio.Task[Any] | None = None

    async def start(self, timeout: float) -> bool:
        """Load a snapshot and follow changes; False (stale) when the bucket is unavailable.
        The watchdog runs either way and keeps trying."""
        ok = await self.rebuild(timeout)
        if self.silence_limit is not None and self._watchdog is None:
            self._watchdog = self._owner.keep(self._watch_dog, f"{self.name} watchdog")
        return ok

    async def stop(self) -> None:
        for task in (self._watchdog, self._soon, self._consumer):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._watchdog = self._soon = self._consumer = None
        await self._stop_watcher()
        self.stale = True

    def rebuild_soon(self) -> None:
        """After a reconnect: a fresh watcher, reconciled against a fresh snapshot."""
        if self._owner.closed or (self._soon is not None and not self._soon.done()):
            return
        self._soon = self._owner.spawn(self.rebuild(self.rebuild_timeout), f"{self.name} rebuild")

    async def rebuild(self, timeout: float) -> bool:
        """Replace the watcher; concurrent callers share one rebuild (single flight)."""
        if self._lock.locked():
            async with self._lock:  # someone else rebuilt meanwhile: take their result
                return not self.stale
        async with self._lock:
            self.rebuilds += 1
            consumer, self._consumer = self._consumer, None
            if consumer is not None and not consumer.done():
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
            await self._stop_watcher()
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    kv = await self._bind()
                    self._watcher = await kv.watchall()
                    self._consumer = self._owner.spawn(
                        self._consume(self._watcher, ready), f"{self.name} watch"
                    )
                    await ready
            except TRANSIENT as exc:
                log.debug("%s unavailable: %s", self.name, exc)
                await self._abandon()
                self.stale = True
                return False
            except BaseException:
                await self._abandon()
                raise
            self.stale = False
            self.last_update = time.monotonic()
            return True

    async def _abandon(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None and not consumer.done():
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        await self._stop_watcher()

    async def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            try:
                await watcher.stop()
            except TRANSIENT as exc:
                log.debug("%s: stopping the old watcher: %s", self.name, exc)

    async def _consume(self, watcher: Any, ready: asyncio.Future[None]) -> None:
        snapshot: dict[str, KvEntry] = {}
        initial = True
        try:
            async for item in watcher:
                self.last_update = time.monotonic()
                if item is None:
                    if initial:
                        initial = False
                        self._sink.replace(snapshot)
                        snapshot = {}
                        if not ready.done():
                            ready.set_result(None)
                    continue
                entry = KvEntry(
                    int(item.revision or 0),
                    item.value if item.operation is None and item.value else None,
                    item.operation,
                )
                if initial:
                    snapshot[item.key] = entry
                else:
                    self._sink.update(item.key, entry)
        except Exception:
            # A bug in a sink must not end the mirror silently: count it, go stale, and let
            # the watchdog (or the next caller) rebuild.
            self.errors += 1
            self.stale = True
            log.exception("%s: watch consumer failed", self.name)
            if not ready.done():
                ready.set_exception(TimeoutError("watch consumer failed"))
            return
        self.stale = True  # the watcher ended: nothing more will come from it

    async def _watch_dog(self) -> None:
        """A watcher can go silent after a reconnect; heartbeats make silence suspicious."""
        limit = self.silence_limit
        assert limit is not None
        while True:
            await asyncio.sleep(limit / 3)
            silent = time.monotonic() - self.last_update > limit
            if (silent or self.stale) and self._connected():
                self.last_update = time.monotonic()
                await self.rebuild(self.rebuild_timeout)
