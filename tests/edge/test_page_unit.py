"""The status page's pure parts: the event hub's bounds and the snapshot's JSON."""

import asyncio

import msgspec
import pytest

from reach import ResourceExhausted
from reach._gateway.page.hub import Hub, frame
from reach._gateway.page.snapshot import view
from reach._status import Sample
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Heartbeat, Status, Transition


def test_frame_is_one_server_sent_event():
    assert frame("agent", {"gone": "a-1"}) == b'event: agent\ndata: {"gone":"a-1"}\n\n'
    assert frame("x", {"text": "two\nlines"}).count(b"\n") == 3  # JSON escapes the newline


async def test_a_slow_subscriber_keeps_only_the_newest_frames():
    hub = Hub(max_streams=2, queue_size=4)
    slow, fast = hub.subscribe(), hub.subscribe()
    got = []
    for i in range(10):
        hub.publish(str(i).encode())
        got.append(await fast.next())
    assert got == [str(i).encode() for i in range(10)]
    assert (len(slow), slow.dropped, hub.dropped, hub.backlog) == (4, 6, 6, 4)
    assert [await slow.next() for _ in range(4)] == [b"6", b"7", b"8", b"9"]
    assert (len(slow), fast.dropped) == (0, 0)


async def test_streams_are_capped_and_refusals_counted():
    hub = Hub(max_streams=1, queue_size=1)
    sub = hub.subscribe()
    with pytest.raises(ResourceExhausted, match="too many status streams") as info:
        hub.subscribe()
    assert (info.value.code, info.value.retryable, hub.refused) == ("resource_exhausted", True, 1)
    hub.unsubscribe(sub)
    assert hub.subscribers == 0
    hub.unsubscribe(hub.subscribe())  # the place is free again


async def test_close_ends_every_stream_and_refuses_new_ones():
    hub = Hub(max_streams=4, queue_size=8)
    subs = [hub.subscribe() for _ in range(3)]
    waiting = asyncio.ensure_future(subs[0].next())  # a reader blocked on an empty queue
    await asyncio.sleep(0)
    assert not waiting.done()
    hub.publish(b"taken")
    assert await waiting == b"taken"
    waiting = asyncio.ensure_future(subs[0].next())
    await asyncio.sleep(0)
    hub.publish(b"queued, never sent")
    hub.close()
    assert await waiting is None  # woken, and nothing more after close
    assert [await s.next() for s in subs] == [None] * 3
    assert hub.subscribers == 0
    with pytest.raises(ResourceExhausted, match="shutting down"):
        hub.subscribe()
    hub.publish(b"to nobody")


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Hub(max_streams=0)


def record(agent_id, status, caps=("text.echo",), inflight=0):
    return AgentRecord(
        info=AgentInfo(
            agent_id=agent_id,
            name=agent_id.split("-")[0],
            capabilities=[CapabilityInfo(name=c) for c in caps],
        ),
        status=status,
        heartbeat=Heartbeat(agent_id=agent_id, status=status, inflight=inflight, load=0.5),
        registered_ms=1000,
        transitions=[Transition(old=Status.UP, new=status, reason="paused", at_ms=2000)]
        if status is Status.PAUSED
        else [],
    )


def test_view_is_the_status_summary_plus_agents_and_dead_letters():
    records = [
        record("echo-1", Status.UP, inflight=2),
        record("echo-2", Status.PAUSED),
        record("solo-1", Status.DOWN, caps=("cap.lonely",)),
    ]
    out = view(
        None,
        Sample(at=1.0, wall_ms=5, records=[]),
        records,
        dead_letters=[{"seq": 3}],
        extra={"prefix": "reach"},
    )
    msgspec.json.encode(out)  # all plain JSON
    assert out["prefix"] == "reach"
    assert (out["agents_total"], [a["id"] for a in out["agents"]]) == (
        3,
        ["echo-1", "echo-2", "solo-1"],
    )
    paused = out["agents"][1]
    assert paused == {
        "id": "echo-2",
        "name": "echo",
        "version": "1.0.0",
        "status": "PAUSED",
        "capabilities": ["text.echo"],
        "tasks": [],
        "tags": [],
        "inflight": 0,
        "queue": 0,
        "load": 0.5,
        "latency_ms": 0.0,
        "last_seen_ms": 0,
        "since_ms": 2000,
        "reason": "paused",
    }
    caps = {c["name"]: c for c in out["capabilities"]}
    assert caps["text.echo"]["instances"] == {
        "UP": 1,
        "DEGRADED": 0,
        "PAUSED": 1,
        "UNKNOWN": 0,
        "DOWN": 0,
    }
    assert (caps["cap.lonely"]["no_live"], caps["text.echo"]["no_live"]) == (True, False)
    assert out["fleet"]["instances"]["DOWN"] == 1
    assert out["fleet"]["inflight"] == 2
    assert out["interval"] is None  # one sample: no rates
    assert caps["text.echo"]["traffic"]["requests_per_s"] is None
    assert out["tasks"] is None
    assert out["dlq"] == {"size": None, "latest": [{"seq": 3}]}


def test_view_lists_a_bounded_number_of_agents_those_not_up_first():
    records = [record(f"a-{i:03}", Status.UP) for i in range(50)]
    records.append(record("z-1", Status.DEGRADED))
    out = view(None, None, records, agents_shown=10)
    ids = [a["id"] for a in out["agents"]]
    assert (len(ids), out["agents_total"]) == (10, 51)
    assert "z-1" in ids
    assert ids == sorted(ids)
    assert out["fleet"]["agents"] == 51  # the counts cover every agent
