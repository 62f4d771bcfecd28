"""The fleet summary of `reach status` from two samples: pure, no server."""

import pytest

from reach._cli_common import plain
from reach._status.model import AgentCounters, Counters, Sample, summarize
from reach._status.render import clip, frame, to_json
from reach._tasks.counts import CapabilityTasks, TaskCensus
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Heartbeat, Status


def record(agent_id, status=Status.UP, caps=("text.translate",), tasks=(), inflight=0, queue=0):
    return AgentRecord(
        info=AgentInfo(
            agent_id=agent_id,
            name=agent_id.split("-")[0],
            capabilities=[CapabilityInfo(name=c) for c in caps],
            tasks=[CapabilityInfo(name=t) for t in tasks],
        ),
        status=status,
        heartbeat=Heartbeat(agent_id=agent_id, inflight=inflight, queue_len=queue),
    )


def counters(at, started="s1", **endpoints):
    return AgentCounters(
        at=at,
        started=started,
        endpoints={name.replace("_", "."): Counters(*c) for name, c in endpoints.items()},
    )


def sample(at, records, counters=None, tasks=None):
    return Sample(
        at=at, wall_ms=1_700_000_000_000, records=records, counters=counters or {}, tasks=tasks
    )


def by_name(summary):
    return {c.name: c for c in summary.capabilities}


def test_rates_are_counter_deltas_over_each_agents_own_interval():
    recs = [record("tr-1"), record("tr-2", Status.DEGRADED)]
    before = sample(
        10.0,
        recs,
        {
            "tr-1": counters(10.0, text_translate=(100, 5, 0)),
            "tr-2": counters(10.5, text_translate=(40, 0, 0)),
        },
    )
    after = sample(
        12.0,
        recs,
        {
            "tr-1": counters(12.0, text_translate=(120, 9, 16_000_000)),
            "tr-2": counters(11.5, text_translate=(50, 0, 14_000_000)),
        },
    )
    s = summarize(before, after)
    cap = by_name(s)["text.translate"]
    assert (cap.traffic.requests, cap.traffic.errors) == (30, 4)
    # 20 requests over 2 s plus 10 over 1 s; errors 4 over 2 s
    assert cap.traffic.requests_per_s == pytest.approx(20.0)
    assert cap.traffic.errors_per_s == pytest.approx(2.0)
    # 30 ms over 26 successful requests
    assert cap.traffic.latency_ms == round(30 / 26, 3)  # 1.154: rounded to the microsecond
    assert (cap.instances["UP"], cap.instances["DEGRADED"], cap.live, cap.no_live) == (
        1,
        1,
        2,
        False,
    )
    assert s.fleet.traffic.requests_per_s == pytest.approx(20.0)
    assert (s.fleet.agents, s.fleet.unmeasured, s.interval) == (2, 0, 2.0)


def test_a_restart_counts_everything_since_it_not_a_negative_delta():
    recs = [record("tr-1")]
    before = sample(0.0, recs, {"tr-1": counters(0.0, text_translate=(500, 50, 10**9))})
    went_down = sample(1.0, recs, {"tr-1": counters(1.0, text_translate=(7, 1, 6_000_000))})
    t = by_name(summarize(before, went_down))["text.translate"].traffic
    assert (t.requests, t.errors, t.requests_per_s) == (7, 1, 7.0)
    assert t.latency_ms == pytest.approx(1.0)
    # the counters grew past the old values, but the process is another one
    new_run = sample(1.0, recs, {"tr-1": counters(1.0, "s2", text_translate=(600, 60, 2 * 10**9))})
    t = by_name(summarize(before, new_run))["text.translate"].traffic
    assert (t.requests, t.errors) == (600, 60)


def test_empty_fleet():
    s = summarize(sample(0.0, []), sample(1.0, []))
    assert s.capabilities == []
    assert (s.fleet.agents, s.fleet.inflight, s.fleet.unmeasured) == (0, 0, 0)
    assert s.fleet.traffic.requests_per_s == 0.0  # nothing runs: measured as nothing
    assert s.fleet.instances == {"UP": 0, "DEGRADED": 0, "PAUSED": 0, "UNKNOWN": 0, "DOWN": 0}
    assert "no capabilities known" in "\n".join(frame(s))


def test_a_capability_with_no_live_instance_is_flagged_and_listed_first():
    recs = [
        record("tr-1", caps=("text.translate",)),
        record("solo-1", Status.PAUSED, caps=("cap.lonely",), inflight=1),
        record("gone-1", Status.DOWN, caps=("cap.dead",)),
    ]
    s = summarize(None, sample(0.0, recs))
    assert [c.name for c in s.capabilities] == ["cap.dead", "cap.lonely", "text.translate"]
    lonely = by_name(s)["cap.lonely"]
    assert (lonely.no_live, lonely.live, lonely.instances["PAUSED"], lonely.inflight) == (
        True,
        0,
        1,
        1,
    )
    assert by_name(s)["cap.dead"].instances["DOWN"] == 1
    assert not by_name(s)["text.translate"].no_live
    text = "\n".join(frame(s))
    assert "NO LIVE INSTANCE: cap.dead, cap.lonely" in text
    assert "! cap.lonely" in text


def test_a_capability_that_vanished_or_is_remembered_stays_listed_without_instances():
    before = sample(0.0, [record("old-1", caps=("cap.old",))])
    s = summarize(before, sample(1.0, []), remembered=["cap.older"])
    assert {c.name: (c.no_live, sum(c.instances.values()), c.kinds) for c in s.capabilities} == {
        "cap.old": (True, 0, ("request",)),
        "cap.older": (True, 0, ()),
    }


def test_no_rates_without_a_first_sample_or_for_agents_that_did_not_answer():
    recs = [record("tr-1"), record("tr-2")]
    s = summarize(None, sample(1.0, recs, {"tr-1": counters(1.0, text_translate=(1, 0, 0))}))
    assert s.interval is None
    assert by_name(s)["text.translate"].traffic.requests_per_s is None
    assert "no rates yet" in frame(s)[0]
    # tr-2 never answered: its traffic is not in the rates, and the screen says so
    before = sample(0.0, recs, {"tr-1": counters(0.0, text_translate=(0, 0, 0))})
    s = summarize(before, sample(1.0, recs, {"tr-1": counters(1.0, text_translate=(3, 0, 0))}))
    assert s.fleet.unmeasured == 1
    assert by_name(s)["text.translate"].traffic.requests_per_s == 3.0
    assert "1 live agent(s) did not answer" in "\n".join(frame(s))
    # a paused agent that does not answer is not a gap in the rates: it takes nothing
    recs = [record("tr-1", Status.PAUSED)]
    s = summarize(sample(0.0, recs), sample(1.0, recs))
    assert (s.fleet.unmeasured, s.fleet.traffic.requests_per_s) == (0, 0.0)


def test_instances_in_flight_and_queues_per_capability_and_for_the_fleet():
    recs = [
        record("multi-1", caps=("a.x", "b.y"), inflight=2, queue=3),
        record("a-1", caps=("a.x",), inflight=1),
    ]
    s = summarize(None, sample(0.0, recs))
    assert (by_name(s)["a.x"].inflight, by_name(s)["a.x"].queue) == (3, 3)
    assert (by_name(s)["b.y"].inflight, by_name(s)["b.y"].queue) == (2, 3)
    assert (s.fleet.inflight, s.fleet.queue) == (3, 3)  # each agent once


def test_task_capabilities_carry_their_census_and_a_capped_scan_is_said():
    census = TaskCensus(
        queued=5,
        unassigned=2,
        dead=1,
        capabilities={
            "report.build": CapabilityTasks(1, 2, 1),
            "nobody.cap": CapabilityTasks(0, 0, 0),
        },
        states={"SUCCEEDED": 7, "RUNNING": 2},
        scanned=9,
        keys=12,
        capped=True,
    )
    recs = [record("rb-1", caps=(), tasks=("report.build",))]
    s = summarize(None, sample(0.0, recs, tasks=census))
    rb = by_name(s)["report.build"]
    assert (rb.kinds, rb.tasks, rb.no_live) == (("task",), CapabilityTasks(1, 2, 1), False)
    assert by_name(s)["nobody.cap"].no_live  # tasks wait for it, nothing serves it
    text = "\n".join(frame(s))
    assert (
        "tasks: 5 queued (2 for capabilities no agent has taken tasks of), 1 dead letters" in text
    )
    assert "records: RUNNING 2  SUCCEEDED 7  (counted the 9 oldest of 12 keys)" in text
    assert "1/2/1" in text
    shown = to_json(s)
    assert shown["tasks"]["capped"] is True
    assert shown["capabilities"][0]["name"] == "nobody.cap"


def test_the_screen_fits_a_terminal():
    recs = [record(f"a{i}-1", caps=(f"cap.c{i:02d}",)) for i in range(30)]
    lines = frame(summarize(None, sample(0.0, recs)), colour=True, width=40, height=12)
    assert len(lines) == 12
    assert lines[-1] == "... 24 more capabilities"
    assert max(len(plain(line)) for line in lines) == 40
    assert (lines[4].split()[0], lines[5].split()[0]) == ("CAPABILITY", "cap.c00")
    assert clip("\033[32mUP\033[0m and more", 4) == "\033[32mUP\033[0m a"
