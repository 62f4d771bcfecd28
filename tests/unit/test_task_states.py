"""The pure task state machine: every transition, the fence, retry delays, priority aging."""

import itertools
import random

import msgspec
import pytest

from reach._tasks.states import (
    LEGAL,
    IllegalTransition,
    PriorityOrder,
    advance,
    can_write,
    retry_delay,
)
from reach.wire import Priority
from reach.wire.tasks import FINAL, TaskRecord, TaskState

S = TaskState
ALL = list(TaskState)
EXPECTED = {
    (S.SCHEDULED, S.PENDING),
    (S.SCHEDULED, S.CANCELLED),
    (S.PENDING, S.RUNNING),
    (S.PENDING, S.CANCELLED),
    (S.PENDING, S.FAILED),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.TIMEOUT),
    (S.RUNNING, S.RETRYING),
    (S.RUNNING, S.CANCELLED),
    (S.TIMEOUT, S.RETRYING),
    (S.TIMEOUT, S.FAILED),
    (S.RETRYING, S.RUNNING),
    (S.RETRYING, S.CANCELLED),
    (S.RETRYING, S.FAILED),
}


def record(state: TaskState, attempt: int = 1) -> TaskRecord:
    return TaskRecord(task_id="t1", capability="c.x", state=state, attempt=attempt)


def test_the_legal_table_is_the_documented_machine():
    assert set(LEGAL) == set(ALL)
    assert {(a, b) for a, nexts in LEGAL.items() for b in nexts} == EXPECTED
    assert all(not LEGAL[s] for s in FINAL)


@pytest.mark.parametrize(("old", "new"), sorted(EXPECTED))
def test_every_legal_transition_advances(old, new):
    rec = record(old)
    out = advance(rec, [new], 1234, "why", progress=0.5)
    assert out.state is new
    assert out.history[-1].state is new
    assert out.history[-1].at_ms == 1234
    assert out.history[-1].note == "why"
    assert (out.updated_ms, out.progress) == (1234, 0.5)
    assert rec.state is old  # records are immutable


ILLEGAL = sorted(set(itertools.product(ALL, ALL)) - EXPECTED)


@pytest.mark.parametrize(("old", "new"), ILLEGAL)
def test_every_illegal_transition_is_refused(old, new):
    with pytest.raises(IllegalTransition) as info:
        advance(record(old), [new], 1)
    assert (info.value.old, info.value.new) == (old, new)


def test_several_steps_in_one_write_are_each_checked():
    out = advance(record(S.RUNNING), [S.TIMEOUT, S.RETRYING, S.RUNNING], 5)
    assert out.state is S.RUNNING
    assert [h.state for h in out.history] == [S.TIMEOUT, S.RETRYING, S.RUNNING]
    with pytest.raises(IllegalTransition):
        advance(record(S.RUNNING), [S.TIMEOUT, S.SUCCEEDED], 5)
    assert advance(record(S.RUNNING), [], 5, progress=0.3).state is S.RUNNING


def test_uncounted_attempts():
    """A run handed back at a drain, or put off with ``RetryLater(count=False)``, does
    not count against max_attempts; a counted retry later does."""
    from reach._tasks.states import attempts_used
    from reach.wire.tasks import TaskAttempt

    outcomes = ["drained", "deferred", "retry_later", "timeout", "running"]
    attempts = [
        TaskAttempt(n=i, agent_id="a", started_ms=0, outcome=o) for i, o in enumerate(outcomes)
    ]
    assert attempts_used(attempts) == 3


def test_history_is_bounded():
    rec = record(S.RUNNING)
    for i in range(200):
        rec = advance(rec, [S.RETRYING, S.RUNNING], i)
    assert 0 < len(rec.history) <= 64
    assert rec.history[-1].at_ms == 199


@pytest.mark.parametrize("state", ALL)
def test_the_fence_admits_only_the_current_attempt_while_it_runs(state):
    rec = record(state, attempt=3)
    # RETRYING too is closed to the worker: RETRYING -> SUCCEEDED is no transition, and a
    # worker writing there would strand its message (the review's C1)
    current = state is S.RUNNING
    assert can_write(rec, 3) is current
    assert can_write(rec, 2) is False  # a stale worker
    assert can_write(rec, 4) is False
    assert can_write(record(state, attempt=0), 1) is False


def test_the_fence_tells_two_workers_of_one_attempt_number_apart():
    """A worker frozen before it wrote RUNNING and the one that took the task over both
    think they run attempt 1; only the one named in the record may write."""
    rec = msgspec.structs.replace(record(S.RUNNING, attempt=1), agent_id="b")
    assert can_write(rec, 1, "b") is True
    assert can_write(rec, 1, "a") is False


def test_retry_delay_is_exponential_with_jitter_and_capped():
    base, cap = 0.5, 10.0
    for n in range(1, 30):
        d = min(cap, base * 2 ** (n - 1))
        assert retry_delay(n, base, cap, rand=lambda lo, hi: lo) == d / 2
        assert retry_delay(n, base, cap, rand=lambda lo, hi: hi) == d
        assert d / 2 <= retry_delay(n, base, cap) <= d <= cap
    assert retry_delay(0, base, cap, rand=lambda lo, hi: hi) == base
    assert retry_delay(5, 0.0, cap) == 0.0
    rng = random.Random(7)
    spread = {retry_delay(3, base, cap, rand=rng.uniform) for _ in range(20)}
    assert len(spread) > 1  # jitter: many tasks do not retry in lockstep


def simulate(order: PriorityOrder, backlog: dict[Priority, int]) -> list[Priority]:
    """Dispatch one task at a time as the runner does with one slot."""
    left = dict(backlog)
    served: list[Priority] = []
    while any(left.values()):
        for level in order.order():
            if left[level]:
                left[level] -= 1
                order.served(level)
                served.append(level)
                break
            order.empty(level)
    return served


def gaps(seq: list[Priority], level: Priority) -> list[int]:
    """Dispatches from the start (or the previous ``level``) to each ``level``."""
    at = [i for i, p in enumerate(seq) if p is level]
    return [b - a for a, b in zip([-1, *at], at, strict=False)]


def test_priority_order_serves_high_first_and_ages_the_others():
    H, N, L = Priority.HIGH, Priority.NORMAL, Priority.LOW
    seq = simulate(PriorityOrder(), {H: 100, N: 100, L: 100})
    assert seq[:8] == [H] * 8
    assert seq[8] is N  # normal waited 8 dispatches
    high_done = max(i for i, p in enumerate(seq) if p is H)
    normal_done = max(i for i, p in enumerate(seq) if p is N)
    assert high_done < normal_done < len(seq) - 1
    assert max(gaps(seq, L)) <= 17  # patience 16: within every 17 dispatches
    assert max(gaps(seq[: normal_done + 1], N)) <= 9
    # high still gets most of the dispatches while it has a backlog
    assert seq[: high_done + 1].count(H) / (high_done + 1) > 0.8


def test_priority_order_with_other_patience_and_empty_levels():
    H, N, L = Priority.HIGH, Priority.NORMAL, Priority.LOW
    seq = simulate(PriorityOrder(normal=2, low=3), {H: 30, N: 0, L: 30})
    assert max(gaps(seq, L)) <= 4
    order = PriorityOrder(normal=2, low=3)
    for _ in range(5):
        order.served(H)
    assert order.order()[0] is L  # low waited longest and goes first
    order.empty(L)
    order.empty(N)
    assert order.order() == (H, N, L)  # nothing was waiting there after all
    with pytest.raises(ValueError, match="patience"):
        PriorityOrder(normal=0)
