"""The durable-task wire: the submitted message and the record kept in ``reach_tasks``.

Payloads and results are arbitrary bytes (JSON or not), so they travel base64-encoded
inside the JSON of these structs. Like every wire struct, unknown fields are ignored and new
fields get defaults, so old and new agents share a stream.
"""

from __future__ import annotations

import enum

import msgspec

from .messages import ErrorBody, Priority

__all__ = [
    "FINAL",
    "MAX_WAIT",
    "OVERLAPS",
    "ScheduleSpec",
    "TaskAttempt",
    "TaskRecord",
    "TaskState",
    "TaskStep",
    "TaskSubmit",
]

#: the longest a task may wait, in seconds (a delay, a retry later, an ``every``
#: interval): five years, as long as the server looks ahead for a cron line's next time
MAX_WAIT = 5 * 365 * 86_400


class TaskState(enum.StrEnum):
    """Where a task is. SUCCEEDED, FAILED and CANCELLED are final. SCHEDULED (waiting
    for its due time) is never stored in a record: like PENDING before an agent takes the
    task, it is the task's message (a schedule the server holds)."""

    SCHEDULED = "SCHEDULED"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    RETRYING = "RETRYING"
    CANCELLED = "CANCELLED"


FINAL = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED})


class _TaskWire(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class TaskSubmit(_TaskWire, tag="reach.task.submit", frozen=True, kw_only=True):
    """The body of a task message on ``reach.task.<id>.<cap>.<prio>``: everything needed
    to run it, so an agent can start a task whose record the submitter never got to write."""

    task_id: str
    capability: str
    priority: Priority = Priority.NORMAL
    payload: bytes = b""
    #: seconds per attempt and attempts in all; 0: the serving agent's defaults
    timeout: float = 0.0
    max_attempts: int = 0
    idempotency_key: str = ""
    callback: str = ""
    #: a core NATS subject the submitter listens on for the final record (best effort)
    notify: str = ""
    version: str = ""
    required_tags: list[str] = msgspec.field(default_factory=list)
    caller: str = ""
    submitted_ms: int = 0
    #: set on a replay from the dead-letter stream: the task it replays
    replay_of: str = ""
    #: W3C trace context of the submit, so each attempt's span joins the submitter's trace
    traceparent: str = ""
    #: unix ms before which the task does not enter the work queue (0: at once); a
    #: delayed task waits as a schedule the server holds (state SCHEDULED)
    due_ms: int = 0
    #: the periodic schedule whose firing made this task ("" for a submitted one)
    schedule: str = ""


class TaskAttempt(_TaskWire, tag="reach.task.attempt", frozen=True, kw_only=True):
    """One run of a task. ``outcome``: running, succeeded, failed, timeout, cancelled,
    lost (its agent died or stopped answering), drained (handed back at a drain)."""

    n: int
    agent_id: str
    started_ms: int
    ended_ms: int = 0
    outcome: str = "running"
    error: str = ""


class TaskStep(_TaskWire, tag="reach.task.step", frozen=True, kw_only=True):
    """One state the task entered, and when."""

    state: TaskState
    at_ms: int
    note: str = ""


class TaskRecord(_TaskWire, tag="reach.task.record", frozen=True, kw_only=True):
    """The value of key ``<task_id>`` in bucket ``reach_tasks``.

    ``attempt`` is the fencing token: the number of the newest attempt. Every write is a
    compare-and-set on the key's revision, and an agent writes only while ``attempt`` is
    still its own, so a stale worker can never overwrite a newer attempt.
    """

    task_id: str
    capability: str
    priority: Priority = Priority.NORMAL
    state: TaskState = TaskState.PENDING
    attempt: int = 0
    #: 0 until an agent applies its defaults (the submitter named none)
    max_attempts: int = 0
    timeout: float = 0.0
    payload: bytes = b""
    result: bytes | None = None
    error: ErrorBody | None = None
    agent_id: str = ""
    progress: float = 0.0
    progress_note: str = ""
    attempts: list[TaskAttempt] = msgspec.field(default_factory=list)
    history: list[TaskStep] = msgspec.field(default_factory=list)
    idempotency_key: str = ""
    callback: str = ""
    #: "" (none), "pending", "delivered", or "dead" (sent to the DLQ after its retries)
    callback_state: str = ""
    notify: str = ""
    cancel_requested: bool = False
    #: the stream sequence of the task's message (for recovery sweeps)
    seq: int = 0
    caller: str = ""
    version: str = ""
    required_tags: list[str] = msgspec.field(default_factory=list)
    submitted_ms: int = 0
    updated_ms: int = 0
    replay_of: str = ""
    #: unix ms the task was due: a delayed submit or a schedule's firing (0: at once);
    #: while it waits for a retry asked for by the handler (``RetryLater``), that retry's
    due_ms: int = 0
    #: the periodic schedule whose firing made this task ("" for a submitted one)
    schedule: str = ""

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def duration_ms(self) -> int:
        """From submit to the last write (the end, for a final record)."""
        return max(0, self.updated_ms - self.submitted_ms)


#: what a periodic schedule does when a firing comes while the previous one still runs
OVERLAPS = ("allow", "skip")


class ScheduleSpec(_TaskWire, tag="reach.task.schedule", frozen=True, kw_only=True):
    """A periodic schedule: the body of its definition on ``reach.task.$sched.<name>.$def``
    (the server fires it) and of each firing, which an agent of ``capability`` turns into
    one task per period. ``every`` (whole seconds) or ``cron`` (six fields, seconds first,
    in ``tz``); ``overlap`` "skip" starts no firing while the previous one is not final."""

    name: str
    capability: str
    priority: Priority = Priority.NORMAL
    payload: bytes = b""
    every: int = 0
    cron: str = ""
    tz: str = ""
    overlap: str = "allow"
    #: paused: the definition is kept without a schedule; nothing fires until resumed
    paused: bool = False
    timeout: float = 0.0
    max_attempts: int = 0
    version: str = ""
    required_tags: list[str] = msgspec.field(default_factory=list)
    caller: str = ""
    created_ms: int = 0
