"""Only a breaker's probe frees its slot, and a probe that ends unanswered opens the
breaker again for a cooldown: a stale attempt that was in flight when the breaker opened
must not free the slot of the probe sent after it, and callers giving up on a hanging
instance must not each send one more."""

import pytest

from reach import CircuitOpen, Priority
from reach._routing import Policy, Router

from .test_resilience import rec, table_of


def _choose(router, table, now):
    return router.choose(
        Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, now
    )


@pytest.mark.parametrize("stale_outcome", ["cancelled", "error", "connection_lost"])
def test_a_stale_attempt_does_not_free_the_early_probes_slot(stale_outcome):
    """8 requests in flight to a failing instance; 5 time out and open its breaker; the
    early probe goes out. One of the 3 older requests now ends unanswered (a hedge loser,
    a caller that gave up): it was never the probe, yet ``finished`` -> ``release`` frees
    the probe's slot and a second request is sent before the cooldown (and a third...)."""
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("a"))
    for _ in range(8):
        router.started("a")
    for n in range(5):
        router.finished("a", "work.do", "timeout", 1.0, float(n))
    assert _choose(router, table, 5.0).agent_id == "a"  # the one early probe
    router.started("a")  # sent; its answer has not come
    router.finished("a", "work.do", stale_outcome, 1.0, 5.1)  # an old request, not the probe
    with pytest.raises(CircuitOpen):  # the probe is still in flight: one at a time
        _choose(router, table, 5.2)


def test_a_cancelled_early_probe_does_not_skip_the_cooldown():
    """The early probe is cancelled (the caller gave up on a hanging instance): the breaker
    stays HALF_OPEN with a free slot, so the next request goes to the instance at once,
    and so on for every cancelled one: the 5 s cooldown never applies."""
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("a"))
    for n in range(5):
        router.started("a")
        router.finished("a", "work.do", "timeout", 1.0, float(n))
    sent = 0
    for k in range(5):
        try:
            choice = _choose(router, table, 5.0 + k * 0.01)
        except CircuitOpen:
            continue
        sent += 1
        router.started(choice.agent_id)
        router.finished(
            choice.agent_id, "work.do", "cancelled", 1.0, 5.0 + k * 0.01, probe=choice.probe
        )
    assert sent == 1  # one early probe per opening, then the cooldown


def _open_capability(router):
    for n in range(5):
        router.request_done("work.do", False, float(n))
    assert router.admit_call("work.do", 4.5)[0] == "circuit_open"


@pytest.mark.parametrize(
    ("outcome", "admitted_after"),
    [("failed", True), ("bad_request", True), ("cancelled", False), ("error", False)],
)
def test_a_capability_probe_that_says_nothing_to_the_breaker_is_settled(outcome, admitted_after):
    """The capability breaker's half-open probe was taken by ``admit`` and reported only
    by ``request_done``, which a handler's refusal, a cancel or an error before sending
    never call: every later request was refused for good. An answer closes it; anything
    else opens it again for a cooldown."""
    router = Router(breaker_cooldown=5.0)
    _open_capability(router)
    assert router.admit_call("work.do", 10.0)[0] is None  # the probe
    assert router.admit_call("work.do", 10.0)[0] == "circuit_open"  # one at a time
    router.call_ended("work.do", outcome, 10.1)
    assert (router.admit_call("work.do", 10.2)[0] is None) is admitted_after
    assert router.admit_call("work.do", 1000.0)[0] is None  # never refused for good


def test_only_the_call_that_took_the_capability_probe_settles_it():
    """A call admitted while the breaker was closed, still running when the probe goes
    out, must not settle the probe when it ends (a cancel would shut the capability for
    another cooldown; a refusal would close it on no evidence of the probe)."""
    router = Router(breaker_cooldown=5.0)
    assert router.admit_call("work.do", 0.0) == (None, False)  # closed: no probe taken
    _open_capability(router)
    assert router.admit_call("work.do", 10.0) == (None, True)  # the probe
    assert router.admit_call("work.do", 10.0) == ("circuit_open", False)
    assert router.cap_breakers["work.do"].probing  # until the probe's own call ends


def test_a_probe_ending_on_an_instance_that_left_and_came_back_frees_its_slot():
    """An attempt in flight when the instance left the table, then the instance came back
    and its breaker opened: the old attempt's end took the new probe's place in the
    departed count, and the probe's own end returned before the breaker, its slot kept."""
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("a"))
    router.started("a")  # in flight when it left
    router.forget("a")
    for n in range(5):
        router.started("a")
        router.finished("a", "work.do", "timeout", 1.0, float(n))
    probe = _choose(router, table, 5.0)
    assert probe.probe
    router.started("a")
    router.finished("a", "work.do", "cancelled", 1.0, 5.5)  # the old attempt ends first
    router.finished("a", "work.do", "timeout", 1.0, 5.6, probe=True)  # the probe
    assert _choose(router, table, 1000.0).agent_id == "a"
