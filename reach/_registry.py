"""The registry service: leases in KV, heartbeats into status, probes, list and route.

Stateless by design: everything it knows is in the ``reach_agents`` bucket (which it
watches) or arrives with the next heartbeat. Every write is a compare-and-set on the key's
revision, so any number of replicas can run; a lost race is retried on the fresh record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.nuid import NUID

from . import _kv
from ._codec import encode_json, error_reply, now_ms
from ._nats import connect_nats, flush_nats
from ._routing import explain_miss, rank
from ._subjects import Subjects, validate_agent_id
from .errors import NotStarted
from .settings import ReachSettings
from .wire import (
    AgentEvent,
    AgentRecord,
    Candidate,
    Control,
    Deregistration,
    ErrorCode,
    Heartbeat,
    ListQuery,
    ListReply,
    RegisterReply,
    Registration,
    RouteQuery,
    RouteReply,
    Status,
    Transition,
)

__all__ = ["Registry", "RegistryStats"]

log = logging.getLogger("reach.registry")

_record_decoder = msgspec.json.Decoder(AgentRecord)
_hb_decoder = msgspec.json.Decoder(Heartbeat)
_MAX_TRANSITIONS = 8
_CAS_RETRIES = 5
_ALIVE = (Status.UP, Status.DEGRADED, Status.PAUSED)


@dataclass(slots=True)
class RegistryStats:
    """What a registry counts about the traffic it handles."""

    heartbeats: int = 0
    dropped_malformed: int = 0
    dropped_spoofed: int = 0
    reregister_requests: int = 0
    registrations: int = 0
    deregistrations: int = 0
    probes: int = 0
    cas_conflicts: int = 0
    write_errors: int = 0


@dataclass(slots=True)
class _Entry:
    revision: int
    record: AgentRecord | None
    asked_reregister_ms: int = 0


class Registry:
    """One registry replica; run as many as you like (``reach registry``)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: ReachSettings | None = None,
        registry_id: str | None = None,
        max_inflight: int = 256,
    ) -> None:
        self.settings = settings if settings is not None else ReachSettings()
        self.url = url or self.settings.nats_url
        self.subjects = Subjects(self.settings.subject_prefix)
        self.bucket_name = self.subjects.bucket("agents")
        self.registry_id = registry_id or f"registry-{NUID().next().decode()}"
        self.stats = RegistryStats()
        self._nc: NatsConnection | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._entries: dict[str, _Entry] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_inflight)
        self._watch_ready = asyncio.Event()
        self._watcher: Any = None
        self._running = False
        self._last_update = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._running:
            return
        self._nc = await connect_nats(
            self.settings, self.url, self.registry_id, reconnected=self._on_reconnect
        )
        self._js = self._nc.jetstream()
        self._running = True
        await self._start_watch()
        nc, s = self._nc, self.subjects
        await nc.subscribe(s.heartbeat("*"), queue="registry", cb=self._on_heartbeat)
        for verb, cb in (
            ("register", self._on_register),
            ("deregister", self._on_deregister),
            ("list", self._on_list),
            ("route", self._on_route),
        ):
            await nc.subscribe(s.registry(verb), queue="registry", cb=self._guard(cb))
        await flush_nats(nc)
        self._spawn(self._watchdog())
        log.info("registry %s serving bucket %s", self.registry_id, self.bucket_name)

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                await nc.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def serve_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    def records(self) -> dict[str, AgentRecord]:
        """The registry's current view (from its own watch of the bucket)."""
        return {k: e.record for k, e in self._entries.items() if e.record is not None}

    # -- plumbing ----------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("registry task failed", exc_info=task.exception())

    def _guard(self, cb: Callable[[Msg], Awaitable[bytes]]) -> Callable[[Msg], Awaitable[None]]:
        """Answer every API request, with ``bad_request`` when its body does not decode."""

        async def handle(msg: Msg) -> None:
            if not msg.reply:
                return
            try:
                body = await cb(msg)
                headers = None
            except (msgspec.DecodeError, ValueError) as exc:
                body, headers = error_reply(ErrorCode.BAD_REQUEST, f"invalid request: {exc}")
            except Exception:
                log.exception("registry %s: request on %s failed", self.registry_id, msg.subject)
                body, headers = error_reply(ErrorCode.FAILED, "registry failed")
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._conn().publish(msg.reply, body, headers=headers)

        return handle

    def _conn(self) -> NatsConnection:
        if self._nc is None:
            raise NotStarted("registry is not started")
        return self._nc

    def _jsc(self) -> JetStreamContext:
        if self._js is None:
            raise NotStarted("registry is not started")
        return self._js

    async def _publish_event(self, agent_id: str, transition: Transition, removed: bool) -> None:
        event = AgentEvent(
            agent_id=agent_id,
            old=transition.old,
            new=transition.new,
            reason=transition.reason,
            at_ms=transition.at_ms,
            removed=removed,
        )
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._conn().publish(self.subjects.event(agent_id), encode_json(event))

    # -- the watch: this replica's view of every record ------------------------------

    async def _start_watch(self) -> None:
        # The bucket lives in memory: after a server restart it may have to be created again.
        self._kv = await _kv.agents_bucket(self._jsc(), self.bucket_name, create=True)
        old, self._watcher = self._watcher, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.stop()
        self._watch_ready.clear()
        self._watcher = await self._kv.watchall()
        self._spawn(self._consume(self._watcher))
        await self._watch_ready.wait()

    async def _consume(self, watcher: Any) -> None:
        snapshot: dict[str, _Entry] = {}
        initial = True
        self._last_update = time.monotonic()
        async for entry in watcher:
            self._last_update = time.monotonic()
            if entry is None:
                if initial:
                    # Reconcile: keys missing from a fresh snapshot are gone.
                    self._entries = snapshot
                    initial = False
                    self._watch_ready.set()
                continue
            target = snapshot if initial else self._entries
            self._apply(target, entry.key, entry.revision, entry.value, entry.operation, initial)

    def _apply(
        self,
        entries: dict[str, _Entry],
        key: str,
        revision: int,
        value: bytes | None,
        operation: str | None,
        initial: bool,
    ) -> None:
        current = entries.get(key)
        if current is not None and revision <= current.revision:
            return
        if operation is None and value:
            try:
                record = _record_decoder.decode(value)
            except msgspec.DecodeError:
                log.warning("registry: undecodable record for %s ignored", key)
                return
            entries[key] = _Entry(revision, record)
            return
        previous = current.record if current is not None else None
        if operation == "DEL":
            # Deregistered or forgotten: nothing to keep (a later CAS re-reads the revision).
            entries.pop(key, None)
            return
        entries[key] = _Entry(revision, None)
        if initial or previous is None or operation != "PURGE":
            return
        # The server expired the lease (a marker): decide what the silence means.
        if previous.status in _ALIVE:
            self._spawn(self._suspect(key, revision, previous))
        else:
            self._spawn(self._forget(key, revision, previous))

    async def _watchdog(self) -> None:
        """Recreate a watcher that has gone silent (nats-py can stay quiet for ~15 s)."""
        limit = max(3 * self.settings.heartbeat_interval, 1.0)
        while True:
            await asyncio.sleep(limit / 3)
            self._prune()
            if time.monotonic() - self._last_update > limit:
                log.info(
                    "registry %s: watcher silent for %.0fs, recreating", self.registry_id, limit
                )
                self._last_update = time.monotonic()
                try:
                    await self._start_watch()
                except (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError) as exc:
                    log.warning("registry %s: watch not restored: %s", self.registry_id, exc)

    def _prune(self) -> None:
        """Forget keys without a record that nobody has heard of for a minute, so agent
        churn (and heartbeats with made-up ids) cannot grow this map without bound."""
        old = now_ms() - 60_000
        stale = [
            k for k, e in self._entries.items() if e.record is None and e.asked_reregister_ms < old
        ]
        for key in stale:
            del self._entries[key]

    async def _on_reconnect(self) -> None:
        self._last_update = 0.0  # let the watchdog rebuild now, with its error handling

    # -- writes ------------------------------------------------------------------------

    async def _write(self, agent_id: str, record: AgentRecord, ttl: float, last: int) -> int:
        rev = await _kv.write_lease(
            self._jsc(), self.bucket_name, agent_id, encode_json(record), ttl=ttl, last=last
        )
        entry = self._entries.get(agent_id)
        if entry is None or entry.revision < rev:
            self._entries[agent_id] = _Entry(rev, record)
        return rev

    async def _update(
        self,
        agent_id: str,
        change: Callable[[AgentRecord | None], tuple[AgentRecord, float] | None],
    ) -> tuple[AgentRecord | None, AgentRecord | None]:
        """Read-modify-CAS-write with retries on the fresh record; (before, after)."""
        entry = self._entries.get(agent_id)
        last = entry.revision if entry else 0
        before = entry.record if entry else None
        for _ in range(_CAS_RETRIES):
            decided = change(before)
            if decided is None:
                return before, None
            record, ttl = decided
            try:
                await self._write(agent_id, record, ttl, last)
                return before, record
            except _kv.LeaseConflict:
                self.stats.cas_conflicts += 1
                fresh = await _kv.latest(self._jsc(), self.bucket_name, agent_id)
                last = fresh.revision
                before = _record_decoder.decode(fresh.value) if fresh.value else None
        raise _kv.LeaseConflict(agent_id)

    def _transition(
        self, record: AgentRecord, new: Status, reason: str, **changes: Any
    ) -> tuple[AgentRecord, Transition | None]:
        if record.status == new:
            return msgspec.structs.replace(record, **changes), None
        t = Transition(old=record.status, new=new, reason=reason, at_ms=now_ms())
        transitions = [*record.transitions[-(_MAX_TRANSITIONS - 1) :], t]
        return (
            msgspec.structs.replace(
                record, status=new, transitions=transitions, registry=self.registry_id, **changes
            ),
            t,
        )

    # -- API handlers ------------------------------------------------------------------

    async def _on_register(self, msg: Msg) -> bytes:
        reg = msgspec.json.decode(msg.data, type=Registration)
        agent_id = validate_agent_id(reg.info.agent_id)
        status = reg.status if reg.status in _ALIVE else Status.UP
        now = now_ms()
        self.stats.registrations += 1
        events: list[Transition] = []

        def change(before: AgentRecord | None) -> tuple[AgentRecord, float]:
            events.clear()
            t = Transition(
                old=before.status if before else None, new=status, reason="registered", at_ms=now
            )
            events.append(t)
            history = [*(before.transitions if before else [])][-(_MAX_TRANSITIONS - 1) :]
            record = AgentRecord(
                info=reg.info,
                status=status,
                heartbeat=before.heartbeat if before else None,
                registered_ms=now,
                last_seen_ms=now,
                transitions=[*history, t],
                registry=self.registry_id,
            )
            return record, self.settings.lease_ttl

        await self._update(agent_id, change)
        for t in events:
            await self._publish_event(agent_id, t, removed=False)
        entry = self._entries.get(agent_id)
        if entry is not None:
            entry.asked_reregister_ms = 0
        return encode_json(
            RegisterReply(
                lease_ttl=self.settings.lease_ttl,
                heartbeat_interval=self.settings.heartbeat_interval,
                registry=self.registry_id,
            )
        )

    async def _on_deregister(self, msg: Msg) -> bytes:
        req = msgspec.json.decode(msg.data, type=Deregistration)
        agent_id = validate_agent_id(req.agent_id)
        self.stats.deregistrations += 1
        entry = self._entries.get(agent_id)
        previous = entry.record if entry else None
        await _kv.remove(self._jsc(), self.bucket_name, agent_id, last=None)
        if previous is not None:
            t = Transition(
                old=previous.status, new=Status.DOWN, reason="deregistered", at_ms=now_ms()
            )
            await self._publish_event(agent_id, t, removed=True)
        return b"{}"

    async def _on_list(self, msg: Msg) -> bytes:
        query = msgspec.json.decode(msg.data or b"{}", type=ListQuery)
        agents = [
            r
            for r in self.records().values()
            if (
                query.capability is None
                or any(c.name == query.capability for c in r.info.capabilities)
            )
            and (query.tag is None or query.tag in r.info.tags)
            and (query.status is None or r.status == query.status)
        ]
        agents.sort(key=lambda r: r.info.agent_id)
        return encode_json(ListReply(agents=agents))

    async def _on_route(self, msg: Msg) -> bytes:
        query = msgspec.json.decode(msg.data, type=RouteQuery)
        records = list(self.records().values())
        ranked = rank(records, query.capability, query.version, query.tags, query.priority)
        candidates = [
            Candidate(
                agent_id=r.info.agent_id,
                subject=self.subjects.agent(r.info.agent_id, query.capability),
                status=r.status,
                score=round(s, 4),
                reason=why,
            )
            for r, s, why in ranked[:5]
        ]
        reason = (
            ""
            if candidates
            else explain_miss(records, query.capability, query.version, query.tags, query.priority)
        )
        return encode_json(RouteReply(candidates=candidates, reason=reason))

    # -- heartbeats --------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        self.stats.heartbeats += 1
        try:
            hb = _hb_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self.stats.dropped_malformed += 1
            return
        if msg.subject.rpartition(".")[2] != hb.agent_id:
            self.stats.dropped_spoofed += 1
            return
        await self._slots.acquire()
        self._spawn(self._heartbeat(hb))

    async def _heartbeat(self, hb: Heartbeat) -> None:
        try:
            await self._apply_heartbeat(hb)
        except (nats.errors.Error, _kv.LeaseConflict, OSError, TimeoutError) as exc:
            self.stats.write_errors += 1
            log.warning("registry: heartbeat of %s not stored: %s", hb.agent_id, exc)
        finally:
            self._slots.release()

    async def _apply_heartbeat(self, hb: Heartbeat) -> None:
        agent_id = hb.agent_id
        entry = self._entries.get(agent_id)
        if entry is None or entry.record is None or entry.record.status == Status.DOWN:
            await self._ask_to_register(agent_id, entry)
            return
        now = now_ms()
        events: list[Transition] = []

        def change(before: AgentRecord | None) -> tuple[AgentRecord, float] | None:
            events.clear()
            if before is None or before.status == Status.DOWN:
                return None
            reported = hb.status if hb.status in _ALIVE else Status.UP
            reason = "heartbeat resumed" if before.status == Status.UNKNOWN else "reported"
            record, t = self._transition(before, reported, reason, heartbeat=hb, last_seen_ms=now)
            if t is not None:
                events.append(t)
            return record, self.settings.lease_ttl

        _, after = await self._update(agent_id, change)
        if after is None:
            await self._ask_to_register(agent_id, self._entries.get(agent_id))
        for t in events:
            await self._publish_event(agent_id, t, removed=False)

    async def _ask_to_register(self, agent_id: str, entry: _Entry | None) -> None:
        """An unknown agent heartbeats (e.g. after a registry restart): tell it to register."""
        now = now_ms()
        if entry is not None and now - entry.asked_reregister_ms < 1000:
            return
        if entry is None:
            entry = self._entries.setdefault(agent_id, _Entry(0, None))
        entry.asked_reregister_ms = now
        self.stats.reregister_requests += 1
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._conn().publish(
                self.subjects.ctl(agent_id), encode_json(Control(command="register"))
            )

    # -- silence -> UNKNOWN -> probe -> UP or DOWN -> gone ------------------------------

    async def _suspect(self, agent_id: str, marker_revision: int, previous: AgentRecord) -> None:
        record, t = self._transition(
            previous, Status.UNKNOWN, f"no heartbeat for {self.settings.lease_ttl:g}s"
        )
        ttl = self.settings.probe_timeout + self.settings.lease_ttl
        try:
            await self._write(agent_id, record, ttl, marker_revision)
        except _kv.LeaseConflict:
            return  # another replica (or a heartbeat) got there first: it owns the probe
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            log.warning("registry: could not mark %s UNKNOWN: %s", agent_id, exc)
            return
        if t is not None:
            await self._publish_event(agent_id, t, removed=False)
        self.stats.probes += 1
        try:
            reply = await self._conn().request(
                self.subjects.ping(agent_id), b"", timeout=self.settings.probe_timeout
            )
            pong = _hb_decoder.decode(reply.data)
            alive: Status | None = pong.status if pong.status in _ALIVE else Status.UP
            why = "probe answered"
        except (nats.errors.Error, msgspec.DecodeError, TimeoutError) as exc:
            pong, alive = None, None
            why = "probe failed: " + (
                "no responders" if isinstance(exc, nats.errors.NoRespondersError) else "timeout"
            )
        now = now_ms()
        events: list[Transition] = []

        def change(before: AgentRecord | None) -> tuple[AgentRecord, float] | None:
            events.clear()
            if before is None or before.status != Status.UNKNOWN:
                return None  # a heartbeat or a re-registration settled it meanwhile
            if alive is not None:
                new, t = self._transition(before, alive, why, heartbeat=pong, last_seen_ms=now)
                ttl = self.settings.lease_ttl
            else:
                new, t = self._transition(before, Status.DOWN, why)
                ttl = self.settings.down_grace
            if t is not None:
                events.append(t)
            return new, ttl

        with contextlib.suppress(_kv.LeaseConflict, nats.errors.Error, OSError, TimeoutError):
            await self._update(agent_id, change)
        for ev in events:
            await self._publish_event(agent_id, ev, removed=False)

    async def _forget(self, agent_id: str, marker_revision: int, previous: AgentRecord) -> None:
        """A DOWN (or UNKNOWN) record outlived its grace period: it is gone."""
        try:
            await _kv.remove(self._jsc(), self.bucket_name, agent_id, last=marker_revision)
        except (_kv.LeaseConflict, nats.errors.Error, OSError, TimeoutError):
            return  # another replica removed it, or the agent came back
        reason = "grace period over" if previous.status == Status.DOWN else "probe lost"
        t = Transition(old=previous.status, new=Status.DOWN, reason=reason, at_ms=now_ms())
        await self._publish_event(agent_id, t, removed=True)
