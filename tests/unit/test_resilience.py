import random

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reach import Priority, Status
from reach._client.table import RoutingTable
from reach._kv import KvEntry
from reach._routing import (
    BreakerState,
    CircuitBreaker,
    PeakEwma,
    Policy,
    RetryBudget,
    Router,
    TokenBucket,
    Weights,
    backoff_delay,
    balanced_cost,
    normalised,
    rank,
    score,
    two_choices,
)
from reach.errors import AgentUnavailable, CapabilityNotFound, CircuitOpen
from reach.wire import (
    PROBE_NO_RESPONDERS,
    AgentInfo,
    AgentRecord,
    CapabilityInfo,
    Heartbeat,
    Transition,
)


def rec(agent_id, status=Status.UP, *, latency=10.0, load=0.0, queue=0, conc=8, tags=()):
    return AgentRecord(
        info=AgentInfo(
            agent_id=agent_id,
            name="w",
            max_concurrency=conc,
            tags=list(tags),
            capabilities=[CapabilityInfo(name="work.do")],
        ),
        status=status,
        heartbeat=Heartbeat(agent_id=agent_id, latency_ms=latency, load=load, queue_len=queue),
    )


def put(table, record, revision=1):
    table.update(record.info.agent_id, KvEntry(revision, msgspec.json.encode(record), None))


def delete(table, agent_id, revision=2):
    table.update(agent_id, KvEntry(revision, None, "DEL"))


def table_of(*records, on_leave=lambda agent_id: None):
    table = RoutingTable(on_leave=on_leave)
    for r in records:
        put(table, r)
    return table


# -- backoff and deadlines ----------------------------------------------------------------


@given(st.integers(min_value=1, max_value=30), st.integers(min_value=0, max_value=2**32))
def test_backoff_is_full_jitter_within_bounds(attempt, seed):
    delay = backoff_delay(attempt, random.Random(seed), base=0.2, cap=3.0)
    assert 0.0 <= delay <= min(3.0, 0.2 * 2 ** (attempt - 1))


def test_backoff_grows_then_caps():
    rng = random.Random(1)
    means = [sum(backoff_delay(a, rng) for _ in range(2000)) / 2000 for a in (1, 2, 3, 6)]
    assert means[0] == pytest.approx(0.1, rel=0.15)
    assert means[1] == pytest.approx(0.2, rel=0.15)
    assert means[2] == pytest.approx(0.4, rel=0.15)
    assert means[3] == pytest.approx(1.5, rel=0.15)
    assert backoff_delay(0, rng) == 0.0


def test_reserve_is_kept_for_another_live_instance_of_known_latency():
    router = Router()
    table = table_of(rec("slow"), rec("fast"), rec("unknown"))
    args = (table, "work.do", None, (), Priority.NORMAL)
    assert router.reserve(*args, "slow", (), 0.0) == 0.0  # nothing is known yet
    for agent_id, ms in (("slow", 900.0), ("fast", 200.0)):
        router.started(agent_id)
        router.finished(agent_id, "work.do", "ok", ms, 0.0)
    assert router.reserve(*args, "slow", (), 0.0) == pytest.approx(0.6)  # 3 x 200 ms
    router.started("fast")
    router.finished("fast", "work.do", "ok", 1.0, 10.0)  # decays towards 1 ms
    assert router.reserve(*args, "slow", (), 10.0) == pytest.approx(0.5)  # the floor
    assert router.reserve(*args, "fast", (), 0.0) == pytest.approx(2.7)  # 3 x slow's 900 ms
    assert router.reserve(*args, "unknown", (), 10.0) == pytest.approx(0.5)  # not known: cut
    assert router.reserve(*args, "slow", ("fast",), 0.0) == 0.0  # tried already
    router.absent["fast"] = 0.0
    assert router.reserve(*args, "slow", (), 0.0) == 0.0  # nobody listens there


def test_a_probe_slot_given_back_is_free_again():
    breaker = CircuitBreaker(window=4, min_volume=1, threshold=0.5, cooldown=1.0)
    breaker.failure(0.0)
    assert breaker.state is BreakerState.OPEN
    assert breaker.allow(2.0)  # half-open: the probe slot taken
    assert not breaker.would_allow(2.0)
    breaker.give_back()
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow(2.0)


# -- retry budget --------------------------------------------------------------------------


def test_retry_budget_is_a_share_of_requests_plus_a_floor():
    budget = RetryBudget(ratio=0.2, floor=2, window=10.0)
    assert budget.try_retry(0.0)
    assert budget.try_retry(0.0)
    assert not budget.try_retry(0.0)  # floor spent, no requests yet
    for _ in range(50):
        budget.record_request(1.0)
    granted = sum(budget.try_retry(1.0) for _ in range(100))
    assert granted == 10  # 2 floor + 20% of 50, less the 2 already spent
    # the window slides: old retries and requests stop counting
    assert budget.try_retry(20.0)


# -- circuit breaker -----------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_then_half_opens_then_closes():
    b = CircuitBreaker(max_consecutive=5, cooldown=5.0)
    for _ in range(4):
        b.failure(0.0)
    assert b.state is BreakerState.CLOSED
    assert b.allow(0.0)
    b.failure(0.0)
    assert b.state is BreakerState.OPEN
    assert not b.allow(4.9)
    assert b.allow(5.0)  # the half-open probe
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow(5.0)  # one probe at a time
    b.success(5.1)
    assert b.state is BreakerState.CLOSED
    assert b.allow(5.1)


def test_breaker_half_open_failure_reopens():
    b = CircuitBreaker(max_consecutive=1, cooldown=1.0)
    b.failure(0.0)
    assert b.allow(1.0)
    b.failure(1.0)
    assert b.state is BreakerState.OPEN
    assert not b.allow(1.5)


def test_breaker_opens_on_error_rate_with_minimum_volume():
    b = CircuitBreaker(window=20, min_volume=10, threshold=0.5, max_consecutive=100)
    for i in range(9):
        (b.failure if i % 3 else b.success)(0.0)  # 6 of 9 failed, under min volume
    assert b.state is BreakerState.CLOSED
    b.failure(0.0)  # 7 of 10 > 50%
    assert b.state is BreakerState.OPEN


# -- token bucket and peak EWMA ------------------------------------------------------------


def test_token_bucket_rate_and_burst():
    tb = TokenBucket(rate=10.0, burst=3.0, now=0.0)
    assert [tb.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not tb.take(0.05)
    assert tb.take(0.1)
    assert [tb.take(10.0) for _ in range(4)] == [True, True, True, False]


def test_peak_ewma_jumps_up_and_decays_slowly():
    e = PeakEwma(tau=10.0)
    e.observe(10.0, 0.0)
    e.observe(100.0, 1.0)
    assert e.value == 100.0  # up at once
    e.observe(10.0, 2.0)
    assert 90.0 < e.value < 100.0  # down slowly
    e.observe(10.0, 60.0)
    assert e.value < 11.0


# -- policies ------------------------------------------------------------------------------


def test_balanced_cost_orders_by_expected_time_to_answer():
    fast = rec("fast", latency=10)
    slow = rec("slow", latency=50)
    busy_fast = rec("busy", latency=10, queue=40, conc=8)
    assert balanced_cost(fast, 0, None, 1) < balanced_cost(slow, 0, None, 1)
    assert balanced_cost(busy_fast, 0, None, 1) > balanced_cost(slow, 0, None, 1)
    assert balanced_cost(fast, 16, None, 1) > balanced_cost(fast, 0, None, 1)  # own in-flight
    assert balanced_cost(fast, 0, 200.0, 1) > balanced_cost(slow, 0, None, 1)  # measured wins
    degraded = rec("d", Status.DEGRADED, latency=10)
    assert balanced_cost(degraded, 0, None, 1) == 2 * balanced_cost(fast, 0, None, 1)
    never = AgentRecord(info=fast.info, status=Status.UP)
    assert balanced_cost(never, 0, None, 33.0) == pytest.approx(33.0)  # capability median


def test_two_choices_never_picks_the_most_expensive_of_many():
    ids = [f"i{n}" for n in range(10)]
    cost = {i: n for n, i in enumerate(ids)}
    rng = random.Random(3)
    picks = [two_choices(ids, rng, cost.__getitem__) for _ in range(2000)]
    assert "i9" not in picks
    assert picks.count("i0") > picks.count("i5") > 0


def test_scored_formula_threshold_and_weights():
    a, b = rec("a", latency=10, load=0.1), rec("b", latency=100, load=0.9)
    w = Weights(w_load=4, w_latency=2, threshold=0.3)
    assert score(a, 100, w) == pytest.approx(10 + 4 * 0.9 + 2 * 0.9)
    assert normalised(score(a, 100, w), w) == pytest.approx(15.4 / 16)
    assert [
        r.info.agent_id for r, _, _ in rank([b, a], "work.do", None, (), Priority.NORMAL, w)
    ] == ["a", "b"]
    strict = Weights(threshold=0.9)
    assert [
        r.info.agent_id for r, _, _ in rank([b, a], "work.do", None, (), Priority.NORMAL, strict)
    ] == ["a"]


def test_router_balanced_avoids_the_slow_instance_and_fails_over_elsewhere():
    table = table_of(rec("fast", latency=5), rec("slow", latency=500), rec("mid", latency=20))
    router = Router(rng=random.Random(5))
    picks = [
        router.choose(
            Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, 0.0
        ).agent_id
        for _ in range(300)
    ]
    assert "slow" not in picks
    # failover: never the same instance twice in a row, untried ones first
    again = router.choose(
        Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, ["fast"], None, 0.0
    ).agent_id
    assert again in {"slow", "mid"}


def test_router_affinity_sticks_then_moves_when_the_instance_is_gone():
    table = table_of(rec("a"), rec("b"), rec("c"))
    router = Router(rng=random.Random(1))
    router.finished("b", "work.do", "ok", 5.0, 0.0, affinity_key="session-1")
    for _ in range(20):
        assert (
            router.choose(
                Policy.AFFINITY, table, "work.do", None, (), Priority.NORMAL, [], "session-1", 0.0
            ).agent_id
            == "b"
        )
    delete(table, "b")  # b leaves
    moved = router.choose(
        Policy.AFFINITY, table, "work.do", None, (), Priority.NORMAL, [], "session-1", 0.0
    ).agent_id
    assert moved in {"a", "c"}
    router.finished(moved, "work.do", "ok", 5.0, 0.0, affinity_key="session-1")
    assert router.affinity[("work.do", "session-1")] == moved


def test_router_skips_open_breakers_and_says_so_when_all_are_open():
    table = table_of(rec("a"), rec("b"))
    router = Router(rng=random.Random(2), breaker_cooldown=5.0)
    for _ in range(5):
        router.finished("a", "work.do", "no_responders", 1.0, 0.0)
    picks = {
        router.choose(
            Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, 1.0
        ).agent_id
        for _ in range(50)
    }
    assert picks == {"b"}
    for _ in range(5):
        router.finished("b", "work.do", "timeout", 1.0, 0.0)
    # every breaker open: one early probe (b might be gone too), then say so
    assert (
        router.choose(
            Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, 1.0
        ).agent_id
        == "b"
    )
    for version in (None, "1"):
        with pytest.raises(CircuitOpen):
            router.choose(
                Policy.BALANCED, table, "work.do", version, (), Priority.NORMAL, [], None, 1.0
            )


def test_router_queue_when_table_knows_nothing_and_not_found_when_filtered():
    router = Router()
    empty = table_of()
    assert (
        router.choose(
            Policy.BALANCED, empty, "work.do", None, (), Priority.NORMAL, [], None, 0.0
        ).agent_id
        is None
    )
    table = table_of(rec("a", Status.DEGRADED))
    with pytest.raises(CapabilityNotFound, match="DEGRADED"):
        router.choose(Policy.BALANCED, table, "work.do", None, (), Priority.HIGH, [], None, 0.0)


def test_router_admission_rate_limit_and_task_types():
    router = Router(rate_limits={"work.do": (1.0, 2.0)}, task_types={"job": "work.do"})
    assert router.resolve("job") == "work.do"
    assert router.resolve("other.cap") == "other.cap"
    admitted = [router.admit_call("work.do", 0.0)[0] for _ in range(3)]
    assert admitted == [None, None, "resource_exhausted"]
    assert router.admit_call("work.do", 1.0)[0] is None
    for _ in range(5):
        router.request_done("work.do", False, 2.0)
    assert router.admit_call("work.do", 2.0)[0] == "circuit_open"


def test_eligible_cache_follows_status_changes_not_load():
    table = table_of(rec("a"), rec("b"))
    assert table.eligible_ids("work.do", None, (), Priority.NORMAL) == ["a", "b"]
    put(table, rec("a", load=0.9))  # load only: same shape
    assert table.eligible_ids("work.do", None, (), Priority.NORMAL) == ["a", "b"]
    put(table, rec("a", Status.PAUSED))
    assert table.eligible_ids("work.do", None, (), Priority.NORMAL) == ["b"]


def test_affinity_memory_is_bounded_least_recently_used_first(monkeypatch):
    monkeypatch.setattr("reach._routing.router._MAX_AFFINITY", 3)
    router = Router()
    for key in ("s1", "s2", "s3"):
        router.finished("a", "work.do", "ok", 1.0, 0.0, affinity_key=key)
    router.finished("b", "work.do", "ok", 1.0, 0.0, affinity_key="s1")  # s1 used again
    router.finished("a", "work.do", "ok", 1.0, 0.0, affinity_key="s4")
    assert set(router.affinity) == {("work.do", k) for k in ("s3", "s1", "s4")}
    assert router.affinity[("work.do", "s1")] == "b"


# -- hardening (issue 7) -------------------------------------------------------------------


def test_balanced_cost_clamps_what_a_peer_reports():
    honest = rec("honest", latency=10, load=0.0)
    base = balanced_cost(honest, 0, None, 1)
    # a peer cannot buy traffic with impossible numbers
    for liar in (
        rec("l1", latency=10, load=-1e9),
        rec("l2", latency=-1e9, load=0.0),
        rec("l3", latency=10, queue=-1_000_000),
        rec("l4", latency=10, load=float("-inf")),
    ):
        cost = balanced_cost(liar, 0, None, 1)
        assert cost >= base, liar.info.agent_id
    # NaN and infinities count as the worst, never as a NaN cost (NaN compares false)
    for bad in (
        rec("n1", latency=float("nan")),
        rec("n2", latency=float("inf")),
        rec("n3", latency=10, load=float("nan")),
        rec("n4", latency=10, load=float("inf")),
    ):
        cost = balanced_cost(bad, 0, None, 1)
        assert cost == cost, bad.info.agent_id  # not NaN
        assert cost > base, bad.info.agent_id
    # and power of two choices never prefers the liar
    liar = rec("liar", latency=10, load=-1e9)
    slow = rec("slow", latency=20, load=0.5)
    rng = random.Random(0)
    cost = {r.info.agent_id: balanced_cost(r, 0, None, 1) for r in (liar, slow, honest)}
    picks = [two_choices(["liar", "honest"], rng, cost.__getitem__) for _ in range(50)]
    assert picks.count("liar") <= picks.count("honest")


def test_score_clamps_what_a_peer_reports():
    honest = rec("honest", latency=10, load=0.0)
    for liar in (rec("l1", latency=-1e9), rec("l2", latency=float("nan"))):
        s = score(liar, 10.0)
        assert s == s
        assert s <= score(honest, 10.0)
    ranked = rank(
        [rec("a", latency=10), rec("b", latency=-1e9), rec("c", latency=float("nan"))],
        "work.do",
        None,
        (),
        Priority.NORMAL,
    )
    assert ranked[0][0].info.agent_id == "a"
    assert all(s == s for _, s, _ in ranked)


def test_retry_budget_memory_is_constant_and_its_ratio_holds():
    import tracemalloc

    budget = RetryBudget(ratio=0.2, floor=10, window=10.0)
    for i in range(1000):  # warm up: fill the window once
        budget.record_request(i * 1e-3)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):
            budget.record_request(1.0 + i * 5e-5)  # 1e5 requests within 5 s: all in window
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 16_384  # a deque of 1e5 timestamps is ~3 MB
    now = 6.0
    granted = sum(budget.try_retry(now) for _ in range(30_000))
    assert granted == pytest.approx(10 + 0.2 * 101_000, rel=0.01)
    assert not budget.try_retry(now)
    # the window still slides: 20 s later, only the floor is left
    assert sum(budget.try_retry(40.0) for _ in range(100)) == 10


def test_cancelled_attempt_teaches_the_router_nothing():
    router = Router(breaker_cooldown=1.0)
    for _ in range(5):
        router.finished("a", "work.do", "timeout", 1.0, 0.0)
    assert router.instance_breakers["a"].allow(2.0)  # the half-open probe goes out...
    router.started("a")
    router.finished("a", "work.do", "cancelled", 0.5, 2.1, affinity_key="s")  # ...and is cut
    assert router.instance_breakers["a"].state is BreakerState.HALF_OPEN  # not a success
    assert "a" not in router.ewma
    assert ("work.do", "s") not in router.affinity
    assert router.inflight.get("a", 0) == 0
    assert router.hedge_delay("work.do") is None  # its latency taught nothing


def test_router_forgets_an_instance_that_left():
    router = Router()
    router.started("a")
    router.finished("a", "work.do", "ok", 5.0, 0.0, affinity_key="s1")
    router.finished("a", "work.do", "timeout", 5.0, 0.0)
    router.finished("b", "work.do", "ok", 5.0, 0.0, affinity_key="s2")
    router.started("a")  # still in flight when it leaves
    router.forget("a")
    assert "a" not in router.ewma
    assert "a" not in router.inflight
    assert "a" not in router.instance_breakers
    assert ("work.do", "s1") not in router.affinity
    assert router.affinity[("work.do", "s2")] == "b"
    # the late answer of the attempt in flight does not bring the instance back
    router.finished("a", "work.do", "ok", 5.0, 1.0, affinity_key="s3")
    assert "a" not in router.ewma
    assert "a" not in router.inflight
    assert ("work.do", "s3") not in router.affinity


def test_router_inflight_map_holds_only_instances_with_work_in_flight():
    router = Router()
    for i in range(1000):
        router.started(f"i{i}")
        router.finished(f"i{i}", "work.do", "ok", 1.0, 0.0)
    assert router.inflight == {}


def test_a_refusal_is_an_answer_not_a_success_nor_a_failover():
    router = Router()
    router.started("a")
    router.finished("a", "work.do", "refused", 1.0, 0.0, affinity_key="s")
    assert "a" not in router.ewma  # no latency learnt as if it had served
    assert ("work.do", "s") not in router.affinity
    assert "a" not in router.instance_breakers  # the instance answered: it works
    assert router.hedge_delay("work.do") is None


def test_ten_thousand_instances_leave_no_trace_in_the_router():
    router = Router()
    ids = [f"g-{i}" for i in range(10_000)]
    for n, agent_id in enumerate(ids):
        router.started(agent_id)
        router.finished(agent_id, "work.do", "ok", 1.0, 0.0, affinity_key=f"s-{n}")
        for _ in range(5):  # enough in a row to open its breaker
            router.started(agent_id)
            router.finished(agent_id, "work.do", "timeout", 1.0, 0.0)
        router.started(agent_id)
        router.finished(agent_id, "work.do", "no_responders", 0.1, 0.0)
        router.started(agent_id)  # still in flight when it leaves
    grown = router.footprint()
    for agent_id in ids:
        router.forget(agent_id)
    for agent_id in ids:  # the late answers of the attempts in flight
        router.finished(agent_id, "work.do", "ok", 1.0, 1.0, affinity_key="late")
    sizes = router.footprint()
    per_instance = [k for k in sizes if k.startswith("router.")]
    assert {k: grown[k] for k in per_instance} == {
        "router.inflight": 10_000,
        "router.ewma": 10_000,
        "router.instance_breakers": 10_000,
        "router.breaker_openings": 10_000,
        "router.affinity": 10_000,
        "router.sessions": 10_000,
        "router.departed": 0,
        "router.absent": 10_000,
    }
    assert {k: sizes[k] for k in per_instance} == dict.fromkeys(per_instance, 0)


def test_instances_that_answered_no_responders_leave_the_choice_to_the_queue_group():
    """With no registry renewing leases, a dead instance's lease can outlive a live one's
    (the registry_restart chaos scenario): the table lists only the dead one. Its direct
    subject answers no-responders, and once its breaker opened the router raised
    CircuitOpen with nothing tried; the live instances NATS knows were never asked."""
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("gone", tags=("gpu",)))
    for n in range(6):
        router.finished("gone", "work.do", "no_responders", 0.1, float(n))

    def choose(now, version=None, tags=()):
        return router.choose(
            Policy.BALANCED, table, "work.do", version, tags, Priority.NORMAL, [], None, now
        ).agent_id

    assert choose(6.0) is None  # the queue group: whoever really serves work.do
    # the queue group would not keep to a version or tags: say so instead
    with pytest.raises(AgentUnavailable, match="gone"):
        choose(6.0, version="1")
    with pytest.raises(AgentUnavailable):
        choose(6.0, tags=("gpu",))
    # it stays passed over however long (its lease outlives it)...
    assert choose(600.0) is None
    # ...until its record is written again: restarted under the same id, it is tried
    router.renewed("gone")
    assert choose(601.0) == "gone"
    assert router.absent == {}


def test_an_instance_that_said_nobody_listens_is_passed_over_before_its_breaker_opens():
    router = Router(breaker_cooldown=5.0, rng=random.Random(7))
    table = table_of(rec("gone"), rec("live"))
    router.finished("gone", "work.do", "no_responders", 0.1, 0.0)  # one: no breaker opens
    picks = {
        router.choose(
            Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, 1 + n / 100
        ).agent_id
        for n in range(50)
    }
    assert picks == {"live"}


@pytest.mark.parametrize("version", [None, "1"])
def test_a_failing_instance_still_opens_its_circuit(version):
    """Once open, a breaker sends one early probe (it may be a dead instance), and when that
    fails too, every call fails fast until the cooldown ends, versioned or not."""
    router = Router()
    table = table_of(rec("slow"))
    for n in range(6):
        router.finished("slow", "work.do", "timeout", 1.0, float(n))
    assert router.instance_breakers["slow"].state is BreakerState.OPEN
    probe = router.choose(
        Policy.BALANCED, table, "work.do", version, (), Priority.NORMAL, [], None, 6.0
    )
    assert probe.agent_id == "slow"
    router.started("slow")
    router.finished("slow", "work.do", "timeout", 1.0, 6.5)
    for now in (7.0, 8.0):
        with pytest.raises(CircuitOpen):
            router.choose(
                Policy.BALANCED, table, "work.do", version, (), Priority.NORMAL, [], None, now
            )


def test_a_dead_instance_whose_breaker_opened_is_found_gone_by_one_early_probe():
    """The registry_restart chaos scenario in CI: requests in flight when an agent was
    killed timed out and opened its breaker; with no registry its lease was all the table
    held, and every request got CircuitOpen until the half-open probe (352 failed). The
    early probe meets no-responders, the instance is absent, and the queue group decides."""
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("dead"))
    for n in range(6):
        router.finished("dead", "work.do", "timeout", 1.0, float(n))
    probe = router.choose(
        Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, 6.0
    )
    assert probe.agent_id == "dead"
    router.started("dead")
    router.finished("dead", "work.do", "no_responders", 0.1, 6.0)
    for now in (6.0, 7.0, 8.0):
        assert (
            router.choose(
                Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, now
            ).agent_id
            is None
        )


def test_a_route_query_never_takes_the_early_probe():
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("a"))
    for n in range(6):
        router.finished("a", "work.do", "failed", 1.0, float(n))
    for _ in range(3):  # asking, as Client.pick does, sends nothing and takes nothing
        choice = router.choose(
            Policy.BALANCED,
            table,
            "work.do",
            None,
            (),
            Priority.NORMAL,
            [],
            None,
            6.0,
            send=False,
        )
        assert choice.agent_id == "a"
    assert (
        router.choose(
            Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, 6.0
        ).agent_id
        == "a"
    )
    with pytest.raises(CircuitOpen):
        router.choose(Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, 6.0)


def test_instances_remembered_as_absent_are_bounded(monkeypatch):
    monkeypatch.setattr("reach._routing.router._MAX_ABSENT", 3)
    router = Router()
    for n in range(5):  # direct calls can name any id
        router.finished(f"x-{n}", "work.do", "no_responders", 0.1, float(n))
    assert list(router.absent) == ["x-2", "x-3", "x-4"]


def test_an_instance_that_stays_gone_never_makes_the_router_refuse():
    """The registry_restart chaos scenario: a dead instance's lease outlives it while no
    registry runs. Each time its absence expired it was tried again, said no-responders
    again, and its breaker (fed by those) was open when the next absence expired:
    CircuitOpen with nothing tried (344 failed requests). No-responders now marks the
    instance absent and leaves its breaker alone."""
    router = Router(breaker_cooldown=5.0)
    table = table_of(rec("gone"))
    outcomes = []
    for tick in range(200):
        now = tick / 4
        choices = [  # several requests in flight at once, as under load
            router.choose(
                Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL, [], None, now
            ).agent_id
            for _ in range(4)
        ]
        outcomes += choices
        for choice in choices:
            router.started(choice)
            if choice == "gone":
                router.finished("gone", "work.do", "no_responders", 0.1, now)
            else:
                router.finished(None, "work.do", "ok", 1.0, now)  # the queue group answered
    assert "gone" in outcomes  # tried again now and then
    assert None in outcomes  # and the queue group meanwhile: never refused


def test_choose_never_picks_an_instance_to_avoid():
    router = Router(rng=random.Random(3))
    table = table_of(rec("a"), rec("b"), rec("c"))
    args = (Policy.BALANCED, table, "work.do", None, (), Priority.NORMAL)
    for _ in range(50):
        choice = router.choose(*args, ["a"], None, 0.0, avoid={"b"})
        assert choice.agent_id == "c"
    # every instance that fits is to be avoided: the queue group, for the caller to refuse
    assert router.choose(*args, [], None, 0.0, avoid={"a", "b", "c"}).agent_id is None


def test_the_table_reports_down_only_when_nobody_listens_on_the_instance():
    down: list[str] = []
    table = RoutingTable(on_down=down.append)
    put(table, rec("lost"), 1)
    put(table, rec("blocked"), 1)
    for agent_id, reason in (("lost", PROBE_NO_RESPONDERS), ("blocked", "probe failed: timeout")):
        record = msgspec.structs.replace(
            rec(agent_id, Status.DOWN),
            transitions=[Transition(old=Status.UNKNOWN, new=Status.DOWN, reason=reason, at_ms=1)],
        )
        put(table, record, 2)
        put(table, record, 3)  # written again: not a new DOWN
    assert down == ["lost"]  # a probe that timed out may hide a handler still running
