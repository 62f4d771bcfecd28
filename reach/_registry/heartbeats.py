"""Heartbeats in: checked, then turned into a renewed lease and the status the agent reports.

One write per agent at a time: a heartbeat that arrives while the previous one of the same
agent is being written waits as "the newest", replacing any older one, and is written next.
So a replica never races itself on a key, a burst costs one write, and the per-agent state
is one dict slot that exists only while a write is in flight. Writes overall are bounded by
``max_inflight``; beyond that the subscription waits (NATS buffers, then drops as a slow
consumer, which is what an overwhelmed registry should do). A write's slot is given back
by its coroutine's done-callback, so one cancelled before it ever ran gives it back too.

A heartbeat is written only when it carries news or its lease is due for renewal
(``news``: the rule, its thresholds, and why a live agent's lease never expires); the
others are counted (``heartbeats_unwritten``). Any replica may take any heartbeat (a queue
group), so the decision reads the record and its age from this replica's view, which its
watch keeps current with every replica's writes; a write that raced another one is
decided again on the fresh record.

A heartbeat for a key that was just deleted is late (the agent is deregistering, or was
removed): it is dropped, not answered with "register", or a draining agent would come
back as a ghost. Once the deletion is forgotten (``Entries.prune``), an agent that still
heartbeats is asked to register like any unknown one.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.aio.msg import Msg

from .._codec import encode_json, now_ms
from .._nats import TRANSIENT
from .._subjects import validate_agent_id
from ..errors import PayloadTooLarge
from ..wire import AgentRecord, Control, Heartbeat, Status, Transition
from .checks import is_stale, sanitize_heartbeat
from .news import is_news, renew_after
from .state import Core
from .writer import ALIVE, WRITE_FAILED, RecordWriter

__all__ = ["Heartbeats"]

log = logging.getLogger("reach.registry")

_heartbeat = msgspec.json.Decoder(Heartbeat)
_register_again = encode_json(Control(command="register"))


class _Write:
    """One agent's write in flight; ``newest`` is the heartbeat waiting behind it."""

    __slots__ = ("newest",)

    def __init__(self) -> None:
        self.newest: Heartbeat | None = None


class Heartbeats:
    """The ``hb.*`` subscription's callback and the writes it starts."""

    def __init__(self, core: Core, writer: RecordWriter, max_inflight: int) -> None:
        self.core = core
        self.writer = writer
        self.max_inflight = max_inflight
        #: a lease this old (seconds) is renewed by any heartbeat
        self.renew_after = renew_after(core.lease_ttl, core.settings.heartbeat_interval)
        self.reset()

    def reset(self) -> None:
        """Forget every write (the registry starts again; the old tasks are gone)."""
        self._slots = asyncio.Semaphore(self.max_inflight)
        self._busy: dict[str, _Write] = {}  # agent id -> its write in flight
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._busy)

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._busy.values() if w.newest is not None)

    async def wait_idle(self) -> None:
        """Until every heartbeat taken has been written (or has failed)."""
        await self._idle.wait()

    async def on_message(self, msg: Msg) -> None:
        stats = self.core.stats
        stats.heartbeats += 1
        try:
            hb = _heartbeat.decode(msg.data)
        except msgspec.DecodeError:
            stats.dropped_malformed += 1
            return
        agent_id = hb.agent_id
        if msg.subject.rpartition(".")[2] != agent_id:
            stats.dropped_spoofed += 1
            return
        try:
            validate_agent_id(agent_id)
        except ValueError:
            stats.dropped_invalid += 1
            return
        checked, clamped = sanitize_heartbeat(hb)
        if checked is None:
            stats.dropped_invalid += 1
            return
        if clamped:
            stats.clamped += 1
        if checked.sent_ms > 0:  # wall clocks of two hosts: a skew below zero counts as 0
            self.core.cells.lag.observe(max(0, now_ms() - checked.sent_ms) / 1000)
        write = self._busy.get(agent_id)
        if write is not None:
            waiting = write.newest
            if waiting is None or not is_stale(checked, waiting):
                write.newest = checked
            return
        entry = self.core.entries.get(agent_id)
        if entry is not None and entry.record is not None and self._quiet(checked, entry.record):
            # decided here, as ``_apply`` would on the same record: no slot, no task
            stats.heartbeats_unwritten += 1
            return
        await self._slots.acquire()
        if self.core.owner.closed:
            self._slots.release()
            return
        self._busy[agent_id] = write = _Write()
        self._idle.clear()
        task = self.core.owner.spawn(self._write_all(checked, write), f"heartbeat {agent_id}")
        slots = self._slots
        task.add_done_callback(lambda _: self._release(agent_id, write, slots))

    def _release(self, agent_id: str, write: _Write, slots: asyncio.Semaphore) -> None:
        """The write's task ended (or was cancelled before it ran): its slot is free."""
        if self._busy.get(agent_id) is write:
            del self._busy[agent_id]
        slots.release()
        if not self._busy:
            self._idle.set()

    async def _write_all(self, hb: Heartbeat, write: _Write) -> None:
        agent_id = hb.agent_id
        try:
            while True:
                try:
                    await self._apply(hb)
                except PayloadTooLarge as exc:
                    # Stored by another writer near the limit: a registration of today is
                    # checked against it, and falls back to one that fits.
                    self.core.stats.write_errors += 1
                    log.warning(
                        "registry: heartbeat of %s not stored: its record would be too large"
                        " (%d bytes > limit %d); asking it to register again",
                        agent_id,
                        exc.size,
                        exc.limit,
                    )
                    await self.ask_to_register(agent_id)
                except WRITE_FAILED as exc:
                    self.core.stats.write_errors += 1
                    log.warning("registry: heartbeat of %s not stored: %s", agent_id, exc)
                newest = write.newest
                if newest is None:
                    return
                write.newest = None
                hb = newest
        finally:
            # Leave at once (no await after the last look): a heartbeat arriving from
            # now on starts a write of its own instead of waiting behind this one.
            if self._busy.get(agent_id) is write:
                del self._busy[agent_id]

    async def _apply(self, hb: Heartbeat) -> None:
        agent_id = hb.agent_id
        entry = self.core.entries.get(agent_id)
        if entry is not None and entry.deleted:
            self.core.stats.stale_heartbeats += 1  # late: it was just deregistered
            return
        if entry is None or entry.record is None or entry.record.status == Status.DOWN:
            await self.ask_to_register(agent_id)
            return
        now = now_ms()
        events: list[Transition] = []
        stale = quiet = False

        def change(before: AgentRecord | None) -> tuple[AgentRecord, float] | None:
            nonlocal stale, quiet
            events.clear()
            stale = quiet = False
            if before is None or before.status == Status.DOWN:
                return None  # gone meanwhile (or garbage): the agent must register again
            if is_stale(hb, before.heartbeat):
                stale = True
                return None  # a newer heartbeat is stored already: keep it
            if self._quiet(hb, before):
                quiet = True
                return None  # nothing new, and the lease is young: no write
            reported = hb.status if hb.status in ALIVE else Status.UP
            reason = "heartbeat resumed" if before.status == Status.UNKNOWN else "reported"
            record, t = self.writer.transition(
                before, reported, reason, hb.reason, heartbeat=hb, last_seen_ms=now
            )
            if t is not None:
                events.append(t)
            return record, self.core.lease_ttl

        updated = await self.writer.update(agent_id, change)
        if quiet:
            self.core.stats.heartbeats_unwritten += 1
        elif stale or (updated.written is None and updated.deleted):
            self.core.stats.stale_heartbeats += 1  # older than the one stored, or deleted
        elif updated.written is None:
            await self.ask_to_register(agent_id)
        for t in events:
            await self.writer.announce(agent_id, t, removed=False)

    def _quiet(self, hb: Heartbeat, before: AgentRecord) -> bool:
        """Whether ``hb`` carries no news for ``before`` (a live record it is not older
        than) while that lease is young: then it is not written."""
        if before.status == Status.DOWN:
            return False  # the agent must register again, which the write path asks
        reported = hb.status if hb.status in ALIVE else Status.UP
        return (
            not is_stale(hb, before.heartbeat)
            and not is_news(before, hb, reported)
            and self.lease_age(hb.agent_id, before) < self.renew_after
        )

    def lease_age(self, agent_id: str, record: AgentRecord) -> float:
        """Seconds since ``record`` was written, read two ways, the larger kept: this
        host's clock against the ``last_seen_ms`` its writer stamped before writing (not
        under the true age, unless the writer's clock is ahead of ours), and how long this
        replica's view has held it (under the true age by the watch's delay, never more).
        A record read from the stream after a lost race has only the first reading."""
        core = self.core
        age = (now_ms() - record.last_seen_ms) / 1000
        entry = core.entries.get(agent_id)
        if entry is not None and entry.record is record:
            age = max(age, core.entries.clock() - entry.since)
        return age

    async def ask_to_register(self, agent_id: str) -> None:
        """An agent we have no record of heartbeats (after a registry restart, an expiry,
        or garbage in its key): ask it to register, at most once a second."""
        core = self.core
        if not core.throttle.allow(agent_id):
            return
        core.stats.reregister_requests += 1
        try:
            await core.conn().publish(core.subjects.ctl(agent_id), _register_again)
        except TRANSIENT as exc:
            log.debug("registry: could not ask %s to register: %s", agent_id, exc)
