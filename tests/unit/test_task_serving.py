"""Who would run a task now: ``unserved`` over a routing table, with no server (what
``submit(require_agent=True)`` refuses and ``reach submit`` warns about)."""

from __future__ import annotations

from reach._tasks import unserved
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Status

TASK = "report.build"


def record(
    agent_id: str,
    status: Status = Status.UP,
    *,
    tasks: tuple[str, ...] = (TASK,),
    capabilities: tuple[str, ...] = (),
    version: str = "1.0",
    tags: tuple[str, ...] = (),
) -> AgentRecord:
    return AgentRecord(
        info=AgentInfo(
            agent_id=agent_id,
            name="reporter",
            capabilities=[CapabilityInfo(name=c) for c in capabilities],
            tasks=[CapabilityInfo(name=t, version=version) for t in tasks],
            tags=list(tags),
        ),
        status=status,
    )


def test_an_empty_table_serves_nothing():
    assert unserved([], TASK) == f"no agent has registered task capability {TASK!r}"


def test_a_capability_served_by_request_only_says_so():
    records = [record("a", tasks=(), capabilities=(TASK,))]
    assert unserved(records, TASK) == (
        f"no agent has registered task capability {TASK!r}"
        f" ({TASK!r} is served by request, not as a task)"
    )


def test_an_up_or_degraded_instance_serves_it():
    assert unserved([record("a")], TASK) is None
    assert unserved([record("a", Status.DEGRADED)], TASK) is None
    assert unserved([record("a", Status.PAUSED), record("b")], TASK) is None


def test_instances_that_do_not_pull_now_are_counted():
    records = [
        record("a", Status.PAUSED),
        record("b", Status.UNKNOWN),
        record("c", Status.PAUSED),
        record("d", Status.DOWN),
    ]
    assert unserved(records, TASK) == (
        f"no live agent serves task capability {TASK!r} (1 DOWN, 2 PAUSED, 1 UNKNOWN)"
    )


def test_version_and_tags_are_checked_as_the_agent_checks_them():
    records = [record("a", version="1.4", tags=("eu",)), record("b", version="2.0")]
    assert unserved(records, TASK, version="1.0") is None  # same major
    assert unserved(records, TASK, version="2.1") is None
    assert unserved(records, TASK, tags=["eu"]) is None
    assert unserved(records, TASK, version="2", tags=["eu"]) == (
        f"no agent serves task capability {TASK!r} with version 2.x and tags ['eu']"
        " (2 instance(s) serve it without)"
    )
    assert unserved(records, TASK, version="3.0") == (
        f"no agent serves task capability {TASK!r} with version 3.x"
        " (2 instance(s) serve it without)"
    )
    # a fitting instance that is not live is reported as such
    paused = [record("a", Status.PAUSED, tags=("gpu",)), record("b")]
    assert unserved(paused, TASK, tags=["gpu"]) == (
        f"no live agent serves task capability {TASK!r} (1 PAUSED)"
    )


def test_other_task_capabilities_do_not_count():
    assert unserved([record("a", tasks=("report.other",))], TASK) == (
        f"no agent has registered task capability {TASK!r}"
    )
