"""Where tasks live in JetStream: the work-queue stream, the DLQ stream, the record bucket
``reach_tasks`` and the claim/idempotency bucket ``reach_idem``.

Every record write is a raw publish to ``$KV.<bucket>.<task_id>`` with
``Nats-Expected-Last-Subject-Sequence`` (compare-and-set on the key's revision) and
``Nats-TTL`` (the retention, counted from the last change), because ``kv.put``/``update``
cannot carry a TTL and would make the key permanent (NATS-FACTS). The state and agent also
travel as headers, so a sweep can scan records with a headers-only consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from .. import _kv
from .._codec import now_ms
from .._jsapi import JsApi, direct_batch, js_publish
from .._kv import KV_OP, MARKER_REASON, Conflict, JsErrorCode, bind_bucket, check_replicas
from .._nats import NatsConnection
from .._subjects import Subjects
from ..errors import ConfigurationError, CorruptRecord
from ..settings import ReachSettings
from ..wire import ErrorBody, Priority
from ..wire.tasks import TaskRecord, TaskState, TaskStep, TaskSubmit
from .states import advance

__all__ = [
    "UNDECODABLE",
    "Conflict",
    "TaskStore",
    "add_dlq_stream",
    "add_stream",
    "consumer_name",
    "idem_key",
]

#: the error code of a record replaced because it did not decode, and its dead letter's reason
UNDECODABLE = "undecodable"

STATE_HEADER = "Reach-Task-State"
AGENT_HEADER = "Reach-Task-Agent"
_TASK_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_record_decoder = msgspec.json.Decoder(TaskRecord)
_submit_decoder = msgspec.json.Decoder(TaskSubmit)
_encode = msgspec.json.Encoder().encode


def consumer_name(capability: str, priority: Priority) -> str:
    """The durable consumer shared by every instance serving ``capability`` at ``priority``:
    readable, and one-to-one (``rep_x`` and ``rep.x`` must not share one), by a hash."""
    digest = hashlib.blake2b(capability.encode(), digest_size=6).hexdigest()
    return f"{capability.replace('.', '_')[:64]}-{digest}-{priority}"


def _gone(exc: nats.js.errors.APIError) -> bool:
    """A delete refused because the message is gone (acked or deleted since it was
    found): the server says so with a 400 or a 500, not a 404."""
    if exc.err_code == JsErrorCode.SEQUENCE_NOT_FOUND:
        return True
    return exc.err_code == JsErrorCode.MSG_DELETE_FAILED and "no message found" in (
        exc.description or ""
    )


def idem_key(kind: str, key: str) -> str:
    """A KV key for a user's idempotency key (any text; hashed to a valid key)."""
    return f"{kind}.{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}"


#: a header of the schedule message a delayed task waits as (ADR-51)
SCHEDULE_HEADER = "Nats-Schedule"


def pending_record(sub: TaskSubmit, seq: int, at_ms: int = 0) -> TaskRecord:
    """The record of a task as submitted: PENDING, everything from its message. A
    delayed task became PENDING at its due time (its history says so)."""
    at = sub.submitted_ms or at_ms
    return TaskRecord(
        task_id=sub.task_id,
        capability=sub.capability,
        priority=sub.priority,
        max_attempts=sub.max_attempts,
        timeout=sub.timeout,
        payload=sub.payload,
        idempotency_key=sub.idempotency_key,
        callback=sub.callback,
        notify=sub.notify,
        seq=seq,
        caller=sub.caller,
        version=sub.version,
        required_tags=list(sub.required_tags),
        submitted_ms=at,
        updated_ms=max(at, sub.due_ms),
        replay_of=sub.replay_of,
        due_ms=sub.due_ms,
        schedule=sub.schedule,
        history=[
            TaskStep(
                state=TaskState.PENDING,
                at_ms=max(at, sub.due_ms),
                note="due" if sub.due_ms else "",
            )
        ],
    )


def scheduled_record(sub: TaskSubmit, seq: int, at_ms: int = 0) -> TaskRecord:
    """The record of a delayed task whose due time has not come: SCHEDULED, from the
    schedule message it waits as. Its history is empty: SCHEDULED is never stored, so a
    cancel writes a record whose history holds only CANCELLED (and ``due_ms``)."""
    at = sub.submitted_ms or at_ms
    return msgspec.structs.replace(
        pending_record(sub, seq, at_ms),
        state=TaskState.SCHEDULED,
        history=[],
        updated_ms=at,
    )


def undecodable_record(
    exc: CorruptRecord, sub: TaskSubmit | None, seq: int, at_ms: int, capability: str = ""
) -> TaskRecord:
    """The FAILED record (error ``undecodable``) that replaces one that does not decode:
    made from the task's message when there is one (payload and options, so the task can
    be replayed from its dead letter), else from what is known, the id."""
    if sub is not None and sub.task_id == exc.task_id:
        base = pending_record(sub, seq, at_ms)
    else:
        base = TaskRecord(
            task_id=exc.task_id,
            capability=capability,
            seq=seq,
            submitted_ms=at_ms,
            updated_ms=at_ms,
            history=[TaskStep(state=TaskState.PENDING, at_ms=at_ms)],
        )
    error = ErrorBody(
        code=UNDECODABLE,
        message=f"its stored record did not decode ({exc.detail}); it was replaced, and"
        " the task moved to the dead-letter stream"[:500],
    )
    return advance(base, [TaskState.FAILED], at_ms, UNDECODABLE, error=error)


def decode_record(data: bytes, task_id: str = "", revision: int = 0) -> TaskRecord:
    """A stored record decoded: the one place that says what does not decode. Junk, or a
    state or field a newer version wrote, is ``CorruptRecord`` (typed, with the revision
    to replace), never msgspec's error."""
    try:
        return _record_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(task_id or "?", str(exc), revision=revision) from exc


@dataclass(frozen=True, slots=True)
class Got:
    """A stored message as a direct get returns it."""

    data: bytes
    headers: dict[str, str]
    seq: int
    subject: str = ""

    @property
    def stored_ms(self) -> int:
        """When the server stored it (unix ms, its own clock); 0 when not told."""
        return rfc3339_ms(self.headers.get("Nats-Time-Stamp", ""))


def rfc3339_ms(text: str) -> int:
    """An RFC 3339 UTC time as the server writes it (nanoseconds, ``Z``) in unix ms; 0
    for anything else."""
    head, _, frac = text.rstrip("Z").partition(".")
    try:
        at = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC)
    except ValueError:
        return 0
    return int(at.timestamp()) * 1000 + int((frac + "000")[:3] or 0)


@dataclass(frozen=True, slots=True)
class Stored:
    record: TaskRecord
    revision: int


class TaskStore:
    """Names and I/O for one subject prefix; created per connection, cheap."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        settings: ReachSettings,
        api: JsApi | None = None,
        *,
        nc: NatsConnection | None = None,
    ) -> None:
        self.js = js
        #: the fast path for record reads and writes (nats-py's js calls otherwise)
        self.api = api
        #: the connection, for what nats-py's JetStream API cannot ask (``count``); the
        #: API's when not given
        self.nc = nc if nc is not None else api.nc if api is not None else None
        self.subjects = subjects
        self.settings = settings
        self.stream = subjects.stream("TASKS")
        self.dlq_stream = subjects.stream("DLQ")
        #: max-deliveries advisories of the task stream, kept until a registry handles them
        self.events_stream = subjects.stream("TASK_EVENTS")
        self.bucket = subjects.bucket("tasks")
        self.idem_bucket = subjects.bucket("idem")
        self._kv_stream = f"KV_{self.bucket}"
        self._idem_stream = f"KV_{self.idem_bucket}"
        self._ready = False
        self._schedules = False

    # -- setup -----------------------------------------------------------------------

    async def ensure(self) -> None:
        """Create the streams and buckets when missing (idempotent; once per store)."""
        if self._ready:
            return
        js, s, replicas = self.js, self.settings, self.settings.stream_replicas
        await add_stream(
            js,
            StreamConfig(
                name=self.stream,
                subjects=[f"{self.subjects.prefix}.task.*.*.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                allow_direct=True,
                allow_msg_schedules=True,
                num_replicas=replicas,
                description="Agent-Reach durable tasks: reach.task.<id>.<cap>.<priority>",
            ),
        )
        await add_dlq_stream(js, self.subjects, s)
        await add_stream(
            js,
            StreamConfig(
                name=self.events_stream,
                subjects=[f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.stream}.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                num_replicas=replicas,
                max_age=s.dlq_retention,
                description="Agent-Reach: tasks that reached max deliveries, for the registries",
            ),
        )
        for bucket, what in (
            (self.bucket, "Agent-Reach task records, one per task id"),
            (self.idem_bucket, "Agent-Reach idempotency keys and running-task claims"),
        ):
            await bind_bucket(
                js,
                KeyValueConfig(
                    bucket=bucket,
                    history=1,
                    storage=StorageType.FILE,
                    replicas=replicas,
                    direct=True,
                    description=what,
                ),
                create=True,
            )
        self._ready = True

    async def ensure_schedules(self) -> None:
        """Make sure the task stream lets the server hold schedules (ADR-51), which a
        delayed task, a retry later and a periodic schedule wait as: a stream made
        before they existed is updated once (the server allows it on a stream in use).
        ``ConfigurationError`` when the server cannot (older than 2.12), or the update
        is refused."""
        if self._schedules:
            return
        await self.ensure()
        config = (await self.js.stream_info(self.stream)).config
        if not config.allow_msg_schedules:
            config.allow_msg_schedules = True
            try:
                config = (await self.js.update_stream(config)).config
            except nats.js.errors.APIError as exc:
                raise ConfigurationError(
                    f"stream {self.stream} does not allow message schedules and could not"
                    f" be changed ({exc.description}); run 'reach tasks init' as a user"
                    " allowed to update it"
                ) from None
        if not config.allow_msg_schedules:
            raise ConfigurationError(
                "this nats-server does not hold message schedules (delayed and periodic"
                " tasks and retry later need nats-server 2.12, every and cron 2.14)"
            )
        self._schedules = True

    async def in_use(self) -> bool:
        """Whether tasks are used under this prefix (an agent or a client made the
        streams); a registry waits for that rather than making them itself."""
        if self._ready:
            return True
        try:
            await self.js.stream_info(self.events_stream)
        except nats.js.errors.NotFoundError:
            return False
        return True  # made by whoever used tasks first, with the rest

    async def wait_in_use(self, poll: float, stopping: asyncio.Event) -> bool:
        """True once tasks are used under this prefix (looking every ``poll`` seconds);
        False when ``stopping`` is set first."""
        while not stopping.is_set():
            if await self.in_use():
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), poll)
        return False

    async def ensure_consumer(self, capability: str, priority: Priority) -> str:
        name = consumer_name(capability, priority)
        # ``name`` puts the filter in the API subject ($JS.API.CONSUMER.CREATE.<stream>.
        # <name>.<filter>), which the server checks against the config: a permission on
        # that subject lets an agent make its own consumers and no consumer of other tasks.
        config = ConsumerConfig(
            name=name,
            durable_name=name,
            filter_subject=self.subjects.task_queue(capability, priority),
            ack_wait=self.settings.task_ack_wait,
            max_deliver=self.settings.task_max_deliver,
            max_ack_pending=-1,
            description=f"Agent-Reach tasks for {capability} at {priority} priority",
        )
        await self.js.add_consumer(self.stream, config)
        return name

    # -- records ---------------------------------------------------------------------

    async def get(self, task_id: str) -> Stored | None:
        """The record and its revision; None when there is none (never was, or expired).
        ``CorruptRecord`` when what is stored does not decode."""
        got = await self.get_raw(task_id)
        if got is None:
            return None
        data, revision = got
        return Stored(decode_record(data, task_id, revision), revision)

    async def get_raw(self, task_id: str) -> tuple[bytes, int] | None:
        """The record's stored bytes and revision, undecoded; None when there is none."""
        if not _TASK_ID.fullmatch(task_id):
            return None  # not an id we could have made (and never a subject wildcard)
        msg = await self._direct_get(self._kv_stream, f"$KV.{self.bucket}.{task_id}")
        if msg is None:
            return None
        headers = msg.headers or {}
        if not msg.data or KV_OP in headers or MARKER_REASON in headers:
            return None
        return bytes(msg.data), int(msg.seq or 0)

    async def write(self, record: TaskRecord, last: int) -> int:
        """Write ``record`` iff the key's revision is still ``last`` (0: absent); its new
        revision. Raises Conflict when someone wrote in between.

        The record is kept ``task_retention`` past its last write, or past its due time
        when that is later: a task waiting for a retry later longer than the retention
        must still find its record (its attempts) when it runs again."""
        headers = {STATE_HEADER: str(record.state), AGENT_HEADER: record.agent_id or "-"}
        ttl = self.settings.task_retention + max(0.0, (record.due_ms - now_ms()) / 1000)
        return await _kv.write(
            self._send,
            self.bucket,
            record.task_id,
            _encode(record),
            last=last,
            ttl=ttl,
            headers=headers,
        )

    async def lookup(self, task_id: str) -> Stored | None:
        """The task as anyone sees it: its record, or, for a task no agent has taken yet,
        a PENDING record made from its message (revision 0: the first write creates)."""
        stored = await self.get(task_id)
        if stored is not None or not _TASK_ID.fullmatch(task_id):
            return stored
        msg = await self._direct_get(self.stream, self.subjects.task_lookup(task_id))
        if msg is None:
            # an agent may have finished it between the two reads: the record is written
            # before the message goes, so a second look at the record settles it
            return await self.get(task_id)
        try:
            sub = _submit_decoder.decode(msg.data or b"")
        except msgspec.DecodeError:
            return None  # a message no agent can run either; it goes to the DLQ
        if sub.task_id != task_id:
            return None
        # one more look: an agent may have taken it between the two reads
        made = scheduled_record if SCHEDULE_HEADER in msg.headers else pending_record
        return await self.get(task_id) or Stored(made(sub, int(msg.seq or 0)), 0)

    # -- idempotency keys and claims -------------------------------------------------

    async def idem_create(self, key: str, value: bytes, ttl: float | None) -> int:
        """Atomically create ``key`` in ``reach_idem`` with a TTL; Conflict if it exists."""
        return await _kv.write(self._send, self.idem_bucket, key, value, last=0, ttl=ttl)

    async def idem_renew(self, key: str, value: bytes, ttl: float | None, last: int) -> int:
        return await _kv.write(self._send, self.idem_bucket, key, value, last=last, ttl=ttl)

    async def idem_put(self, key: str, value: bytes, ttl: float) -> int:
        """Overwrite ``key`` (a replay points the idempotency key at its new task)."""
        return await _kv.write(self._send, self.idem_bucket, key, value, last=None, ttl=ttl)

    async def idem_get(self, key: str) -> tuple[bytes, int] | None:
        """The value and revision of ``key``; None when absent or deleted."""
        value, rev = await self.idem_latest(key)
        return None if value is None else (value, rev)

    async def idem_latest(self, key: str) -> tuple[bytes | None, int]:
        """The newest message of ``key``: its value (None for none or a delete marker)
        and revision (0 for none)."""
        msg = await self._direct_get(self._idem_stream, f"$KV.{self.idem_bucket}.{key}")
        if msg is None:
            return None, 0
        headers = msg.headers or {}
        if not msg.data or KV_OP in headers or MARKER_REASON in headers:
            return None, int(msg.seq or 0)
        return bytes(msg.data), int(msg.seq or 0)

    async def idem_claim(self, key: str, value: bytes, ttl: float) -> int:
        """Create ``key`` unless it holds a value: atomic, and it also takes over a key
        whose newest message is a delete marker (a released claim). Conflict if held."""
        try:
            return await self.idem_create(key, value, ttl)
        except Conflict:
            held, rev = await self.idem_latest(key)
            if held is not None or not rev:
                raise
            return await self.idem_renew(key, value, ttl, rev)

    async def idem_delete(self, key: str, last: int) -> None:
        """Release a claim we hold (compare-and-set, so a newer holder's stays)."""
        await _kv.delete(self._send, self.idem_bucket, key, last=last, ttl=_kv.MARKER_TTL)

    # -- stream messages -------------------------------------------------------------

    async def message_of(self, task_id: str) -> int:
        """The stream sequence of the newest message of ``task_id`` in the work queue
        (found by its subject, whoever published it); 0 when there is none."""
        if not _TASK_ID.fullmatch(task_id):
            return 0
        msg = await self._direct_get(self.stream, self.subjects.task_lookup(task_id))
        return msg.seq if msg is not None else 0

    async def delete_message(self, seq: int) -> bool:
        """Delete message ``seq`` from the work queue; False when it was gone already."""
        try:
            await self.js.delete_msg(self.stream, seq)
        except nats.js.errors.NotFoundError:
            return False
        except nats.js.errors.APIError as exc:
            if not _gone(exc):
                raise
            return False
        return True

    async def message_exists(self, seq: int) -> bool:
        """Whether the task stream still holds message ``seq`` (not yet acked or removed)."""
        try:
            await self.js.get_msg(self.stream, seq=seq)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def _send(self, subject: str, data: bytes, headers: dict[str, str]) -> int:
        return await js_publish(self.js, self.api, subject, data, headers)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> int:
        """A JetStream publish on the fast path; the stream sequence."""
        with _kv.conflicts(subject):
            return await self._send(subject, data, headers)

    async def count(self, subject: str) -> int:
        """How many messages the task stream holds on ``subject`` (wildcards allowed),
        as the server counts them: one message crosses the wire, whatever the number."""
        got, more = await direct_batch(self._conn(), self.stream, subject)
        return len(got) + more

    async def each_on(self, subject: str, page: int = 256) -> AsyncIterator[Got]:
        """Every message of the task stream on ``subject``, oldest first, ``page`` to a
        request (batched direct gets: a work-queue stream takes no scanning consumer)."""
        seq = 0
        while True:
            got, more = await direct_batch(
                self._conn(), self.stream, subject, seq=seq + 1, batch=page
            )
            for msg in got:
                headers = dict(msg.headers or {})
                seq = int(headers.get("Nats-Sequence", seq + 1))
                yield Got(msg.data, headers, seq, headers.get("Nats-Subject", ""))
            if not got or not more:
                return

    def _conn(self) -> NatsConnection:
        assert self.nc is not None, "a TaskStore made without a connection (nc=) cannot count"
        return self.nc

    async def last_on(self, subject: str) -> Got | None:
        """The newest message of the task stream on ``subject`` (wildcards allowed)."""
        return await self._direct_get(self.stream, subject)

    async def _direct_get(self, stream: str, subject: str) -> Got | None:
        """The last message on ``subject`` in ``stream`` (a direct get), or None."""
        if self.api is not None:
            msg = await self.api.direct_get(stream, subject)
            if msg is None:
                return None
            headers = msg.headers or {}
            seq = int(headers.get("Nats-Sequence", 0))
            return Got(msg.data, headers, seq, headers.get("Nats-Subject", ""))
        try:
            raw = await self.js.get_msg(stream, subject=subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        headers = dict(raw.headers or {})
        if raw.time is not None and "Nats-Time-Stamp" not in headers:
            stamp = raw.time.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")
            headers["Nats-Time-Stamp"] = stamp
        return Got(raw.data or b"", headers, int(raw.seq or 0), raw.subject or "")


async def add_dlq_stream(js: JetStreamContext, subjects: Subjects, settings: ReachSettings) -> str:
    """The dead-letter stream (of tasks, their callbacks, and durable topics), made when
    missing; its name."""
    name = subjects.stream("DLQ")
    await add_stream(
        js,
        StreamConfig(
            name=name,
            subjects=[f"{subjects.prefix}.dlq.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=settings.stream_replicas,
            max_age=settings.dlq_retention,
            description="Agent-Reach dead letters: tasks and topic messages that failed for good",
        ),
    )
    return name


async def add_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create a stream, or leave an existing one as it is (another process made it; if
    with fewer replicas than asked, ``check_replicas`` says so). Looked up first: where
    streams are made at deploy time (``reach tasks init``), users need no right to create
    them."""
    assert config.name is not None
    try:
        await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        pass
    else:
        wanted = config.num_replicas or 1
        if wanted > 1:
            await check_replicas(js, config.name, wanted)
        return
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != JsErrorCode.STREAM_NAME_EXIST:
            raise
        wanted = config.num_replicas or 1
        if config.name and wanted > 1:
            await check_replicas(js, config.name, wanted)
