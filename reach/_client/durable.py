"""The client's durable-task methods (``submit``, ``submit_batch``, ``task``), over
``reach._tasks.Tasks``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._nats import NatsConnection
from .._tasks import Batch, TaskRecord, TaskRef, Tasks
from ..errors import TaskNotFound
from ..wire import Priority

__all__ = ["DurableTasks"]


class DurableTasks:
    """Mixed into ``Client``."""

    _tasks: Tasks

    @property
    def nc(self) -> NatsConnection:
        raise NotImplementedError  # the Client's connection

    async def submit(
        self,
        capability: str,
        payload: Any = None,
        *,
        priority: Priority | str = Priority.NORMAL,
        timeout: float | None = None,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        callback: str | None = None,
        required_tags: Sequence[str] = (),
        version: str | None = None,
    ) -> TaskRef:
        """Submit a durable task; returns once JetStream has stored it (and its record is
        readable from any process). It waits for an instance of ``capability`` declared
        with ``@agent.task``, however long that takes, within the record's retention.

        ``timeout`` is per attempt, ``max_attempts`` counts runs (timeouts and lost agents
        are retried with backoff; a handler's error is final unless it is retryable).
        The same ``idempotency_key`` within ``REACH_TASK_IDEMPOTENCY_TTL`` returns the
        same task. ``callback`` is a subject that receives the final record as a request
        and must answer it.
        """
        sub = self._tasks.spec(
            capability,
            payload,
            priority=priority,
            timeout=timeout,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            callback=callback,
            required_tags=required_tags,
            version=version,
        )
        return await self._tasks.submit(self.nc, sub)

    async def submit_batch(
        self,
        capability: str,
        payloads: Sequence[Any],
        *,
        priority: Priority | str = Priority.NORMAL,
        timeout: float | None = None,
        max_attempts: int | None = None,
        callback: str | None = None,
        required_tags: Sequence[str] = (),
        version: str | None = None,
    ) -> Batch:
        """Submit one task per payload, publishing them all at once. An item that could
        not be submitted holds its error in the batch; nothing raises for all."""
        subs = [
            self._tasks.spec(
                capability,
                p,
                priority=priority,
                timeout=timeout,
                max_attempts=max_attempts,
                idempotency_key=None,
                callback=callback,
                required_tags=required_tags,
                version=version,
            )
            for p in payloads
        ]
        return await self._tasks.submit_batch(self.nc, subs)

    async def task(self, task_id: str) -> TaskRef:
        """A handle on any task by id, submitted by any process; ``TaskNotFound`` for an
        id with no record (never PENDING)."""
        if await self._tasks.get(self.nc, task_id) is None:
            raise TaskNotFound(task_id)
        return TaskRef(self._tasks, task_id)

    async def task_record(self, task_id: str) -> TaskRecord:
        """The record of a task now (``TaskNotFound`` when there is none)."""
        record = await self._tasks.get(self.nc, task_id)
        if record is None:
            raise TaskNotFound(task_id)
        return record
