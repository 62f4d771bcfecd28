"""Every write a registry makes to the leases bucket: compare-and-set on the key's revision.

A replica reads a key's revision from its own view (``Entries``), decides the new record,
and writes it only if nobody wrote since. When someone did (another replica, or a heartbeat
handled a moment earlier), it re-reads the key and decides again on the fresh record. A
value that does not decode counts as no record at all, so the next registration replaces
it instead of failing on it forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import msgspec

from .. import _kv
from .._codec import encode_json, now_ms
from .._nats import TRANSIENT
from ..errors import PayloadTooLarge, Unauthorized
from ..wire import AgentEvent, AgentRecord, Status, Transition
from .state import Core

__all__ = ["ALIVE", "WRITE_FAILED", "Change", "RecordWriter", "Updated"]

log = logging.getLogger("reach.registry")

ALIVE = (Status.UP, Status.DEGRADED, Status.PAUSED)
MAX_TRANSITIONS = 8
CAS_RETRIES = 5
#: What a write may raise that is not a bug: the server away or slow, lost races, a
#: record over the server's max_payload (``PayloadTooLarge``: not sent), or a subject the
#: registry's user may not use (``Unauthorized``, from the request inbox: a deployment's
#: own permissions; logged like the others, and the next heartbeat tries again).
WRITE_FAILED: tuple[type[BaseException], ...] = (
    *TRANSIENT,
    _kv.Conflict,
    PayloadTooLarge,
    Unauthorized,
)

#: Given the stored record (None: none, or undecodable), the record to write and its TTL,
#: or None to write nothing.
Change = Callable[[AgentRecord | None], tuple[AgentRecord, float] | None]


class Updated(NamedTuple):
    """What ``RecordWriter.update`` found and did: the record it decided on (None: none, or
    undecodable), the one it wrote (None: nothing), and whether the key was deleted."""

    before: AgentRecord | None
    written: AgentRecord | None
    deleted: bool


class RecordWriter:
    """Reads, compare-and-set writes and removals of agent records (their leases in the
    bucket), plus the status transitions they make and the events that announce them."""

    def __init__(self, core: Core) -> None:
        self.core = core

    async def write(
        self,
        agent_id: str,
        record: AgentRecord,
        ttl: float,
        last: int,
        before: AgentRecord | Literal["viewed"] | None = "viewed",
    ) -> int:
        """Write iff the key's newest revision is ``last``; ``_kv.Conflict`` otherwise.
        A record over max_payload with its headers is ``PayloadTooLarge``, and not sent:
        the server would close the registry's connection for it. ``before``: the record
        this one replaces, as read fresh after a conflict ("viewed": this replica's view);
        the routes copies drop the capabilities it had and this one lacks."""
        core = self.core
        prior = core.entries.get(agent_id)
        value, limit = encode_json(record), core.conn().max_payload
        rev = await _kv.write(
            core.publisher(), core.bucket, agent_id, value, last=last, ttl=ttl, limit=limit
        )
        core.entries.stored(agent_id, rev, record, prior)
        if before == "viewed":
            before = prior.record if prior is not None else None
        await self.index(agent_id, value, record, before, ttl)
        return rev

    async def update(self, agent_id: str, change: Change) -> Updated:
        """Read-modify-CAS-write, retried on the fresh record."""
        core = self.core
        entry = core.entries.get(agent_id)
        last = entry.revision if entry is not None else 0
        before = entry.record if entry is not None else None
        deleted = entry is not None and entry.deleted
        for _ in range(CAS_RETRIES):
            decided = change(before)
            if decided is None:
                return Updated(before, None, deleted)
            record, ttl = decided
            try:
                await self.write(agent_id, record, ttl, last, before)
            except _kv.Conflict:
                core.stats.cas_conflicts += 1
                fresh = await _kv.latest(core.reader(), core.bucket, agent_id)
                last = fresh.revision
                before = core.entries.decode(agent_id, fresh.value) if fresh.value else None
                deleted = fresh.operation == "DEL"
                continue
            return Updated(before, record, False)
        raise _kv.Conflict(agent_id)

    async def remove(self, agent_id: str, last: int | None) -> None:
        """Delete the key (compare-and-set when ``last`` is given). The delete marker
        expires like a lease marker does, so agent churn cannot grow the bucket."""
        core = self.core
        prior = core.entries.get(agent_id)
        rev = await _kv.delete(
            core.publisher(), core.bucket, agent_id, last=last, ttl=_kv.MARKER_TTL
        )
        core.entries.stored(agent_id, rev, None, prior)
        await self.index(agent_id, b"", None, prior.record if prior is not None else None, 0.0)

    async def index(
        self,
        agent_id: str,
        value: bytes,
        record: AgentRecord | None,
        before: AgentRecord | None,
        ttl: float,
    ) -> None:
        """Copy a lease write into the routes bucket: the same value, with the same TTL,
        under ``<capability>.<agent id>`` for each capability it serves, and a delete for
        each capability the record before it served and this one does not (``record``
        None: the lease was deleted). A client then follows one capability with a watch
        filtered to ``<capability>.*``.

        The copies are plain publishes, not awaited: the lease write before them was the
        acked compare-and-set, and waiting for a second ack per capability would double a
        registry's cost per heartbeat. A copy lost with the connection is counted
        (``routes_unsent``) and mended by the agent's next write, within one renewal; one
        that expires, expires with its lease."""
        core = self.core
        now = {c.name for c in record.info.capabilities} if record is not None else set()
        gone = {c.name for c in before.info.capabilities} - now if before is not None else set()
        if core.routes_refused or (not now and not gone):
            return
        nc = core.conn()
        put = {_kv.TTL: _kv.ttl_header(ttl)}
        drop = {_kv.KV_OP: "DEL", _kv.TTL: _kv.ttl_header(_kv.MARKER_TTL)}
        base = f"$KV.{core.routes}."
        try:
            for name in now:
                await nc.publish(f"{base}{name}.{agent_id}", value, headers=put)
            for name in gone:
                await nc.publish(f"{base}{name}.{agent_id}", b"", headers=drop)
        except TRANSIENT as exc:
            core.stats.routes_unsent += 1
            log.debug("registry: routes of %s not written: %s", agent_id, exc)

    async def exists(self, agent_id: str) -> bool:
        """Whether the key holds a value now (read from the stream, not from our view)."""
        core = self.core
        return (await _kv.latest(core.reader(), core.bucket, agent_id)).value is not None

    def transition(
        self, record: AgentRecord, new: Status, reason: str, detail: str = "", **changes: Any
    ) -> tuple[AgentRecord, Transition | None]:
        """``record`` moved to ``new`` (with ``changes``); the transition, if any.
        ``detail``: the agent's own reason, when it reported the change."""
        if record.status == new:
            return msgspec.structs.replace(record, **changes), None
        t = Transition(old=record.status, new=new, reason=reason, at_ms=now_ms(), detail=detail)
        transitions = [*record.transitions[-(MAX_TRANSITIONS - 1) :], t]
        replaced = msgspec.structs.replace(
            record, status=new, transitions=transitions, registry=self.core.registry_id, **changes
        )
        return replaced, t

    async def announce(self, agent_id: str, transition: Transition, *, removed: bool) -> None:
        """Publish a status transition on ``evt.agent.<id>`` (best effort)."""
        self.core.cells.transition(transition.new.value, transition.reason)
        event = AgentEvent(
            agent_id=agent_id,
            old=transition.old,
            new=transition.new,
            reason=transition.reason,
            at_ms=transition.at_ms,
            removed=removed,
            detail=transition.detail,
        )
        try:
            await self.core.conn().publish(self.core.subjects.event(agent_id), encode_json(event))
        except TRANSIENT as exc:
            log.debug("registry: event for %s not sent: %s", agent_id, exc)
