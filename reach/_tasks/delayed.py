"""Tasks that wait for a time: a delayed submit, and a retry its handler asked for
(``RetryLater``). Both wait as a schedule the server holds (ADR-51, stream
``REACH_TASKS`` with ``allow_msg_schedules``), not as a process of ours that sleeps:

- the schedule is one message on ``<prefix>.task.<id>.$at.<capability>`` with headers
  ``Nats-Schedule: @at <RFC 3339 time>`` and ``Nats-Schedule-Target`` = the task's own
  subject ``<prefix>.task.<id>.<capability>.<priority>``;
- at the due time the server publishes its body and headers (less ``Nats-Schedule*``,
  ``Nats-Msg-Id`` and the like; plus ``Nats-Scheduler`` and ``Nats-Schedule-Next: purge``)
  to the target, and removes the schedule: the task is PENDING on its work queue;
- until then, ``task_lookup`` finds the schedule (SCHEDULED), a cancel deletes it as it
  deletes any message of the task, and a second schedule of the same task replaces the
  first (the server rolls its subject up).

A retry later is recorded first (RETRYING, the attempt ended ``retry_later``, or
``deferred`` when it does not count, ``due_ms`` set), then the schedule is published with
``Reach-Requeued-From`` naming the message it replaces (the task's record names that one),
then that message is acked. The new message is a new delivery count: waiting spends no
delivery of the task.
"""

from __future__ import annotations

import datetime
import logging

import msgspec
import nats.js.errors

from .._codec import now_ms
from .._nats import TRANSIENT
from .._subjects import Subjects
from ..errors import ConfigurationError, RetryLater
from ..wire import ErrorBody
from ..wire.tasks import MAX_WAIT, TaskState
from .execute import Executor, republish
from .model import Delivery
from .states import attempts_used, end_attempt

__all__ = ["SCHEDULE", "SCHEDULE_TARGET", "at_schedule", "due_of", "retry_later", "rfc3339"]

log = logging.getLogger("reach.tasks")

SCHEDULE = "Nats-Schedule"
SCHEDULE_TARGET = "Nats-Schedule-Target"
S = TaskState
#: what may keep a retry later from being scheduled: it is then put back the old way
_NOT_SCHEDULED: tuple[type[BaseException], ...] = (
    *TRANSIENT,
    nats.js.errors.APIError,
    ConfigurationError,
)


def rfc3339(ms: int) -> str:
    """Unix milliseconds as the RFC 3339 UTC time a schedule takes (``...T12:00:00.250Z``)."""
    t = datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def due_of(at: datetime.datetime | None, delay: datetime.timedelta | float | None, now: int) -> int:
    """The unix ms a submit with ``at`` or ``delay`` is due (0: at once, also for a time
    already past). ``ConfigurationError`` for both, a naive ``at``, a negative delay or
    one more than ``MAX_WAIT`` (five years) ahead."""
    if at is not None and delay is not None:
        raise ConfigurationError("give at or delay, not both")
    if at is not None:
        if at.tzinfo is None or at.utcoffset() is None:
            raise ConfigurationError(
                f"at={at!r} has no time zone: give an aware datetime, e.g."
                " datetime.now(UTC) + timedelta(minutes=10)"
            )
        due = int(at.timestamp() * 1000)
        if due - now > MAX_WAIT * 1000:
            raise ConfigurationError(f"at={at.isoformat()} is more than five years ahead")
    elif delay is not None:
        seconds = delay.total_seconds() if isinstance(delay, datetime.timedelta) else delay
        if not 0 <= seconds <= MAX_WAIT:
            raise ConfigurationError(
                f"delay must be 0 to {MAX_WAIT} seconds (five years), not {delay!r}"
            )
        due = now + int(seconds * 1000)
    else:
        return 0
    return due if due > now else 0


def at_schedule(
    subjects: Subjects, task_id: str, capability: str, target: str, due_ms: int
) -> tuple[str, dict[str, str]]:
    """The subject and schedule headers of a task that waits until ``due_ms`` and then
    goes to ``target`` (its own work-queue subject)."""
    headers = {SCHEDULE: f"@at {rfc3339(due_ms)}", SCHEDULE_TARGET: target}
    return subjects.task_at(task_id, capability), headers


async def retry_later(ex: Executor, d: Delivery, exc: RetryLater) -> None:
    """The handler asked to run the task again after ``exc.after`` seconds: record the
    attempt's end and the retry's due time, schedule the task's message for then, ack
    this one. Out of attempts (a counted retry), the task fails as any retry would."""
    st = d.stored
    if st is None:
        return
    at = now_ms()
    outcome = "retry_later" if exc.count else "deferred"
    reason = exc.reason or "the handler asked to retry later"
    attempts = end_attempt(st.record.attempts, d.n, at, outcome, reason)
    error = ErrorBody(code=exc.code, message=reason[:500], retryable=True)
    if attempts_used(attempts) >= st.record.max_attempts:
        rec = await ex.commit(
            d,
            [S.FAILED],
            "attempts exhausted",
            finishing=True,
            attempts=attempts,
            error=msgspec.structs.replace(error, retryable=False),
            callback_state="pending" if st.record.callback else "",
        )
        if rec is not None:
            await ex.finished(d, rec, reason=exc.code)
        return
    due = at + int(exc.after * 1000)
    rec = await ex.commit(
        d, [S.RETRYING], "retry later", finishing=True, attempts=attempts, error=error, due_ms=due
    )
    if rec is None:
        return  # fenced: a newer attempt or a cancel owns the task
    ex.stats.retried += 1
    ex.stats.retried_later += 1
    await ex.release(d)
    await _reschedule(ex, d, due)


async def _reschedule(ex: Executor, d: Delivery, due: int) -> None:
    """Publish the task's message again as a schedule for ``due``, then ack this one
    (``republish``): a crash between the two leaves the task twice, and the record's
    ``seq`` with ``Reach-Requeued-From`` settles which one runs."""
    msg, store = d.msg, ex.store
    subject, schedule = at_schedule(store.subjects, d.task_id, d.sub.capability, msg.subject, due)
    try:
        await store.ensure_schedules()
        await republish(store, msg, subject, "l", schedule)
    except _NOT_SCHEDULED as exc:
        # not scheduled: put it back the old way (a delayed nak), so it still runs
        log.warning("task %s: retry later not scheduled (%r); put back instead", d.task_id, exc)
        await ex.hand_back(msg, max(0.0, (due - now_ms()) / 1000))
