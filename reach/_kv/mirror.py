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

from .._background import Background
from .._nats import TRANSIENT

__all__ = ["BucketMirror", "KvEntry", "MirrorSink"]

log = logging.getLogger("reach.kv")
#: seconds ``stop`` waits for the loops, and then for the watcher, at most
STOP_TIMEOUT = 5.0


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
    """Follows one bucket into a sink; its coroutines belong to the caller's ``Background``."""

    def __init__(
        self,
        bind: Callable[[], Awaitable[KeyValue]],
        sink: MirrorSink,
        owner: Background,
        *,
        name: str,
        silence_limit: float | None = None,
        rebuild_timeout: float = 5.0,
        connected: Callable[[], bool] = lambda: True,
        keys: str = ">",
        last_of: Callable[[], Awaitable[int | None]] | None = None,
        gate: asyncio.Semaphore | None = None,
    ) -> None:
        """``keys``: follow only the keys that match (a KV key pattern); then ``last_of``
        (the newest sequence on those keys, or None) tells the watchdog whether they
        moved while the watch was silent: the stream's own last sequence moves with every
        other key too. ``gate``: shared by mirrors that a reconnect rebuilds all at once
        (a client's views), so that only so many rebuild together."""
        self._bind = bind
        self._gate = gate
        self.keys = keys
        self._last_of = last_of
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
        self._asked = 0  # rebuild requests so far
        self._covered = 0  # requests the last finished rebuild began after
        self._stopped = False
        self._kv: KeyValue | None = None
        self._watcher: Any = None
        self._consumer: asyncio.Task[Any] | None = None
        self._watchdog: asyncio.Task[Any] | None = None
        self._soon: asyncio.Task[Any] | None = None
        self._silent_seq: int | None = None

    async def start(self, timeout: float) -> bool:
        """Load a snapshot and follow changes; False (stale) when the bucket is unavailable.
        The watchdog runs either way and keeps trying."""
        self._stopped = False
        ok = await self.rebuild(timeout)
        if self.silence_limit is not None and self._watchdog is None:
            self._watchdog = self._owner.keep(self._watch_dog, f"{self.name} watchdog")
        return ok

    def halt(self) -> None:
        """No rebuild starts from here on, and the loops end at their next look (even one
        whose cancellation nats-py swallowed): call it before closing the owner."""
        self._stopped = True

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Halt, cancel the loops and stop the watcher, waiting at most ``timeout`` for
        each; what does not end in time is logged and left behind (the connection's close
        ends it)."""
        self.halt()
        tasks = [t for t in (self._watchdog, self._soon) if t is not None and not t.done()]
        self._watchdog = self._soon = None
        for task in tasks:
            task.cancel()
        if tasks:
            _, left = await asyncio.wait(tasks, timeout=timeout)
            if left:
                log.error(
                    "%s: %s did not end within %gs of being cancelled; left running",
                    self.name,
                    ", ".join(sorted(t.get_name() for t in left)),
                    timeout,
                )
        try:
            async with asyncio.timeout(timeout):
                async with self._lock:  # (held by a rebuild that does not end: not for long)
                    await self._abandon()
        except TimeoutError:
            log.error("%s: its watcher was not stopped within %gs; left behind", self.name, timeout)
        self.stale = True

    def rebuild_soon(self) -> None:
        """After a reconnect: a fresh watcher, reconciled against a fresh snapshot. A
        reconnect while a background rebuild runs gets one more after it."""
        if self._stopped or self._owner.closed:
            return
        self._asked += 1
        if self._soon is None or self._soon.done():
            self._soon = self._owner.spawn(self._catch_up(), f"{self.name} rebuild")

    async def _catch_up(self) -> None:
        while not self._stopped and self._covered < self._asked:
            await self._gated()

    async def _gated(self, *, ask: bool = False) -> None:
        """A background rebuild (a reconnect's; the watchdog's, which ``ask``s for one of
        its own), through the gate when there is one; skipped if another rebuild covered
        every request while it waited."""
        if ask:
            self._asked += 1
        if self._gate is None:
            await self.rebuild(self.rebuild_timeout)
            return
        wanted = self._asked
        async with self._gate:
            if self._covered < wanted or self.stale:
                await self.rebuild(self.rebuild_timeout)

    async def rebuild(self, timeout: float) -> bool:
        """Replace the watcher. One rebuild at a time; a caller whose request came before a
        rebuild began shares that rebuild's result, a later one gets a rebuild of its own."""
        self._asked += 1
        ticket = self._asked
        async with self._lock:
            if self._covered >= ticket or self._stopped:
                return not self.stale
            self._covered = self._asked
            self.rebuilds += 1
            await self._abandon()
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    self._kv = await self._bind()
                    self._watcher = await self._open_watcher(self._kv)
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
            self._silent_seq = None
            return True

    async def _open_watcher(self, kv: KeyValue) -> Any:
        """``watchall`` in a task of its own: if the timeout cancels us while nats-py is
        half-way (subscribed, waiting for consumer info), nats-py would leak the
        subscription; the task finishes instead, and a watcher that arrives late is
        stopped."""
        threshold = max(30.0, 2 * (self.silence_limit or 15.0))
        opening = asyncio.ensure_future(
            kv.watchall(inactive_threshold=threshold)
            if self.keys == ">"
            else kv.watch(self.keys, inactive_threshold=threshold)
        )
        try:
            return await asyncio.shield(opening)
        except BaseException:
            opening.add_done_callback(self._stop_late)
            raise

    def _stop_late(self, opening: asyncio.Future[Any]) -> None:
        if opening.cancelled() or opening.exception() is not None:
            return
        stopping = opening.result().stop()
        if self._owner.closed:
            stopping.close()  # the connection is closing anyway
            return
        self._owner.spawn(stopping, f"{self.name} late watcher")

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
        """A watcher can go silent after a reconnect. Silence alone is not proof (an idle
        bucket is silent too): rebuild when the stream's last sequence moved between two
        silent checks, or when the mirror is stale."""
        limit = self.silence_limit
        assert limit is not None
        while not self._stopped:
            await asyncio.sleep(limit / 3)
            if not self._connected():
                continue
            if self.stale:
                await self._gated()
                continue
            if time.monotonic() - self.last_update <= limit:
                self._silent_seq = None
                continue
            seq = await self._last_seq()
            if seq is None or (self._silent_seq is not None and self._moved(seq)):
                log.info("%s: watch silent while the bucket changed; rebuilding", self.name)
                await self._gated(ask=True)
            else:
                self._silent_seq = seq

    def _moved(self, seq: int) -> bool:
        """Whether the keys changed between two silent checks. The newest message of a
        filtered few can be an expiring delete marker, whose going makes the sequence
        fall without news: only a rise counts there. The whole stream's falls only when
        it was created again, which is news."""
        assert self._silent_seq is not None
        if self._last_of is not None:
            return seq > self._silent_seq
        return seq != self._silent_seq

    async def _last_seq(self) -> int | None:
        kv = self._kv
        if kv is None:
            return None
        try:
            if self._last_of is not None:
                return await self._last_of()
            status = await kv.status()
        except TRANSIENT as exc:
            log.debug("%s: bucket status unavailable: %s", self.name, exc)
            return None
        return int(status.stream_info.state.last_seq or 0)
