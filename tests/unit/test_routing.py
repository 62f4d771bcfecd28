import pytest

from reach import Priority, Status
from reach._routing import eligible, explain_miss, fan_out, rank, reject_reason, score
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Heartbeat

H, N = Priority.HIGH, Priority.NORMAL


def rec(
    agent_id,
    status=Status.UP,
    *,
    tags=(),
    version="1.0",
    cap="geo.lookup",
    load=0.0,
    latency=0.0,
    heartbeat=True,
):
    info = AgentInfo(
        agent_id=agent_id,
        name="geo",
        tags=list(tags),
        capabilities=[CapabilityInfo(name=cap, version=version)],
    )
    hb = Heartbeat(agent_id=agent_id, load=load, latency_ms=latency) if heartbeat else None
    return AgentRecord(info=info, status=status, heartbeat=hb)


@pytest.mark.parametrize(
    ("record", "priority", "reason"),
    [
        (rec("a"), N, None),
        (rec("a", Status.DEGRADED), N, None),
        (rec("a", Status.DEGRADED), H, "is DEGRADED (high priority needs UP)"),
        (rec("a", Status.PAUSED), N, "is PAUSED"),
        (rec("a", Status.UNKNOWN), N, "is UNKNOWN"),
        (rec("a", Status.DOWN), N, "is DOWN"),
        (rec("a", cap="other"), N, "does not offer it"),
    ],
)
def test_status_and_priority_rules(record, priority, reason):
    assert reject_reason(record, "geo.lookup", None, (), priority) == reason


def test_version_is_same_major_and_tags_are_all_of():
    r = rec("a", tags=["eu", "gpu"], version="1.4")
    assert reject_reason(r, "geo.lookup", "1.0", ["eu", "gpu"], N) is None
    assert reject_reason(r, "geo.lookup", "2", (), N) == "offers version 1.4, not 2.x"
    assert reject_reason(r, "geo.lookup", None, ["eu", "fast"], N) == "lacks tag 'fast'"


def test_a_gather_asks_every_routable_instance_and_names_those_its_status_keeps_out():
    records = [
        rec("up", tags=["eu"]),
        rec("deg", Status.DEGRADED, tags=["eu"]),
        rec("paused", Status.PAUSED, tags=["eu"]),
        rec("unknown", Status.UNKNOWN, tags=["eu"]),
        rec("down", Status.DOWN, tags=["eu"]),
        rec("us", tags=["us"]),  # without the tag: neither asked nor skipped
        rec("v2", tags=["eu"], version="2.0"),  # another major version: neither
    ]
    asked, skipped = fan_out(records, "geo.lookup", "1.1", ["eu"], N)
    assert asked == ["deg", "up"]
    assert skipped == {"down": "is DOWN", "paused": "is PAUSED", "unknown": "is UNKNOWN"}
    asked, skipped = fan_out(records, "geo.lookup", "1.1", ["eu"], H)
    assert asked == ["up"]
    assert skipped["deg"] == "is DEGRADED (high priority needs UP)"
    assert fan_out(records, "geo.lookup", None, ["gpu"], N) == ([], {})


def test_explain_miss_counts_what_exists():
    records = [
        rec("a", tags=["cpu"]),
        rec("b", tags=["cpu"]),
        rec("c", Status.PAUSED, tags=["gpu"]),
    ]
    text = explain_miss(records, "geo.lookup", None, ["gpu"], N)
    assert "with tags ['gpu']" in text
    assert "2 instances offer it but lack tag 'gpu'" in text
    assert "1 instance offers it but is PAUSED" in text
    assert explain_miss([], "geo.lookup", "2.0", (), H) == (
        "no live agent offers 'geo.lookup' version 2.x at high priority"
    )
    assert eligible(records, "geo.lookup", None, ["gpu"], N) == []


def test_score_formula_and_rank_order():
    fast_idle = rec("a", load=0.0, latency=10)
    slow_busy = rec("b", load=0.9, latency=100)
    degraded = rec("c", Status.DEGRADED, load=0.0, latency=10)
    assert score(fast_idle, 100) == pytest.approx(10 + 4 * 1 + 2 * 0.9)
    assert score(slow_busy, 100) == pytest.approx(10 + 4 * 0.1 + 2 * 0)
    assert score(degraded, 100) == pytest.approx(6 + 4 + 2 * 0.9)
    ranked = rank([slow_busy, degraded, fast_idle], "geo.lookup", None, (), N)
    assert [r.info.agent_id for r, _, _ in ranked] == ["a", "c", "b"]
    assert "load 0.90" in ranked[2][2]
    assert [
        r.info.agent_id for r, _, _ in rank([degraded, fast_idle], "geo.lookup", None, (), H)
    ] == ["a"]
    assert rank([rec("x", heartbeat=False)], "geo.lookup", None, (), N)[0][2] == (
        "UP, no heartbeat yet"
    )
