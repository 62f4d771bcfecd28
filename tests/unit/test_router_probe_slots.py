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
