"""The registry's parts that need no server: its view of the bucket, the re-register
throttle, input checks, and the bookkeeping of heartbeat writes and expiry work."""

import asyncio
import math
import time
from types import SimpleNamespace

import msgspec
import pytest

from reach._background import Background
from reach._kv import KvEntry
from reach._registry.checks import (
    MAX_LATENCY_MS,
    MAX_REASON,
    check_registration,
    is_stale,
    sanitize_heartbeat,
)
from reach._registry.counters import RegistryStats
from reach._registry.heartbeats import Heartbeats
from reach._registry.liveness import Liveness
from reach._registry.state import Core, Entries, Throttle
from reach._registry.writer import RecordWriter
from reach._subjects import Subjects
from reach.settings import ReachSettings
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Heartbeat, Registration, Status


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(agent_id: str, status: Status = Status.UP) -> AgentRecord:
    return AgentRecord(info=AgentInfo(agent_id=agent_id, name="geo"), status=status)


def put(revision: int, rec: AgentRecord) -> KvEntry:
    return KvEntry(revision, msgspec.json.encode(rec), None)


def marker(revision: int, operation: str = "PURGE") -> KvEntry:
    return KvEntry(revision, None, operation)


@pytest.fixture
def view():
    expired: list[tuple[str, int, Status]] = []
    entries = Entries(RegistryStats(), clock=Clock())
    entries.on_expired = lambda key, rev, prev: expired.append((key, rev, prev.status))
    return entries, expired


# -- Entries: the bucket as this replica sees it -----------------------------------------


def test_updates_apply_in_revision_order_only(view):
    entries, _ = view
    entries.update("a", put(5, record("a", Status.PAUSED)))
    entries.update("a", put(3, record("a", Status.UP)))  # replayed, older
    assert entries.records()["a"].status == Status.PAUSED
    entries.stored("a", 4, record("a", Status.DEGRADED))  # our write, but already outrun
    assert entries.get("a").revision == 5
    entries.stored("a", 7, record("a", Status.UP))
    entries.update("a", put(7, record("a", Status.UP)))  # the watch confirms it later
    assert entries.get("a").revision == 7


def test_expiry_marker_of_a_known_record_is_reported_once(view):
    entries, expired = view
    entries.update("a", put(1, record("a", Status.UP)))
    entries.update("b", put(2, record("b", Status.DOWN)))
    entries.update("a", marker(3))
    entries.update("b", marker(4))
    entries.update("a", marker(3))  # the same marker again
    entries.update("c", marker(5))  # a key we never held: nothing to suspect
    assert expired == [("a", 3, Status.UP), ("b", 4, Status.DOWN)]
    assert entries.records() == {}
    assert entries.get("a").revision == 3  # the revision stays for the next CAS


def test_delete_leaves_a_tombstone_that_a_late_write_of_ours_cannot_undo(view):
    entries, expired = view
    entries.update("a", put(1, record("a")))
    entries.update("a", marker(3, "DEL"))
    entries.stored("a", 2, record("a"))  # our write was acknowledged before the delete
    assert entries.records() == {}
    assert expired == []


def test_first_snapshot_suspects_nobody(view):
    entries, expired = view
    entries.replace({"a": marker(3), "b": put(4, record("b")), "c": marker(5, "DEL")})
    assert expired == []
    assert set(entries.records()) == {"b"}
    assert len(entries) == 3


def test_rebuild_reports_an_expiry_that_fell_between_watchers(view):
    entries, expired = view
    entries.replace({"a": put(1, record("a")), "b": put(2, record("b"))})
    entries.stored("c", 9, record("c"))  # written by us after the snapshot was taken
    entries.replace({"a": marker(6), "b": put(2, record("b")), "c": put(8, record("c"))})
    assert expired == [("a", 6, Status.UP)]
    assert set(entries.records()) == {"b", "c"}
    assert entries.get("c").revision == 9
    entries.replace({})  # keys missing from a snapshot are gone
    assert len(entries) == 0


def test_undecodable_values_are_counted_and_hold_no_record(view):
    entries, _ = view
    entries.update("a", KvEntry(1, b"\x00garbage", None))
    entries.update("b", KvEntry(2, None, None))  # an empty put
    assert entries.records() == {}
    assert entries.get("a").revision == 1
    assert entries.stats.corrupt_records == 2


def test_prune_drops_only_old_entries_without_records(view):
    entries, _ = view
    clock = entries.clock
    entries.update("alive", put(1, record("alive")))
    entries.update("gone", marker(2, "DEL"))
    clock.now += 10
    entries.update("just-gone", marker(3, "DEL"))
    assert entries.prune(older_than=clock.now - 5) == 1
    assert {k for k in ("alive", "gone", "just-gone") if entries.get(k)} == {"alive", "just-gone"}


def test_a_recreated_bucket_replaces_the_old_view(view):
    """The bucket lives in memory: after a server restart its revisions start at 1 again.
    A snapshot older than what the watch told us can only come from a new stream."""
    entries, expired = view
    entries.update("a", put(5000, record("a", Status.UP)))  # before the server restart
    entries.update("b", put(4000, record("b", Status.UP)))
    entries.replace({"a": put(3, record("a", Status.PAUSED))})  # rebuilt on the new stream
    assert entries.get("a").revision == 3
    assert entries.records() == {"a": record("a", Status.PAUSED)}
    assert expired == []  # nothing of the old stream is news
    entries.update("a", marker(4))  # the new lease expires: seen, not ignored
    assert expired == [("a", 4, Status.PAUSED)]
    assert entries.records() == {}


def test_our_write_to_a_recreated_bucket_replaces_the_old_revision(view):
    entries, _ = view
    entries.update("a", put(5000, record("a", Status.UP)))  # before the server restart
    seen = entries.get("a")
    # Our compare-and-set write succeeded on the new stream while our view was unchanged:
    # a newer revision in the view than ours can only be from the old stream.
    entries.stored("a", 3, record("a", Status.PAUSED), prior=seen)
    assert entries.get("a").revision == 3
    assert entries.records()["a"].status == Status.PAUSED
    # Without that proof (the view changed meanwhile), the newest revision still wins.
    entries.update("a", put(9, record("a", Status.UP)))
    entries.stored("a", 8, record("a", Status.DEGRADED), prior=seen)
    assert entries.get("a").revision == 9


def test_a_write_of_ours_after_the_snapshot_is_not_taken_for_a_new_bucket(view):
    entries, expired = view
    entries.replace({"a": put(1, record("a")), "b": put(2, record("b"))})
    entries.stored("a", 9, record("a", Status.PAUSED))  # after the next snapshot began
    entries.replace({"a": put(8, record("a")), "b": marker(7)})
    assert entries.get("a").revision == 9
    assert expired == [("b", 7, Status.UP)]  # the usual reconciliation still ran
    # Once confirmed by the watch, our write is one the next snapshot must hold.
    entries.update("a", put(9, record("a", Status.PAUSED)))
    entries.replace({"a": put(2, record("a", Status.UP))})
    assert entries.get("a").revision == 2
    assert entries.records()["a"].status == Status.UP


# -- Throttle: "register again", at most once a second per agent, bounded -----------------


def test_throttle_asks_once_per_interval_on_the_monotonic_clock():
    clock = Clock()
    throttle = Throttle(interval=1.0, clock=clock)
    assert throttle.allow("a")
    assert not throttle.allow("a")
    clock.now += 0.5
    assert throttle.allow("b")
    clock.now += 0.6
    assert throttle.allow("a")  # a's interval is over; b's is not
    assert not throttle.allow("b")
    throttle.forget("b")
    assert throttle.allow("b")
    clock.now += 5
    throttle.prune()
    assert len(throttle) == 0


def test_throttle_is_bounded_under_a_flood_of_ids():
    throttle = Throttle(interval=60.0, limit=100, clock=Clock())
    assert all(throttle.allow(f"ghost-{i}") for i in range(10_000))
    assert len(throttle) == 100


# -- checks: what may be stored ---------------------------------------------------------


def beat(**fields) -> Heartbeat:
    return Heartbeat(agent_id="a", **fields)


def test_sane_heartbeat_passes_unchanged():
    hb = beat(seq=3, inflight=2, queue_len=1, load=0.25, latency_ms=12.5, served=10)
    assert sanitize_heartbeat(hb) == (hb, False)
    now = beat(seq=4, sent_ms=int(time.time() * 1000))  # unix ms is a big number
    assert sanitize_heartbeat(now) == (now, False)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"load": -1e9}, {"load": 0.0}),
        ({"load": 7.0}, {"load": 1.0}),
        ({"inflight": -5, "queue_len": -3}, {"inflight": 0, "queue_len": 0}),
        ({"latency_ms": -1.0}, {"latency_ms": 0.0}),
        ({"latency_ms": 1e300}, {"latency_ms": MAX_LATENCY_MS}),
        ({"seq": -1, "served": -2, "failed": -3, "dropped": -4}, {"seq": 0, "served": 0}),
    ],
)
def test_numbers_out_of_range_are_clamped(fields, expected):
    checked, clamped = sanitize_heartbeat(beat(**fields))
    assert clamped
    for name, value in expected.items():
        assert getattr(checked, name) == value


def test_a_reason_is_kept_to_one_printable_line_of_bounded_length():
    ok = beat(status=Status.DEGRADED, reason="handler timeouts: 3 within 10s")
    assert sanitize_heartbeat(ok) == (ok, False)
    checked, clamped = sanitize_heartbeat(beat(reason="x" * 5000))
    assert clamped
    assert checked is not None
    assert checked.reason == "x" * MAX_REASON
    checked, clamped = sanitize_heartbeat(beat(reason="line one\nline two\x1b[31m"))
    assert clamped
    assert checked is not None
    assert checked.reason == "line one line two [31m"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_numbers_that_are_not_finite_are_refused(bad):
    assert sanitize_heartbeat(beat(load=bad)) == (None, False)
    assert sanitize_heartbeat(beat(latency_ms=bad)) == (None, False)


def test_staleness_needs_both_an_older_seq_and_an_older_clock():
    stored = beat(seq=10, sent_ms=5000)
    assert is_stale(beat(seq=9, sent_ms=4000), stored)
    assert is_stale(beat(seq=10, sent_ms=5000), stored)  # the same one again
    assert not is_stale(beat(seq=11, sent_ms=5000), stored)
    assert not is_stale(beat(seq=1, sent_ms=9000), stored)  # restarted: seq starts over
    assert not is_stale(beat(seq=0, sent_ms=1), stored)  # a probe answer
    assert not is_stale(beat(seq=1), None)


def registration(**changes) -> Registration:
    info = AgentInfo(
        agent_id="geo-1",
        name="geo",
        capabilities=[CapabilityInfo(name="geo.lookup", version="1.2")],
        tags=["eu", "gpu"],
    )
    return Registration(info=msgspec.structs.replace(info, **changes))


def test_a_sound_registration_passes():
    check_registration(registration())


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"agent_id": "geo 1"}, "agent_id"),
        ({"agent_id": "x" * 200}, "agent_id"),
        ({"name": ""}, "name"),
        ({"capabilities": [CapabilityInfo(name="Geo.Lookup")]}, "capability"),
        ({"capabilities": [CapabilityInfo(name="geo.>")]}, "capability"),
        ({"capabilities": [CapabilityInfo(name="geo", version="one two")]}, "version"),
        ({"capabilities": [CapabilityInfo(name=f"c{i}") for i in range(300)]}, "capabilities"),
        ({"tags": ["eu", ""]}, "tag"),
        ({"tags": ["a,b"]}, "tag"),
        ({"tags": ["new\nline"]}, "tag"),
        ({"tags": [f"t{i}" for i in range(100)]}, "tags"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_queue": -1}, "max_queue"),
        ({"metadata": {str(i): "" for i in range(100)}}, "metadata"),
    ],
)
def test_a_registration_with_a_bad_field_is_refused_naming_it(changes, field):
    with pytest.raises(ValueError, match=field):
        check_registration(registration(**changes))


# -- bookkeeping of the work heartbeats and expiries start -------------------------------


def make_core() -> Core:
    settings = ReachSettings()
    stats = RegistryStats()
    return Core(
        settings=settings,
        subjects=Subjects(settings.subject_prefix),
        registry_id="registry-test",
        bucket="test_agents",
        routes="test_routes",
        stats=stats,
        entries=Entries(stats),
        throttle=Throttle(),
        owner=Background("registry-test"),
    )


def heartbeat_msg(core: Core, agent_id: str, seq: int) -> SimpleNamespace:
    body = msgspec.json.encode(Heartbeat(agent_id=agent_id, seq=seq))
    return SimpleNamespace(subject=core.subjects.heartbeat(agent_id), data=body)


async def test_a_heartbeat_write_cancelled_before_it_ran_gives_its_slot_back():
    core = make_core()
    heartbeats = Heartbeats(core, RecordWriter(core), max_inflight=1)
    core.throttle.allow("a")  # asked to register already: the write sends nothing (no server)
    await heartbeats.on_message(heartbeat_msg(core, "a", 1))
    assert heartbeats.in_flight == 1
    await core.owner.close()  # stop() after its drain timed out: the write never ran
    assert heartbeats.in_flight == 0
    async with asyncio.timeout(5):  # guards against hanging, not a measurement
        await heartbeats.wait_idle()
    core.owner.reopen()
    heartbeats.reset()
    async with asyncio.timeout(5):
        await heartbeats.on_message(heartbeat_msg(core, "a", 2))  # the one slot is free
        await heartbeats.wait_idle()
    assert heartbeats.in_flight == 0
    assert core.owner.failures == 0


async def test_a_mass_expiry_runs_a_bounded_number_of_tasks():
    core = make_core()
    liveness = Liveness(core, RecordWriter(core), max_probes=4)
    for i in range(100):
        liveness.expired(f"a{i}", i + 1, record(f"a{i}"))
    assert len(core.owner) <= 4
    assert liveness.queued == 100  # none has run yet
    await core.owner.close()
    liveness.reset()
    assert liveness.queued == 0
