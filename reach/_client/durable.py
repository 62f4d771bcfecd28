"""The client's durable-task methods (``submit``, ``submit_batch``, ``task``, listing,
dead letters and replay), over ``reach._tasks.Tasks`` and ``reach._tasks.admin``. Each runs
inside ``task_errors``: it raises ``ReachError``s only."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .._nats import NatsConnection
from .._tasks import Batch, TaskRecord, TaskRef, Tasks, TaskState, TaskSubmit, admin, unserved
from .._tasks.admin import DeadLetter
from .._tasks.boundary import task_errors
from ..errors import CapabilityNotFound, ConfigurationError, TaskNotFound
from ..wire import AgentRecord, Priority
from .metrics import ClientMetrics

__all__ = ["DurableTasks"]

log = logging.getLogger("reach.client")


class DurableTasks:
    """Mixed into ``Client``."""

    _tasks: Tasks
    _metrics: ClientMetrics | None

    @property
    def nc(self) -> NatsConnection:
        raise NotImplementedError  # the Client's connection

    async def agents(self, capability: str | None = None) -> list[AgentRecord]:
        raise NotImplementedError  # the Client's routing table

    async def _require_agent(self, sub: TaskSubmit) -> None:
        """``CapabilityNotFound`` unless the routing table holds a live instance that would
        run ``sub`` (``require_agent=True``)."""
        why = unserved(
            await self.agents(), sub.capability, version=sub.version, tags=sub.required_tags
        )
        if why is not None:
            raise CapabilityNotFound(why)

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
        require_agent: bool = False,
    ) -> TaskRef:
        """Submit a durable task; returns once JetStream has stored it (and its record is
        readable from any process). It waits for an instance of ``capability`` declared
        with ``@agent.task``, however long that takes (the task stream has no max age): a
        task may be queued before its worker starts.
        ``require_agent=True`` refuses at once instead (``CapabilityNotFound``, nothing
        stored) when the routing table knows no live (UP or DEGRADED) instance serving it
        with ``version`` and ``required_tags``.

        ``timeout`` is per attempt, ``max_attempts`` counts runs (timeouts and lost agents
        are retried with backoff; a handler's error is final unless it is retryable).
        The same ``idempotency_key`` within ``REACH_TASK_IDEMPOTENCY_TTL`` returns the
        same task. ``callback`` is a subject that receives the final record as a request
        and must answer it. A payload must fit in a record: at most about 3/8 of the
        server's ``max_payload`` (``ConfigurationError`` otherwise).
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
        if require_agent:
            await self._require_agent(sub)
        with task_errors(f"submit to {capability}"):
            ref = await self._tasks.submit(self.nc, sub)
        if self._metrics is not None:
            self._metrics.submitted(sub.capability, sub.priority.value)
        return ref

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
        idempotency_keys: Sequence[str] | None = None,
        require_agent: bool = False,
    ) -> Batch:
        """Submit one task per payload, pipelined. An item that could not be submitted
        holds its error in the batch; nothing raises for all. ``idempotency_keys`` (one per
        payload) make a batch safe to submit again: an item whose key was submitted within
        the TTL gives that task. ``require_agent``: as for ``submit``, checked once,
        before anything is sent."""
        if idempotency_keys is not None and len(idempotency_keys) != len(payloads):
            raise ConfigurationError(
                f"idempotency_keys has {len(idempotency_keys)} keys for"
                f" {len(payloads)} payloads; give one per payload"
            )
        keys = idempotency_keys if idempotency_keys is not None else [None] * len(payloads)
        subs = [
            self._tasks.spec(
                capability,
                p,
                priority=priority,
                timeout=timeout,
                max_attempts=max_attempts,
                idempotency_key=key,
                callback=callback,
                required_tags=required_tags,
                version=version,
            )
            for p, key in zip(payloads, keys, strict=True)
        ]
        if require_agent and subs:
            await self._require_agent(subs[0])
        with task_errors(f"submit to {capability}"):
            batch = await self._tasks.submit_batch(self.nc, subs)
        if self._metrics is not None and subs:
            for _ in range(batch.progress.total - batch.progress.failed):
                self._metrics.submitted(subs[0].capability, subs[0].priority.value)
        return batch

    async def task(self, task_id: str) -> TaskRef:
        """A handle on any task by id, submitted by any process; ``TaskNotFound`` for an
        id with no record (never PENDING)."""
        with task_errors(f"task {task_id}"):
            if await self._tasks.get(self.nc, task_id) is None:
                raise TaskNotFound(task_id)
        return TaskRef(self._tasks, task_id)

    async def task_record(self, task_id: str) -> TaskRecord:
        """The record of a task now (``TaskNotFound`` when there is none)."""
        with task_errors(f"task {task_id}"):
            record = await self._tasks.get(self.nc, task_id)
        if record is None:
            raise TaskNotFound(task_id)
        return record

    async def list_tasks(
        self,
        state: TaskState | str | None = None,
        capability: str | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Task records in ``state`` and of ``capability`` (None: any), most recently
        changed first, at most ``limit``. Only matching records are read."""
        with task_errors("list tasks"):
            store = await self._tasks.ready(self.nc)
            return await admin.list_records(store, state=state, capability=capability, limit=limit)

    async def dead_letters(
        self, capability: str | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters (of ``capability``; None: all), newest first, at most ``limit``."""
        with task_errors("list dead letters"):
            store = await self._tasks.ready(self.nc)
            return await admin.dead_letters(store, capability, limit)

    async def dead_letter(self, seq: int) -> DeadLetter:
        """The dead letter at DLQ sequence ``seq``; ``DeadLetterNotFound`` if there is none."""
        with task_errors(f"dead letter {seq}"):
            return await admin.dead_letter_at(await self._tasks.ready(self.nc), seq)

    async def replay(self, seq: int) -> TaskRef:
        """Run dead letter ``seq`` again as a new task (``replay_of`` the old one, same
        payload, options and idempotency key), then remove it from the DLQ. A callback
        that was never delivered, or a message that never decoded, cannot be replayed
        (``NotReplayable`` saying why; it stays in the DLQ; ``DeadLetterNotFound`` when
        there is none). Replaying twice gives one task."""
        with task_errors(f"replay of dead letter {seq}"):
            store = await self._tasks.ready(self.nc)
            dl = await admin.dead_letter_at(store, seq)
            task_id = await admin.replay(store, seq, notify=self._tasks.notify)
        return TaskRef(self._tasks, task_id, dl.capability)

    async def replay_capability(self, capability: str) -> list[TaskRef]:
        """Replay every dead letter of ``capability``, oldest first; those that cannot be
        replayed stay in the DLQ (logged)."""
        with task_errors(f"replay of {capability}"):
            store = await self._tasks.ready(self.nc)
            ids, skipped = await admin.replay_capability(
                store, capability, notify=self._tasks.notify
            )
        for seq, why in skipped:
            log.warning("dead letter %s not replayed: %s", seq, why)
        return [TaskRef(self._tasks, i, capability) for i in ids]
