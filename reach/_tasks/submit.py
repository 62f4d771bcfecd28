"""Submitting tasks and following them: ``Tasks`` (one per client), ``TaskRef``, ``Batch``.

A submit is one JetStream publish on ``reach.task.<id>.<cap>.<prio>`` (the id is also the
``Nats-Msg-Id``, so a resent publish is deduplicated). The message is the task's PENDING
state: anyone finds it by id (``TaskStore.lookup``) until an agent takes it and creates the
record in ``reach_tasks`` (RUNNING). One durable write per submit, not two, and no orphan
record can exist without its message.

The submitter hears of its tasks' final records on a subject of its own (core NATS, best
effort) and re-reads the record rarely in case it missed one; another process follows a task
by watching its key.

A payload is refused before anything is sent when its record could not be written: the
record carries it base64-encoded, and it must leave half of the server's ``max_payload``
for the result.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.nuid import NUID
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Tracer

from .._codec import encode_payload, now_ms
from .._nats import TRANSIENT, NatsConnection
from .._subjects import Subjects, validate_capability, validate_topic
from .._telemetry import ATTR
from ..errors import (
    ConfigurationError,
    ConnectionFailed,
    CorruptRecord,
    NotStarted,
    PayloadTooLarge,
)
from ..settings import ReachSettings
from ..wire import AgentRecord, CapabilityInfo, Header, Priority, Status
from ..wire.tasks import TaskRecord, TaskState, TaskSubmit
from .delayed import at_schedule
from .faults import patiently, task_errors
from .opening import PerConnection, open_store
from .refs import Batch, TaskRef, cancel_record, read_record, remove_messages
from .states import check_timeout
from .store import Conflict, TaskStore, idem_key

__all__ = ["Tasks", "publish_task", "unserved"]

log = logging.getLogger("reach.client")

_record_decoder = msgspec.json.Decoder(TaskRecord)
_encode = msgspec.json.Encoder().encode
_MAX_KEY = 256
#: bytes of a record besides its payload and result (ids, attempts, history, error)
RECORD_OVERHEAD = 4096
#: publishes of one submit_batch waiting for their acks at once, at most
BATCH_WINDOW = 256


async def _exists(store: TaskStore, task_id: str) -> bool:
    """Whether the task has a record or a message (a record that does not decode counts:
    the task is there, and its next handler replaces the record)."""
    try:
        return await store.lookup(task_id) is not None
    except CorruptRecord:
        return True


def payload_limit(max_payload: int) -> int:
    """The largest payload (raw bytes) whose record fits: base64 plus the overhead within
    half the server's ``max_payload`` (the other half is the result's)."""
    return max(0, (max_payload // 2 - RECORD_OVERHEAD) // 4 * 3)


#: statuses whose agents pull tasks now (a PAUSED one stopped pulling; an UNKNOWN one may
#: be gone)
_PULLING = (Status.UP, Status.DEGRADED)


def unserved(
    records: Iterable[AgentRecord],
    capability: str,
    *,
    version: str = "",
    tags: Sequence[str] = (),
) -> str | None:
    """None when a live instance in ``records`` (a routing table) would take a task of
    ``capability`` (same major ``version``, every one of ``tags``: what an agent checks
    before it runs one); else why none would, in a sentence for people."""
    offering: list[tuple[AgentRecord, CapabilityInfo]] = []
    by_request = False
    for r in records:
        by_request = by_request or any(c.name == capability for c in r.info.capabilities)
        offering += [(r, t) for t in r.info.tasks if t.name == capability]
    if not offering:
        hint = f" ({capability!r} is served by request, not as a task)" if by_request else ""
        return f"no agent has registered task capability {capability!r}{hint}"
    major = version.split(".")[0]
    wanted = set(tags)
    fits = [
        r
        for r, t in offering
        if wanted.issubset(r.info.tags) and (not major or t.version.split(".")[0] == major)
    ]
    if not fits:
        needs = [f"version {major}.x"] if major else []
        needs += [f"tags {sorted(wanted)}"] if wanted else []
        return (
            f"no agent serves task capability {capability!r} with {' and '.join(needs)}"
            f" ({len(offering)} instance(s) serve it without)"
        )
    if any(r.status in _PULLING for r in fits):
        return None
    counts = Counter(r.status.value for r in fits)
    held = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return f"no live agent serves task capability {capability!r} ({held})"


async def publish_task(store: TaskStore, sub: TaskSubmit, msg_id: str = "") -> int:
    """Publish a task message and wait for the stream's ack; its stream sequence. The
    ``Nats-Msg-Id`` (the task id unless given) deduplicates a resent publish. Used by a
    submit, a replay from the DLQ, a recovery sweep's republish and a schedule's firing.
    A task due later (``due_ms`` ahead) is published as the schedule it waits as."""
    headers = {
        "Nats-Msg-Id": msg_id or sub.task_id,
        "Reach-Task-Id": sub.task_id,
        Header.CALLER: sub.caller or "-",
    }
    if sub.idempotency_key:
        headers[Header.IDEMPOTENCY_KEY] = sub.idempotency_key
    if sub.traceparent:
        headers["traceparent"] = sub.traceparent
    subject = store.subjects.task(sub.task_id, sub.capability, sub.priority)
    if sub.due_ms > now_ms():
        subject, schedule = at_schedule(
            store.subjects, sub.task_id, sub.capability, subject, sub.due_ms
        )
        headers.update(schedule)
    return await store.publish(subject, _encode(sub), headers)


class Tasks:
    """A client's durable-task side, opened lazily on its connection."""

    def __init__(self, settings: ReachSettings, subjects: Subjects, caller: str) -> None:
        self.settings = settings
        self.subjects = subjects
        self.caller = caller
        self.notify = ""
        self._stores = PerConnection(self._open)
        self._sub: Subscription | None = None
        self._nuid = NUID()
        self.waiters: dict[str, set[asyncio.Future[TaskRecord]]] = {}
        #: spans for submits (None: off); and who hears of our tasks' final records
        self.tracer: Tracer | None = None
        self.on_final: Callable[[TaskRecord], None] | None = None

    async def ready(self, nc: NatsConnection) -> TaskStore:
        """The store on ``nc`` (streams and buckets created when missing), and our notify
        subscription; once per connection."""
        return await self._stores.get(nc)

    async def _open(self, nc: NatsConnection) -> TaskStore:
        with task_errors("task streams"):
            store = await open_store(
                nc,
                "durable tasks",
                lambda api: TaskStore(nc.jetstream(), self.subjects, self.settings, api),
                until=time.monotonic() + self.settings.task_patience,
                stopped=lambda: self._stores.closed,
            )
            notify = self.subjects.task_done(self._nuid.next().decode())
            try:
                self._sub = await nc.subscribe(notify, cb=self._on_final)
            except Exception:
                if store.api is not None:
                    await store.api.close()  # its inbox and listener: not left behind
                raise
        self.notify = notify
        return store

    @property
    def _nc(self) -> NatsConnection | None:
        return self._stores.nc

    @property
    def _closed(self) -> bool:
        return self._stores.closed

    @property
    def store(self) -> TaskStore:
        """The store of the open connection; ``NotStarted`` once the client closed."""
        store = self._stores.store
        if store is None:
            if self._closed:
                raise NotStarted(
                    "client closed: this task handle belongs to a client that was closed;"
                    " get a new one with client.task(task_id) on an open client"
                )
            raise NotStarted("the client has not used tasks yet")
        return store

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        await self._stores.close()
        for futs in self.waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(NotStarted("client closed"))
                    fut.exception()  # seen: a waiter that left already must not warn
        self.waiters.clear()
        if sub is not None:
            try:
                await sub.unsubscribe()
            except TRANSIENT as exc:
                log.debug("tasks: unsubscribe: %s", exc)

    async def _on_final(self, msg: Msg) -> None:
        try:
            rec = _record_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("tasks: an undecodable final record on %s", msg.subject)
            return
        if self.on_final is not None:
            self.on_final(rec)
        for fut in self.waiters.get(rec.task_id, ()):
            if not fut.done():
                fut.set_result(rec)

    def waiter(self, task_id: str) -> asyncio.Future[TaskRecord]:
        """A future for the task's final notice; failed with NotStarted when the client
        closes, or at once if it has closed already (a watch set up while the client
        closed must not wait on a notice that will never come)."""
        fut: asyncio.Future[TaskRecord] = asyncio.get_running_loop().create_future()
        if self._closed:
            fut.set_exception(NotStarted("client closed"))
            return fut
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
        due_ms: int = 0,
    ) -> TaskSubmit:
        """The task message, with every argument checked before anything is sent.
        ``due_ms``: not before then (unix ms; 0 or past: at once)."""
        try:
            validate_capability(capability)
            prio = Priority(priority)
            if callback:
                validate_topic(callback.replace("$", "").replace("_INBOX", "inbox").lower())
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        if timeout is not None and not timeout > 0:
            raise ConfigurationError("timeout must be > 0 seconds")
        if timeout is not None:
            check_timeout(timeout, self.settings.task_retention, f"submit to {capability}")
        if max_attempts is not None and not 1 <= max_attempts <= 100:
            raise ConfigurationError("max_attempts must be between 1 and 100")
        if max_attempts is not None and max_attempts >= self.settings.task_max_deliver:
            raise ConfigurationError(
                f"max_attempts ({max_attempts}) must be below task_max_deliver "
                f"({self.settings.task_max_deliver}): JetStream stops delivering a task there"
            )
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
            due_ms=due_ms if due_ms > now_ms() else 0,
        )

    async def submit(
        self, nc: NatsConnection, sub: TaskSubmit, until: float | None = None
    ) -> TaskRef:
        """Submit one task; tried again until ``until`` (monotonic; default: now plus
        ``task_patience``) while JetStream does not answer."""
        self.check_size(nc, sub.payload)
        store = await self.ready(nc)
        if sub.due_ms:
            with task_errors("task streams"):
                await store.ensure_schedules()
        sub = msgspec.structs.replace(sub, notify=self.notify)
        if until is None:
            until = time.monotonic() + self.settings.task_patience
        if self.tracer is not None:
            return await self._traced_submit(store, sub, self.tracer, until)
        return await self._submit(store, sub, until)

    async def _traced_submit(
        self, store: TaskStore, sub: TaskSubmit, tracer: Tracer, until: float
    ) -> TaskRef:
        """A PRODUCER span around the submit; its context travels in the task."""
        with tracer.start_as_current_span(
            f"send {sub.capability}",
            kind=SpanKind.PRODUCER,
            attributes={
                ATTR.SYSTEM: "nats",
                ATTR.DESTINATION: store.subjects.task("*", sub.capability, sub.priority),
                ATTR.OPERATION: "send",
                ATTR.CAPABILITY: sub.capability,
                ATTR.PRIORITY: sub.priority.value,
                ATTR.TASK_ID: sub.task_id,
            },
        ):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            sub = msgspec.structs.replace(sub, traceparent=carrier.get("traceparent", ""))
            return await self._submit(store, sub, until)

    async def _submit(self, store: TaskStore, sub: TaskSubmit, until: float) -> TaskRef:
        """Claim and publish, again while JetStream cannot answer yet (a stream between
        leaders, a server restarting): the task id is the ``Nats-Msg-Id``, so the server
        stores a repeated publish once (``task_patience`` is kept inside its duplicate
        window)."""
        nc = self._nc
        if nc is None or self._closed:
            raise NotStarted("client closed while it submitted")
        retry = (
            "submitting again with the same idempotency_key is safe"
            if sub.idempotency_key
            else "it may or may not have been stored (a submit with an idempotency_key"
            " can be repeated safely)"
        )
        with task_errors(f"submit of task {sub.task_id}"):
            return await patiently(
                nc,
                f"submit of task {sub.task_id} not confirmed",
                functools.partial(self.claim_and_publish, store, sub),
                until=until,
                advice=f"; {retry}",
                stopped=lambda: self._closed,
            )

    @staticmethod
    def check_size(nc: NatsConnection, payload: bytes) -> None:
        """Refuse a task payload whose record could not be written (the task would never
        run): a submit's, and a periodic schedule's when it is defined."""
        max_payload = nc.max_payload
        if max_payload <= 0:
            return  # not told yet: the server refuses what is too big
        encoded = (len(payload) + 2) // 3 * 4
        if encoded + RECORD_OVERHEAD > max_payload // 2:
            limit = payload_limit(max_payload)
            raise PayloadTooLarge(
                f"payload of {len(payload)} bytes is too large for a task: at most"
                f" {limit} bytes (its record holds it base64-encoded in"
                f" half of the server's max_payload of {max_payload} bytes); pass a"
                " reference to the data (an object store key, a URL) instead",
                size=len(payload),
                limit=limit,
            )

    async def claim_and_publish(self, store: TaskStore, sub: TaskSubmit) -> TaskRef:
        """Claim the idempotency key (if any), then publish; the task's handle. A key held
        by an earlier submit gives that task."""
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
                    if await _exists(store, winner):
                        # ours when this is a submit tried again after its first claim
                        own = winner == sub.task_id
                        return TaskRef(self, winner, sub.capability, own=own)
                    # the first submitter has not written the record (yet, or ever):
                    # publish ours under its id; the server drops a duplicate message
                    sub = msgspec.structs.replace(sub, task_id=winner)
                    break
            else:  # never held: publishing now could make a second task for the key
                raise ConnectionFailed(
                    f"idempotency key {sub.idempotency_key!r} could not be claimed (it was"
                    " taken and gone again three times); nothing was submitted, submit again"
                )
        await self.publish(store, sub)
        return TaskRef(self, sub.task_id, sub.capability, own=True)

    async def publish(self, store: TaskStore, sub: TaskSubmit, msg_id: str = "") -> int:
        return await publish_task(store, sub, msg_id)

    async def submit_batch(self, nc: NatsConnection, subs: list[TaskSubmit]) -> Batch:
        """Publish the tasks pipelined, at most ``BATCH_WINDOW`` awaiting their acks at
        once; a failed submit is that item's error."""
        await self.ready(nc)
        window = asyncio.Semaphore(BATCH_WINDOW)
        until = time.monotonic() + self.settings.task_patience  # one wait for the batch

        async def one(sub: TaskSubmit) -> TaskRef:
            async with window:
                return await self.submit(nc, sub, until)

        results = await asyncio.gather(*(one(s) for s in subs), return_exceptions=True)
        items: list[TaskRef | BaseException] = []
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
            items.append(r)
        return Batch(items)

    async def get(self, nc: NatsConnection, task_id: str) -> TaskRecord | None:
        """The record of any task (None: no such task)."""
        store = await self.ready(nc)
        st = await read_record(store, task_id)
        return st.record if st else None

    async def cancel(self, task_id: str) -> TaskRecord:
        """Cancel: PENDING/RETRYING at once; RUNNING by asking its agent (the record keeps
        the request, so an agent that missed the message sees it). Then the task's message
        is deleted from the work queue: a CANCELLED task never starts a run, even after its
        record has expired. Twice is harmless (and finishes a cancel cut short)."""
        store, nc = self.store, self._nc
        assert nc is not None
        with task_errors(f"cancel of task {task_id}"):
            rec = await cancel_record(store, task_id)
            # also for a task that looked PENDING: an agent may be starting it right now
            await nc.publish(self.subjects.task_cancel(), task_id.encode())
            if rec.cancel_requested or rec.state is TaskState.CANCELLED:
                # out of the work queue, so no later delivery can run it (not even one
                # after its record expired); a cancel cut short here is finished by the
                # recovery sweep
                await remove_messages(store, task_id)
        return rec
