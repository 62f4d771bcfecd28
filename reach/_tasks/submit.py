"""Submitting tasks and following them: ``Tasks`` (one per client), ``TaskRef``, ``Batch``.

A submit is one JetStream publish on ``reach.task.<id>.<cap>.<prio>`` (the id is also the
``Nats-Msg-Id``, so a resent publish is deduplicated). The message is the task's PENDING
state: anyone finds it by id (``TaskStore.lookup``) until an agent takes it and creates the
record in ``reach_tasks`` (RUNNING). One durable write per submit, not two, and no orphan
record can exist without its message.

The submitter hears of its tasks' final records on a subject of its own (core NATS, best
effort) and re-reads the record with backoff in case it missed one; another process follows
a task by watching its key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.nuid import NUID

from .._codec import encode_payload, now_ms
from .._nats import TRANSIENT, NatsConnection
from .._subjects import Subjects, validate_capability, validate_topic
from ..errors import ConfigurationError, ConnectionFailed, NotStarted
from ..settings import ReachSettings
from ..wire import Header, Priority
from ..wire.tasks import TaskRecord, TaskSubmit
from .jsapi import JsApi
from .refs import Batch, TaskRef, cancel_record, read_record
from .store import Conflict, TaskStore, idem_key

__all__ = ["Tasks", "publish_task"]

log = logging.getLogger("reach.client")

_record_decoder = msgspec.json.Decoder(TaskRecord)
_encode = msgspec.json.Encoder().encode
_MAX_KEY = 256


async def publish_task(store: TaskStore, sub: TaskSubmit, msg_id: str = "") -> int:
    """Publish a task message and wait for the stream's ack; its stream sequence. The
    ``Nats-Msg-Id`` (the task id unless given) deduplicates a resent publish. Used by a
    submit, a replay from the DLQ and a recovery sweep's republish."""
    headers = {
        "Nats-Msg-Id": msg_id or sub.task_id,
        "Reach-Task-Id": sub.task_id,
        Header.CALLER: sub.caller or "-",
    }
    if sub.idempotency_key:
        headers[Header.IDEMPOTENCY_KEY] = sub.idempotency_key
    subject = store.subjects.task(sub.task_id, sub.capability, sub.priority)
    return await store.publish(subject, _encode(sub), headers)


class Tasks:
    """A client's durable-task side, opened lazily on its connection."""

    def __init__(self, settings: ReachSettings, subjects: Subjects, caller: str) -> None:
        self.settings = settings
        self.subjects = subjects
        self.caller = caller
        self.notify = ""
        self._nc: NatsConnection | None = None
        self._store: TaskStore | None = None
        self._sub: Subscription | None = None
        self._lock = asyncio.Lock()
        self._nuid = NUID()
        self.waiters: dict[str, set[asyncio.Future[TaskRecord]]] = {}

    async def ready(self, nc: NatsConnection) -> TaskStore:
        """The store on ``nc`` (streams and buckets created when missing), and our notify
        subscription; once per connection."""
        if self._store is not None and self._nc is nc:
            return self._store
        async with self._lock:
            if self._store is None or self._nc is not nc:
                api = JsApi(nc)
                await api.open()
                store = TaskStore(nc.jetstream(), self.subjects, self.settings, api)
                try:
                    await store.ensure()
                except TRANSIENT as exc:
                    raise ConnectionFailed(f"task streams unavailable: {exc}") from exc
                notify = self.subjects.task_done(self._nuid.next().decode())
                self._sub = await nc.subscribe(notify, cb=self._on_final)
                self._nc, self._store, self.notify = nc, store, notify
        return self._store

    @property
    def store(self) -> TaskStore:
        if self._store is None:
            raise NotStarted("the client has not used tasks yet")
        return self._store

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        api = self._store.api if self._store is not None else None
        self._store = self._nc = None
        for futs in self.waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(NotStarted("client closed"))
        self.waiters.clear()
        try:
            if sub is not None:
                await sub.unsubscribe()
            if api is not None:
                await api.close()
        except TRANSIENT as exc:
            log.debug("tasks: unsubscribe: %s", exc)

    async def _on_final(self, msg: Msg) -> None:
        try:
            rec = _record_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("tasks: an undecodable final record on %s", msg.subject)
            return
        for fut in self.waiters.get(rec.task_id, ()):
            if not fut.done():
                fut.set_result(rec)

    def waiter(self, task_id: str) -> asyncio.Future[TaskRecord]:
        fut: asyncio.Future[TaskRecord] = asyncio.get_running_loop().create_future()
        self.waiters.setdefault(task_id, set()).add(fut)
        return fut

    def unwait(self, task_id: str, fut: asyncio.Future[TaskRecord]) -> None:
        futs = self.waiters.get(task_id)
        if futs is not None:
            futs.discard(fut)
            if not futs:
                del self.waiters[task_id]

    # -- submitting ------------------------------------------------------------------

    def spec(
        self,
        capability: str,
        payload: Any,
        *,
        priority: Priority | str,
        timeout: float | None,
        max_attempts: int | None,
        idempotency_key: str | None,
        callback: str | None,
        required_tags: Sequence[str],
        version: str | None,
    ) -> TaskSubmit:
        """The task message, with every argument checked before anything is sent."""
        try:
            validate_capability(capability)
            prio = Priority(priority)
            if callback:
                validate_topic(callback.replace("$", "").replace("_INBOX", "inbox").lower())
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        if timeout is not None and not timeout > 0:
            raise ConfigurationError("timeout must be > 0 seconds")
        if max_attempts is not None and not 1 <= max_attempts <= 100:
            raise ConfigurationError("max_attempts must be between 1 and 100")
        key = idempotency_key or ""
        if len(key) > _MAX_KEY or any(c in key for c in "\r\n\0"):
            raise ConfigurationError(
                f"idempotency_key must be one line of at most {_MAX_KEY} characters"
            )
        try:
            body = encode_payload(payload)
        except TypeError as exc:
            raise ConfigurationError(str(exc)) from None
        return TaskSubmit(
            task_id=self._nuid.next().decode(),
            capability=capability,
            priority=prio,
            payload=body,
            timeout=float(timeout or 0.0),
            max_attempts=max_attempts or 0,
            idempotency_key=key,
            callback=callback or "",
            notify=self.notify,
            version=version or "",
            required_tags=list(required_tags),
            caller=self.caller,
            submitted_ms=now_ms(),
        )

    async def submit(self, nc: NatsConnection, sub: TaskSubmit) -> TaskRef:
        store = await self.ready(nc)
        sub = msgspec.structs.replace(sub, notify=self.notify)
        try:
            return await self._submit(store, sub)
        except TRANSIENT as exc:
            raise ConnectionFailed(
                f"submit of task {sub.task_id} not confirmed ({type(exc).__name__}: {exc});"
                " submitting again with the same idempotency_key is safe"
            ) from exc

    async def _submit(self, store: TaskStore, sub: TaskSubmit) -> TaskRef:
        if sub.idempotency_key:
            key = idem_key("submit", sub.idempotency_key)
            for _ in range(3):
                try:
                    await store.idem_claim(
                        key, sub.task_id.encode(), self.settings.task_idempotency_ttl
                    )
                    break
                except Conflict:
                    got = await store.idem_get(key)
                    if got is None:
                        continue  # it expired just now: claim it again
                    winner = got[0].decode()
                    if await store.lookup(winner) is not None:
                        return TaskRef(self, winner, sub.capability)  # not ours to hear
                    # the first submitter has not written the record (yet, or ever):
                    # publish ours under its id; the server drops a duplicate message
                    sub = msgspec.structs.replace(sub, task_id=winner)
                    break
        await self.publish(store, sub)
        return TaskRef(self, sub.task_id, sub.capability, own=True)

    async def publish(self, store: TaskStore, sub: TaskSubmit, msg_id: str = "") -> int:
        return await publish_task(store, sub, msg_id)

    async def submit_batch(self, nc: NatsConnection, subs: list[TaskSubmit]) -> Batch:
        """Publish every task at once (pipelined); a failed submit is that item's error."""
        await self.ready(nc)
        results = await asyncio.gather(*(self.submit(nc, s) for s in subs), return_exceptions=True)
        items: list[TaskRef | BaseException] = []
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
            items.append(r)
        return Batch(items)

    async def get(self, nc: NatsConnection, task_id: str) -> TaskRecord | None:
        store = await self.ready(nc)
        st = await read_record(store, task_id)
        return st.record if st else None

    async def cancel(self, task_id: str) -> TaskRecord:
        """Cancel: PENDING/RETRYING at once; RUNNING by asking its agent (the record keeps
        the request, so an agent that missed the message sees it). Twice is harmless."""
        store, nc = self.store, self._nc
        assert nc is not None
        rec = await cancel_record(store, task_id)
        # also for a task that looked PENDING: an agent may be starting it right now
        await nc.publish(self.subjects.task_cancel(), task_id.encode())
        return rec
