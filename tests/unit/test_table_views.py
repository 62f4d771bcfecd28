"""The routing table fed by one view per followed capability (pure logic, no server):
copies of one agent arrive on several views, each a consumer of its own."""

import msgspec

from reach._client.table import RoutingTable
from reach._kv import KvEntry
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Heartbeat, Status


def record(agent_id: str, *caps: str, load: float = 0.0, status=Status.UP) -> AgentRecord:
    return AgentRecord(
        info=AgentInfo(
            agent_id=agent_id,
            name="w",
            capabilities=[CapabilityInfo(name=c) for c in caps],
        ),
        status=status,
        heartbeat=Heartbeat(agent_id=agent_id, load=load),
    )


def copy(rec: AgentRecord, revision: int) -> KvEntry:
    return KvEntry(revision, msgspec.json.encode(rec), None)


def following(*caps: str) -> RoutingTable:
    table = RoutingTable()
    for cap in caps:
        table.view(cap).replace({})
        table.loaded(cap)
    return table


def test_an_older_copy_from_a_lagging_view_does_not_replace_a_newer_one():
    table = following("x.a", "x.b")
    a, b = table.view("x.a"), table.view("x.b")
    first, second = record("m-1", "x.a", "x.b", load=0.1), record("m-1", "x.a", "x.b", load=0.9)
    a.update("x.a.m-1", copy(first, 10))
    b.update("x.b.m-1", copy(first, 11))  # the copies of one write, in order
    a.update("x.a.m-1", copy(second, 12))
    b.update("x.b.m-1", copy(first, 11))  # the view of x.b, behind, repeats the older one
    assert table.records["m-1"].heartbeat.load == 0.9
    b.update("x.b.m-1", copy(second, 13))
    assert table.records["m-1"].heartbeat.load == 0.9


def test_an_older_delete_does_not_remove_an_agent_written_since():
    table = following("x.a")
    view = table.view("x.a")
    view.update("x.a.m-1", copy(record("m-1", "x.a"), 20))
    view.update("x.a.m-1", KvEntry(19, None, "DEL"))  # from before the write above
    assert list(table.records) == ["m-1"]
    view.update("x.a.m-1", KvEntry(21, None, "DEL"))
    assert list(table.records) == []


def test_a_snapshot_is_trusted_whole_even_with_lower_revisions():
    """After a server restart the memory stream is new and its revisions start over: the
    rebuild's snapshot replaces what was known, and updates after it apply."""
    table = following("x.a")
    view = table.view("x.a")
    view.update("x.a.m-1", copy(record("m-1", "x.a", load=0.1), 500))
    view.replace({"x.a.m-1": copy(record("m-1", "x.a", load=0.5), 3)})
    assert table.records["m-1"].heartbeat.load == 0.5
    view.update("x.a.m-1", copy(record("m-1", "x.a", load=0.7), 4))
    assert table.records["m-1"].heartbeat.load == 0.7


def test_an_agent_leaving_one_capability_stays_for_another_until_it_leaves_both():
    table = following("x.a", "x.b")
    a, b = table.view("x.a"), table.view("x.b")
    both = record("m-1", "x.a", "x.b")
    a.update("x.a.m-1", copy(both, 1))
    b.update("x.b.m-1", copy(both, 2))
    only_b = record("m-1", "x.b")
    b.update("x.b.m-1", copy(only_b, 3))
    a.update("x.a.m-1", KvEntry(4, None, "DEL"))
    assert list(table.records) == ["m-1"]
    assert table.offering("x.a") == []
    assert [r.info.agent_id for r in table.offering("x.b")] == ["m-1"]
    b.update("x.b.m-1", KvEntry(5, None, "DEL"))
    assert list(table.records) == []


def test_a_capability_counts_as_followed_only_once_loaded_and_not_after_reset():
    table = RoutingTable()
    view = table.view("x.a")
    assert not table.follows("x.a")  # fed, not loaded yet
    view.replace({})
    table.loaded("x.a")
    assert table.follows("x.a")
    view.update("x.a.m-1", copy(record("m-1", "x.a"), 1))
    table.reset()
    assert not table.follows("x.a")
    assert table.records == {}


def test_a_delete_ignored_as_older_leaves_no_ghost():
    """The agent drops x.b: the view of x.a brings the newer record before the lagging
    view of x.b brings its (older) delete, which is ignored; when the agent then leaves
    x.a too, it leaves the table."""
    table = following("x.a", "x.b")
    a, b = table.view("x.a"), table.view("x.b")
    both = record("m-1", "x.a", "x.b")
    a.update("x.a.m-1", copy(both, 10))
    b.update("x.b.m-1", copy(both, 11))
    a.update("x.a.m-1", copy(record("m-1", "x.a"), 22))  # x.b dropped
    b.update("x.b.m-1", KvEntry(21, None, "DEL"))  # older than 22: ignored
    assert table.offering("x.b") == []
    a.update("x.a.m-1", KvEntry(30, None, "DEL"))
    assert table.records == {}
