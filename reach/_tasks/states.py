"""The task state machine and the pure rules around it: transitions, fencing, retry delays,
and the order in which an agent serves its priorities. No I/O, so every rule is unit-tested.

    SCHEDULED -> PENDING (its due time came) | CANCELLED
    PENDING  -> RUNNING | CANCELLED | FAILED (rejected before any run)
    RUNNING  -> SUCCEEDED | FAILED | TIMEOUT | RETRYING (its agent was lost) | CANCELLED
    TIMEOUT  -> RETRYING | FAILED (no attempts left)
    RETRYING -> RUNNING | CANCELLED | FAILED (no attempts left)
    SUCCEEDED, FAILED, CANCELLED: final

SCHEDULED is never written into a record (agents of earlier versions would not decode
it): a delayed task has no record until it runs or is cancelled, as a PENDING one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from ..errors import ConfigurationError, ReachError, RemoteError
from ..wire import ErrorBody, Priority
from ..wire.tasks import FINAL, TaskAttempt, TaskRecord, TaskState, TaskStep

__all__ = [
    "LEGAL",
    "IllegalTransition",
    "PriorityOrder",
    "advance",
    "can_write",
    "check_timeout",
    "retry_delay",
]

S = TaskState
LEGAL: dict[TaskState, frozenset[TaskState]] = {
    S.SCHEDULED: frozenset({S.PENDING, S.CANCELLED}),
    S.PENDING: frozenset({S.RUNNING, S.CANCELLED, S.FAILED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.TIMEOUT, S.RETRYING, S.CANCELLED}),
    S.TIMEOUT: frozenset({S.RETRYING, S.FAILED}),
    S.RETRYING: frozenset({S.RUNNING, S.CANCELLED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}

#: at most this many steps are kept in a record's history (the oldest go first)
MAX_HISTORY = 64


class IllegalTransition(ReachError):
    """A write would break the state machine (a bug, or a record changed under us)."""

    def __init__(self, task_id: str, old: TaskState, new: TaskState) -> None:
        self.task_id, self.old, self.new = task_id, old, new
        super().__init__(f"task {task_id}: {old} -> {new} is not a legal transition")


def advance(
    record: TaskRecord, states: Iterable[TaskState], at_ms: int, note: str = "", **changes: Any
) -> TaskRecord:
    """The record after passing through ``states`` in order (each step checked), with
    ``changes`` applied. Several steps in one write (TIMEOUT then RETRYING) cost one CAS."""
    state = record.state
    steps = list(record.history)
    for new in states:
        if new not in LEGAL[state]:
            raise IllegalTransition(record.task_id, state, new)
        steps.append(TaskStep(state=new, at_ms=at_ms, note=note))
        state = new
    return msgspec.structs.replace(
        record, state=state, history=steps[-MAX_HISTORY:], updated_ms=at_ms, **changes
    )


def can_write(record: TaskRecord, attempt: int, agent_id: str | None = None) -> bool:
    """Whether the worker of ``attempt`` (on ``agent_id``) may still write: the fence. A
    newer attempt, another agent's attempt of the same number (one that started while a
    frozen worker had not written yet), or a final state all refuse it."""
    if agent_id is not None and record.agent_id != agent_id:
        return False
    return record.attempt == attempt and record.state is S.RUNNING


#: attempt outcomes that do not count against ``max_attempts``: handed back at a drain
#: (the task did nothing wrong; a rolling deploy must not use its attempts up), or put off
#: by its handler with ``RetryLater(count=False)``
UNCOUNTED = frozenset({"drained", "deferred"})


def attempts_used(attempts: Iterable[TaskAttempt]) -> int:
    """Runs that count against ``max_attempts`` (all but the ``UNCOUNTED`` ones)."""
    return sum(1 for a in attempts if a.outcome not in UNCOUNTED)


def end_attempt(
    attempts: list[TaskAttempt], n: int, at_ms: int, outcome: str, error: str = ""
) -> list[TaskAttempt]:
    """The attempt list with attempt ``n`` closed (its outcome and end time)."""
    return [
        msgspec.structs.replace(a, ended_ms=at_ms, outcome=outcome, error=error[:500])
        if a.n == n and a.outcome == "running"
        else a
        for a in attempts
    ]


def check_timeout(timeout: float, retention: float, where: str) -> None:
    """Refuse a per-attempt timeout longer than a record is kept (``task_retention``,
    counted from the record's last write): a run that long would outlive its record on an
    agent with the same setting. ``ConfigurationError`` naming both and the fix."""
    if timeout > retention:
        raise ConfigurationError(
            f"{where}: timeout {timeout:g}s is longer than task_retention {retention:g}s, how"
            " long a task record is kept after its last write: lower the timeout, or raise"
            " REACH_TASK_RETENTION to at least it"
        )


def retry_delay(
    attempt: int, base: float, cap: float, rand: Callable[[float, float], float] = random.uniform
) -> float:
    """Exponential backoff with jitter before attempt ``attempt + 1``: a random delay in
    [d/2, d], d = min(cap, base * 2**(attempt-1)), so retries of many tasks spread out."""
    d = min(cap, base * 2 ** max(0, attempt - 1))
    return rand(d / 2, d)


class PriorityOrder:
    """The order an agent looks at its priorities in, with aging so low never starves.

    Normally high, then normal, then low. A level that has waited ``patience[level]``
    dispatches without being served while it may hold work goes first once. So with a
    backlog at every level, at least one dispatch in every ``patience[normal] + 1`` is
    normal and one in every ``patience[low] + 1`` is low: a low task at position k of its
    queue starts within (patience[low] + 1) * k dispatches. A level found empty resets its
    count, since nothing there was waiting.
    """

    __slots__ = ("patience", "skipped")

    def __init__(self, normal: int = 8, low: int = 16) -> None:
        if normal < 1 or low < 1:
            raise ValueError("patience must be >= 1")
        self.patience = {Priority.HIGH: 0, Priority.NORMAL: normal, Priority.LOW: low}
        self.skipped = {Priority.HIGH: 0, Priority.NORMAL: 0, Priority.LOW: 0}

    def order(self) -> tuple[Priority, ...]:
        starved = [
            p for p in (Priority.LOW, Priority.NORMAL) if self.skipped[p] >= self.patience[p]
        ]
        rest = [p for p in (Priority.HIGH, Priority.NORMAL, Priority.LOW) if p not in starved]
        return (*starved, *rest)

    def served(self, level: Priority) -> None:
        """One task of ``level`` was dispatched."""
        for p in self.skipped:
            self.skipped[p] = 0 if p is level else self.skipped[p] + 1

    def empty(self, level: Priority) -> None:
        """``level`` had nothing waiting."""
        self.skipped[level] = 0


def is_final(state: TaskState) -> bool:
    return state in FINAL


def error_body(exc: Any, outcome: str) -> ErrorBody:
    """The error a failed attempt records: its code, a bounded message, retryable."""
    if outcome == "timeout":
        return ErrorBody(code="timeout", message="the task overran its timeout", retryable=True)
    if outcome == "cancelled":
        return ErrorBody(code="cancelled", message="cancelled")
    if isinstance(exc, RemoteError):
        return ErrorBody(code=exc.code, message=exc.message[:500], retryable=exc.retryable)
    if isinstance(exc, BaseException):
        return ErrorBody(code="failed", message=f"{type(exc).__name__}: {exc}"[:500])
    return ErrorBody(code="failed", message=str(exc or outcome)[:500])
