"""What one registry replica holds in memory, all of it bounded and rebuilt from the bucket.

``Entries`` is this replica's view of the leases (a ``MirrorSink`` fed by the bucket
watch): the newest revision of each key, for compare-and-set, and its record when it has
one. ``Throttle`` remembers whom we recently asked to register again (and whose refused
requests we recently logged). ``Core`` is what the
registry's parts share. Pure and synchronous: unit tests need no server.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from .. import _kv
from .._background import Background
from .._kv import KvEntry
from .._subjects import Subjects
from ..errors import NotStarted
from ..settings import ReachSettings
from ..wire import AgentRecord
from .counters import RegistryCells, RegistryStats

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsConnection
    from nats.js import JetStreamContext

    from .._jsapi import JsApi

__all__ = ["Core", "Entries", "Entry", "Throttle"]

log = logging.getLogger("reach.registry")

_record_decoder = msgspec.json.Decoder(AgentRecord)

#: Called when the server expired a lease that had a record: (key, marker revision, record).
Expired = Callable[[str, int, AgentRecord], None]


@dataclass(slots=True)
class Entry:
    """A key's newest revision; ``record`` is None for a marker or an undecodable value.
    ``since`` (monotonic) is when it last changed, so record-less entries can be dropped.
    ``own``: a write of ours the watch has not confirmed yet (it may be newer than a
    snapshot being taken). ``deleted``: the key was deleted (deregistered or removed),
    not expired."""

    revision: int
    record: AgentRecord | None
    since: float = 0.0
    own: bool = False
    deleted: bool = False


class Entries:
    """This replica's view of the bucket; writes of its own are folded in by revision.

    A key whose newest message is a delete, an expiry marker or garbage keeps its
    revision with no record (a tombstone) until ``prune`` drops it.

    The bucket lives in memory, so a server restart creates it again and its revisions
    start over at 1: "the newest revision wins" holds only within one stream. Both ways a
    new stream shows itself are handled: a snapshot older than what the watch told us
    (``replace``), and a write of ours that succeeded below the revision we held (``stored``
    with ``prior``)."""

    def __init__(self, stats: RegistryStats, clock: Callable[[], float] = time.monotonic) -> None:
        self.stats = stats
        self.clock = clock
        self.on_expired: Expired | None = None
        self._map: dict[str, Entry] = {}

    def __len__(self) -> int:
        return len(self._map)

    def get(self, key: str) -> Entry | None:
        return self._map.get(key)

    def records(self) -> dict[str, AgentRecord]:
        return {k: e.record for k, e in self._map.items() if e.record is not None}

    def decode(self, key: str, value: bytes) -> AgentRecord | None:
        """A stored record, or None (counted) when someone wrote something else there."""
        try:
            return _record_decoder.decode(value)
        except msgspec.DecodeError:
            self.stats.corrupt_records += 1
            log.warning("registry: undecodable record for %s; the next write replaces it", key)
            return None

    def _entry(self, key: str, kv: KvEntry) -> Entry:
        record = self.decode(key, kv.value) if kv.operation is None and kv.value else None
        if kv.operation is None and not kv.value:
            self.stats.corrupt_records += 1  # an empty put is no record either
        return Entry(kv.revision, record, self.clock(), deleted=kv.operation == "DEL")

    # -- MirrorSink ------------------------------------------------------------------

    def replace(self, snapshot: dict[str, KvEntry]) -> None:
        """A fresh snapshot: keys missing from it are gone.

        Markers in it are not news, so the first snapshot suspects nobody; but a rebuild
        that finds a marker newer than a record we held has caught an expiry that fell
        between the old watcher and the new one, and reports it like the watch would.

        The old watcher is stopped before the snapshot is taken, so within one stream it
        holds every key at (at least) the revision the watch told us; only an unconfirmed
        write of ours can be newer, and then newer than all of it. Anything else means the
        stream was created again: drop what we knew of the old one and take the snapshot."""
        if self._recreated(snapshot):
            log.warning("registry: the leases bucket was created again; view rebuilt")
            self._map = {key: self._entry(key, kv) for key, kv in snapshot.items()}
            return
        fresh: dict[str, Entry] = {}
        missed: list[tuple[str, int, AgentRecord]] = []
        for key, kv in snapshot.items():
            current = self._map.get(key)
            if current is not None and current.revision >= kv.revision:
                current.own = False  # in the next snapshot it must be there
                fresh[key] = current  # our own write landed after the snapshot was taken
                continue
            fresh[key] = self._entry(key, kv)
            if kv.operation == "PURGE" and current is not None and current.record is not None:
                missed.append((key, kv.revision, current.record))
        self._map = fresh
        if self.on_expired is not None:
            for key, revision, record in missed:
                self.on_expired(key, revision, record)

    def _recreated(self, snapshot: dict[str, KvEntry]) -> bool:
        newest = max((kv.revision for kv in snapshot.values()), default=0)
        for key, kv in snapshot.items():
            current = self._map.get(key)
            if current is None or current.revision <= kv.revision:
                continue
            if not current.own or current.revision <= newest:
                return True
        return False

    def update(self, key: str, kv: KvEntry) -> None:
        current = self._map.get(key)
        if current is not None and kv.revision <= current.revision:
            if kv.revision == current.revision:
                current.own = False  # the watch confirms our write
            return  # our own write already told us (or the watch replays an old one)
        entry = self._entry(key, kv)
        self._map[key] = entry
        previous = current.record if current is not None else None
        if kv.operation == "PURGE" and previous is not None and self.on_expired is not None:
            self.on_expired(key, kv.revision, previous)  # the server expired the lease

    # -- our own writes and housekeeping ----------------------------------------------

    def stored(
        self, key: str, revision: int, record: AgentRecord | None, prior: Entry | None = None
    ) -> None:
        """A write of ours succeeded; the watch will confirm it later (and be ignored).
        ``record`` None is a delete. ``prior`` is the entry we held when we sent it: if it
        is still there, nothing newer came in meanwhile, so one with a higher revision is
        from a stream that no longer exists and ours replaces it."""
        current = self._map.get(key)
        if current is None or current.revision < revision or current is prior:
            self._map[key] = Entry(revision, record, self.clock(), own=True, deleted=record is None)

    def prune(self, older_than: float) -> int:
        """Drop record-less entries (deletes, expiries, garbage) unchanged since
        ``older_than`` (monotonic), so churn cannot grow this map; how many went.

        They are kept a little while so that the revision order holds against a late
        write of ours, and so a quick re-registration needs no extra read."""
        stale = [k for k, e in self._map.items() if e.record is None and e.since < older_than]
        for key in stale:
            del self._map[key]
        return len(stale)


class Throttle:
    """Whom we asked to register again within ``interval`` seconds (monotonic).

    Oldest first, so expiry pops from the front; ``limit`` caps a flood of made-up ids
    (forgetting one early only means asking it again, which is harmless)."""

    def __init__(
        self,
        interval: float = 1.0,
        limit: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.limit = limit
        self.clock = clock
        self._asked: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._asked)

    def allow(self, agent_id: str) -> bool:
        """True (and remembered) unless ``agent_id`` was asked within the interval."""
        now = self.clock()
        self.prune(now)
        if agent_id in self._asked:
            return False
        self._asked[agent_id] = now
        if len(self._asked) > self.limit:
            self._asked.popitem(last=False)
        return True

    def forget(self, agent_id: str) -> None:
        self._asked.pop(agent_id, None)

    def prune(self, now: float | None = None) -> None:
        horizon = (self.clock() if now is None else now) - self.interval
        asked = self._asked
        while asked:
            first = next(iter(asked.values()))
            if first > horizon:
                break
            asked.popitem(last=False)


@dataclass(slots=True)
class Core:
    """What the registry's parts share: identity, settings, counters, state, connection."""

    settings: ReachSettings
    subjects: Subjects
    registry_id: str
    bucket: str
    #: the leases again under ``<capability>.<agent id>`` keys (``RecordWriter.index``)
    routes: str
    stats: RegistryStats
    entries: Entries
    throttle: Throttle
    owner: Background
    nc: NatsConnection | None = None
    #: whose refused requests were logged within the last minute (a flood logs once a minute)
    warned: Throttle = field(default_factory=lambda: Throttle(interval=60.0, limit=1024))
    js: JetStreamContext | None = None
    #: the connection's JetStream API requester: every lease write and read goes through it
    api: JsApi | None = None
    cells: RegistryCells = field(default_factory=RegistryCells)
    #: refusals on the connection that were the routes bucket's (``Registry._bind_routes``):
    #: the server refused this user the routes bucket, so no copies are made (clients then
    #: follow the whole fleet, ``reach._client.watches``); a start does not fail for them
    routes_refused: int = 0
    #: the routes bucket was made (or found) on this connection
    routes_made: bool = False

    @property
    def lease_ttl(self) -> float:
        return self.settings.lease_ttl

    def conn(self) -> NatsConnection:
        if self.nc is None:
            raise NotStarted("registry is not started")
        return self.nc

    def jsc(self) -> JetStreamContext:
        if self.js is None:
            raise NotStarted("registry is not started")
        return self.js

    def publisher(self) -> JetStreamContext | _kv.Publish:
        """Where lease writes go: the request inbox (``api``) when open, else nats-py's
        JetStream context, as the task store does (``reach._jsapi.js_publish``)."""
        return self.api.publish if self.api is not None else self.jsc()

    def reader(self) -> JetStreamContext | _kv.GetLast:
        """Where a key's newest message is read: like ``publisher``."""
        return self.api.last_msg if self.api is not None else self.jsc()
