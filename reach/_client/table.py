"""A client's live copy of the registry, fed by BucketMirrors.

Two ways to follow, one table. A client that only calls follows each capability it calls,
from its first call on: a mirror of ``reach_routes`` filtered to ``<capability>.*`` feeds
a ``CapabilityView`` (so its cost depends on the capabilities it calls, not on the fleet).
A client that reads the whole fleet (``agents()`` without a capability, ``changes()``, the
gateway, MCP) follows everything: one mirror of ``reach_agents`` feeds the table itself,
and the views stop. Either way the mirrors (``reach._kv``) own the watches, their
watchdogs and rebuilds; the table decodes records, indexes them by capability, tells the
router when an instance leaves (so per-instance state goes with it) and feeds the bounded
queues of ``Client.changes()`` listeners.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from .._kv import KvEntry
from .._routing import eligible, in_range
from ..wire import PROBE_NO_RESPONDERS, AgentRecord, Priority, Status

__all__ = ["LISTEN_LIMIT", "CapabilityView", "RoutingTable"]

log = logging.getLogger("reach.table")

#: Changes a ``changes()`` listener may have waiting; past it the oldest are dropped.
LISTEN_LIMIT = 1024

_decoder = msgspec.json.Decoder(AgentRecord)


def _ignore(agent_id: str) -> None:
    return None


class RoutingTable:
    """agent_id -> record, indexed by capability; replaced wholesale after each rebuild.

    When the bucket or the watch is unavailable the mirror keeps the last table (it is marked
    stale there): routing on slightly old data beats failing requests.
    """

    def __init__(
        self,
        *,
        on_leave: Callable[[str], None] = _ignore,
        on_renew: Callable[[str], None] = _ignore,
        on_down: Callable[[str], None] = _ignore,
        listen_limit: int = LISTEN_LIMIT,
    ) -> None:
        self.records: dict[str, AgentRecord] = {}
        self._by_cap: dict[str, set[str]] = {}
        self._on_leave = on_leave
        self._on_renew = on_renew
        #: the registry declared an instance DOWN because nobody listens on its subjects
        #: (its connection is gone). Not for a probe that timed out: an agent whose loop
        #: is blocked may still be running the work. A graceful stop removes the record.
        self._on_down = on_down
        self._listen_limit = listen_limit
        self._listeners: list[asyncio.Queue[AgentRecord | str]] = []
        # Eligibility depends on status, version and tags only, not on load: cache the
        # eligible ids per query, keyed by a generation that changes with the shape of a
        # capability's instances. Generations come from one counter, so they never repeat.
        self._gen = 0
        self._cap_gen: dict[str, int] = {}
        self._eligible: dict[tuple[Any, ...], tuple[int, list[str]]] = {}
        #: holding every agent (``reach_agents``'s first snapshot came), or only the
        #: capabilities in ``_loaded`` (their views' first snapshots came)
        self.whole = False
        self._views: dict[str, set[str]] = {}  # fed capability -> the ids its index holds
        self._loaded: set[str] = set()
        #: agent id -> the newest routes revision applied, over all its views: each view
        #: is a consumer of its own, so one that lags could bring an older copy after a
        #: newer one (the copies of one write are published together, in order)
        self._revisions: dict[str, int] = {}
        self.dropped = 0  # changes dropped because a listener fell behind
        self.clamped = 0  # records whose heartbeat numbers were out of range
        self.undecodable = 0  # records that could not be decoded or name another key (ignored)

    # -- reading -----------------------------------------------------------------------

    def follows(self, capability: str) -> bool:
        """Whether the table holds ``capability``'s instances: its watch (or the whole
        fleet's) has loaded, so routing may trust what it finds, or does not find."""
        return self.whole or capability in self._loaded

    @property
    def followed(self) -> int:
        """Capabilities followed one by one (0 when following everything)."""
        return len(self._views)

    def loaded(self, capability: str) -> None:
        """``capability``'s watch has started (its snapshot is in, or its bucket is not
        there yet: then the queue group serves it, as with no instance at all)."""
        if capability in self._views:
            self._loaded.add(capability)

    def unfollow(self, capability: str) -> None:
        """``capability``'s watch failed to start: the next call starts it again."""
        held = self._views.pop(capability, set())
        self._loaded.discard(capability)
        for agent_id in held:
            if not any(agent_id in ids for ids in self._views.values()):
                self._revisions.pop(agent_id, None)
                self._set(agent_id, None)

    def reset(self) -> None:
        """The client closed: its watches are gone, so nothing here is followed any more
        and every record leaves (a reopened client follows afresh)."""
        self.whole = False
        self._views.clear()
        self._loaded.clear()
        self._revisions.clear()
        for agent_id in list(self.records):
            self._set(agent_id, None)

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
        """A bounded queue of changes: a record when it is written, the agent id when it goes.
        A listener that falls behind loses the oldest changes (counted in ``dropped``)."""
        q: asyncio.Queue[AgentRecord | str] = asyncio.Queue(self._listen_limit)
        self._listeners.append(q)
        return q

    def unlisten(self, q: asyncio.Queue[AgentRecord | str]) -> None:
        if q in self._listeners:
            self._listeners.remove(q)

    def footprint(self) -> dict[str, int]:
        """Sizes of the table's maps and queues (all bounded by the bucket's size)."""
        return {
            "table.records": len(self.records),
            "table.capabilities": len(self._by_cap),
            "table.followed": len(self._views),
            "table.generations": len(self._cap_gen),
            "table.eligible_cache": len(self._eligible),
            "table.listeners": len(self._listeners),
            "table.queued": max((q.qsize() for q in self._listeners), default=0),
        }

    # -- following the whole fleet: the ``reach_agents`` mirror's sink ---------------------

    def replace(self, snapshot: dict[str, KvEntry]) -> None:
        """A fresh snapshot of the whole fleet after a (re)build: reconcile, telling who
        left. The first one makes the table whole: from then on the views' feeds are
        ignored (their mirrors are being stopped); until then they keep it current."""
        self.whole = True
        self._views.clear()
        self._loaded.clear()
        self._revisions.clear()
        decoded: dict[str, AgentRecord] = {}
        for key, entry in snapshot.items():
            record = self._decode(key, entry)
            if record is None and entry.value is not None:
                record = self.records.get(key)  # undecodable: keep what we had, as update does
            if record is not None:
                decoded[key] = record
        for key in [k for k in self.records if k not in decoded]:
            self._set(key, None)
        for key, record in decoded.items():
            self._set(key, record)

    def update(self, key: str, entry: KvEntry) -> None:
        record = self._decode(key, entry)
        if record is None and entry.value is not None:
            return  # undecodable: keep what we had
        self._set(key, record)

    # -- following one capability: a ``CapabilityView``'s feed ----------------------------

    def view(self, capability: str) -> CapabilityView:
        """The sink of a mirror of ``capability``'s routes, fed from now on (followed once
        ``loaded``)."""
        if not self.whole:
            self._views.setdefault(capability, set())
        return CapabilityView(self, capability)

    def replace_view(self, capability: str, snapshot: dict[str, KvEntry]) -> None:
        """A fresh snapshot of one capability's routes (keys: agent ids)."""
        held = self._views.get(capability)
        if self.whole or held is None:
            return
        decoded: dict[str, AgentRecord] = {}
        for agent_id, entry in snapshot.items():
            record = self._decode(agent_id, entry)
            if record is None and entry.value is not None:
                record = self.records.get(agent_id)  # undecodable: keep what we had
            if record is not None:
                decoded[agent_id] = record
        for agent_id in [i for i in held if i not in decoded]:
            self._leave_view(capability, agent_id)
        for agent_id, record in decoded.items():
            # a snapshot is trusted whole (the stream may be a new one, its revisions
            # started over): its revisions replace what was known
            self._revisions[agent_id] = snapshot[agent_id].revision
            self._hold(capability, agent_id, record)

    def update_view(self, capability: str, agent_id: str, entry: KvEntry) -> None:
        held = self._views.get(capability)
        if self.whole or held is None:
            return
        if entry.revision < self._revisions.get(agent_id, 0):
            return  # an older copy than one another view brought: already superseded
        record = self._decode(agent_id, entry)
        if record is None:
            if entry.value is None:
                self._leave_view(capability, agent_id)
            return  # undecodable: keep what we had
        self._revisions[agent_id] = entry.revision
        self._hold(capability, agent_id, record)

    def _hold(self, capability: str, agent_id: str, record: AgentRecord) -> None:
        """``record`` came on ``capability``'s view: the table holds it, and the views
        hold the agent for the followed capabilities it lists, no others (a delete on a
        view that lags, older than this record, may never come to take it out)."""
        self._views[capability].add(agent_id)
        names = {c.name for c in record.info.capabilities}
        for name, held in self._views.items():
            if name not in names:
                held.discard(agent_id)
        self._set(agent_id, record)

    def _leave_view(self, capability: str, agent_id: str) -> None:
        """``agent_id`` left one capability's routes: it leaves the table unless another
        followed capability still holds it (then only that capability no longer lists
        it; its record there says what it still serves)."""
        self._views[capability].discard(agent_id)
        if any(agent_id in held for held in self._views.values()):
            ids = self._by_cap.get(capability)
            if ids is not None and agent_id in ids:
                ids.discard(agent_id)
                self._gen += 1
                self._cap_gen[capability] = self._gen
                if not ids:
                    self._drop_capability(capability)
            return
        self._revisions.pop(agent_id, None)
        self._set(agent_id, None)

    def _decode(self, key: str, entry: KvEntry) -> AgentRecord | None:
        if entry.value is None:
            return None
        try:
            record = _decoder.decode(entry.value)
        except msgspec.DecodeError:
            self.undecodable += 1
            log.warning("routing table: undecodable record %s ignored", key)
            return None
        if record.info.agent_id != key:
            # routing looks instances up by id: a record under another key would break it
            self.undecodable += 1
            log.warning(
                "routing table: record %s names agent %s; ignored", key, record.info.agent_id
            )
            return None
        hb = record.heartbeat
        if hb is not None and not in_range(hb):
            self.clamped += 1  # routing clamps the numbers; count the peer that sent them
        return record

    def _set(self, key: str, record: AgentRecord | None) -> None:
        old = self.records.pop(key, None)
        if old is None and record is None:
            return
        if old is not None:
            for cap in old.info.capabilities:
                ids = self._by_cap.get(cap.name)
                if ids is not None:
                    ids.discard(key)
        if record is not None:
            self.records[key] = record
            for cap in record.info.capabilities:
                self._by_cap.setdefault(cap.name, set()).add(key)
        if old is None or record is None or _shape(old) != _shape(record):
            names = {c.name for r in (old, record) if r is not None for c in r.info.capabilities}
            for name in names:
                if self._by_cap.get(name):
                    self._gen += 1
                    self._cap_gen[name] = self._gen
                elif name in self._by_cap:
                    self._drop_capability(name)
        if record is None:
            self._on_leave(key)
            self._notify(key)
        else:
            self._on_renew(key)
            if (
                record.status is Status.DOWN
                and (old is None or old.status is not Status.DOWN)
                and record.transitions
                and record.transitions[-1].reason == PROBE_NO_RESPONDERS
            ):
                self._on_down(key)
            self._notify(record)

    def _drop_capability(self, name: str) -> None:
        """No instance offers ``name`` any more: forget its index and cached answers."""
        del self._by_cap[name]
        self._cap_gen.pop(name, None)
        for query in [q for q in self._eligible if q[0] == name]:
            del self._eligible[query]

    def _notify(self, change: AgentRecord | str) -> None:
        for q in self._listeners:
            if q.full():
                q.get_nowait()  # the oldest goes: a slow listener cannot grow without end
                self.dropped += 1
            q.put_nowait(change)


class CapabilityView:
    """The sink of one capability's routes mirror: keys ``<capability>.<agent id>`` become
    agent ids, and the records go to the table's view of that capability."""

    __slots__ = ("_cut", "_table", "capability")

    def __init__(self, table: RoutingTable, capability: str) -> None:
        self._table = table
        self.capability = capability
        self._cut = len(capability) + 1

    def replace(self, snapshot: dict[str, KvEntry]) -> None:
        cut = self._cut
        self._table.replace_view(self.capability, {k[cut:]: e for k, e in snapshot.items()})

    def update(self, key: str, entry: KvEntry) -> None:
        self._table.update_view(self.capability, key[self._cut :], entry)


def _shape(record: AgentRecord) -> tuple[Any, ...]:
    """What eligibility depends on (a heartbeat's load and latency do not change it)."""
    info = record.info
    return (record.status, tuple(info.tags), tuple((c.name, c.version) for c in info.capabilities))
