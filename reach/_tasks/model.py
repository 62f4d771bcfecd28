"""The task runner's records: a durable capability served, one delivery in progress, and
the counters; and what the runner needs of the layers above it (``TaskHandler``,
``HandlerContext``, ``ContextFactory``), defined here so that it imports neither the client
nor the agent: ``reach._handlers`` fulfils them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nats.aio.msg import Msg

from ..wire import CapabilityInfo, Priority
from ..wire.tasks import TaskAttempt, TaskSubmit
from .bounded import BoundedRun
from .store import Stored

__all__ = ["ContextFactory", "Delivery", "HandlerContext", "TaskDecl", "TaskHandler", "TaskStats"]


class TaskHandler(Protocol):
    """A user's task handler as the runner calls it (``reach._handlers.HandlerSpec``)."""

    @property
    def fn(self) -> Callable[..., Awaitable[Any]]: ...
    @property
    def decode(self) -> Callable[[bytes], Any]: ...
    @property
    def wants_context(self) -> bool: ...


class HandlerContext(Protocol):
    """What the runner reads of the context it hands a handler (``TaskContext``)."""

    @property
    def agent_id(self) -> str: ...
    @property
    def capability(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def task_id(self) -> str: ...


class ContextFactory(Protocol):
    """Makes the context of one attempt (``reach._handlers.TaskContext``). ``client`` is
    whatever the runner was started with (the agent's client): the runner only passes it
    on, so it needs to know nothing of it."""

    def __call__(
        self,
        *,
        agent_id: str,
        client: Any,
        capability: str,
        request_id: str,
        priority: Priority,
        deadline_ms: int | None,
        caller: str,
        attempt: int,
        headers: dict[str, str],
        task_id: str,
        report: Callable[[float, str], Awaitable[None]] | None,
    ) -> HandlerContext: ...


@dataclass(slots=True)
class TaskDecl:
    """A durable capability an agent serves (``@agent.task``)."""

    info: CapabilityInfo
    spec: TaskHandler
    timeout: float | None
    max_attempts: int | None


@dataclass(slots=True)
class TaskStats:
    """What an agent's task runner did (read-only to users: ``Agent.task_stats``)."""

    started: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    timed_out: int = 0
    cancelled: int = 0
    dead_lettered: int = 0
    #: deliveries of tasks already final: answered from the record, handler not run
    duplicates: int = 0
    #: deliveries put back because another live agent held the task's claim
    claim_busy: int = 0
    #: stale attempts (a newer attempt owns the task): their writes were refused, or
    #: their handler was stopped by the lease check before it could write
    fenced: int = 0
    #: messages that did not decode (sent to the DLQ)
    invalid: int = 0
    #: task records that did not decode (junk, or a newer version's): replaced by a FAILED
    #: record, the message sent to the DLQ with reason ``undecodable``
    undecodable: int = 0
    #: tasks handed back at a drain
    drained: int = 0
    #: messages put back for another delivery: a retry, a busy claim, a task for another
    #: instance (tags, version), a drain or a pause
    handed_back: int = 0
    #: of those, put back as a new message because it was the message's last delivery
    #: (JetStream counts every delivery toward max_deliver): waiting spends no deliveries
    requeued: int = 0
    #: handlers that ignored their cancellation (at a timeout, cancel, fence or drain)
    abandoned: int = 0
    #: of those, still running now: each holds its slot and its claim until it returns
    stuck: int = 0
    callbacks_delivered: int = 0
    callbacks_failed: int = 0
    running: int = 0
    #: deliveries JetStream had made before (a lost agent, a nak, a timeout)
    redelivered: int = 0
    #: of the retries, those the handler asked for (``RetryLater``): scheduled, not naked
    retried_later: int = 0
    #: firings of periodic schedules turned into tasks (one per period), those that entered
    #: the work queue more than 5 s after their due time, those not run because the
    #: previous one still ran (``overlap="skip"``) or the schedule was paused, and those
    #: dropped because a catch-up would have made more than its cap at once
    fired: int = 0
    fired_late: int = 0
    firings_skipped: int = 0
    firings_missed: int = 0
    #: firings dropped unhandled: a definition no firing can use, or a task JetStream
    #: refuses for good (logged each time; not tried again)
    firings_dropped: int = 0


@dataclass(slots=True)
class Delivery:
    """A task message being worked on by this agent."""

    msg: Msg
    sub: TaskSubmit
    n: int = 0  # our attempt number once RUNNING is written
    attempt: TaskAttempt | None = None  # our attempt as begun
    stored: Stored | None = None  # the record as of our last read or write
    claim_rev: int = 0
    #: its handler's run, once started
    run: BoundedRun[tuple[bool, Any]] | None = None
    stop_reason: str = ""  # why the handler was cancelled: cancelled, fenced, drained
    outcome: str = ""  # how the attempt ended (for metrics and its span)
    traced: bool = False  # in a span: its context goes on with the callback
    unconfirmed: bool = False  # its RUNNING write went unanswered: the record may hold it

    @property
    def task_id(self) -> str:
        return self.sub.task_id

    @property
    def handling(self) -> bool:
        """Its handler runs now (not yet returned)."""
        return self.run is not None and not self.run.task.done()

    @property
    def abandoned(self) -> bool:
        """Its handler ignored its cancellation: the attempt is recorded as ended, but the
        claim is kept (renewed, not released) until the handler has returned."""
        return self.run is not None and self.run.abandoned
