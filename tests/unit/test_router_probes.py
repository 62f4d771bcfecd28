"""A breaker's probe that ends without an outcome for it (no-responders, a lost connection,
a cancel) gives its slot back, and asking where a call would go takes no slot: either used
to leave the slot taken for good, and the instance was never chosen again."""

import pytest

from reach import Priority
from reach._routing import Policy, Router

from .test_resilience import rec, table_of


@pytest.mark.parametrize("probe_outcome", ["no_responders", "connection_lost", "cancelled"])
def test_a_probe_without_an_answer_does_not_wedge_the_breaker(probe_outcome):
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("a", tags=("gpu",)))
    for n in range(5):  # in-flight requests time out while the agent restarts
        router.started("a")
        router.finished("a", "work.do", "timeout", 1.0, float(n))
    probe = router.choose(
        Policy.BALANCED, table, "work.do", None, ("gpu",), Priority.NORMAL, [], None, 10.0
    )
    assert probe.agent_id == "a"  # the half-open probe
    assert probe.probe
    router.started("a")
    router.finished("a", "work.do", probe_outcome, 1.0, 10.0, probe=probe.probe)
    router.renewed("a")  # back under the same id: its record is written again
    # long after any cooldown, the instance must be tried again
    later = router.choose(
        Policy.BALANCED, table, "work.do", None, ("gpu",), Priority.NORMAL, [], None, 1000.0
    )
    assert later.agent_id == "a"


def test_a_stale_timeout_does_not_bring_back_an_absent_instance():
    """A request in flight to an agent when it died times out later; by then another
    request's no-responders marked it absent. A timeout is no answer: the instance must
    stay passed over (router.py pops ``absent`` for any outcome but no_responders)."""
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("dead"), rec("live"))
    router.started("dead")  # sent before the agent died; its answer never comes
    router.started("dead")
    router.finished("dead", "work.do", "no_responders", 0.1, 1.0)  # a later request
    assert "dead" in router.absent
    router.finished("dead", "work.do", "timeout", 5000.0, 5.0)  # the first one's timeout
    picks = {
        router.choose(
            Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, 5.0
        ).agent_id
        for _ in range(50)
    }
    assert picks == {"live"}


def test_a_route_query_does_not_take_the_half_open_probe():
    """``Client.pick`` (the gateway's ``POST /v1/route``, any token) calls ``choose`` and
    sends nothing; ``choose`` -> ``_take`` -> ``breaker.allow`` takes the half-open probe
    slot, which no attempt ever gives back: one route query wedges the instance."""
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("a", tags=("gpu",)))
    for n in range(5):
        router.started("a")
        router.finished("a", "work.do", "timeout", 1.0, float(n))
    # what Client.pick does: choose without sending, nothing reported
    router.choose(
        Policy.BALANCED,
        table,
        "work.do",
        None,
        ("gpu",),
        Priority.NORMAL,
        [],
        None,
        10.0,
        send=False,
    )
    later = router.choose(
        Policy.BALANCED, table, "work.do", None, ("gpu",), Priority.NORMAL, [], None, 1000.0
    )
    assert later.agent_id == "a"
