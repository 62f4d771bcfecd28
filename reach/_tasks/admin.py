"""Looking into the task system and repairing it: list records, read and replay dead letters.

Listing never reads every record: a headers-only consumer over ``$KV.<bucket>.>`` that
delivers the last message of each key gives every task's state and agent (the
``Reach-Task-State``/``Reach-Task-Agent`` headers each write carries) and revision; only
the records that pass the filter are fetched, most recently changed first. The DLQ is read
the same way: headers first, bodies only for the dead letters shown.

A replay publishes the dead letter's TaskSubmit again under a new task id, with
``replay_of`` naming the old one and the same idempotency key (which is pointed at the new
task), then deletes the dead letter. The new id is derived from the dead letter, so a replay
repeated after a crash, or run twice at once, makes one task, not two. An undelivered
callback is not a task: it is not replayed (its result is in the task's record), nor is a
durable topic's message (kind ``topic``): ``reach._topics`` replays those, reading them with
``dead_letter_at`` as here.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .._codec import now_ms
from .._kv import KV_OP, MARKER_REASON
from .._nats import TRANSIENT
from .._subjects import validate_capability
from ..errors import ConfigurationError, CorruptRecord, DeadLetterNotFound, NotReplayable
from ..wire.tasks import TaskAttempt, TaskRecord, TaskState, TaskSubmit
from .dlq import DLQ_ATTEMPTS, DLQ_ERROR, DLQ_GROUP, DLQ_KIND, DLQ_REASON, TASK_ID
from .store import (
    AGENT_HEADER,
    SCHEDULE_HEADER,
    STATE_HEADER,
    TaskStore,
    idem_key,
    pending_record,
    scheduled_record,
)
from .submit import publish_task

__all__ = [
    "DeadLetter",
    "DeadLetterNotFound",
    "NotReplayable",
    "RecordMeta",
    "Seen",
    "dead_letter_at",
    "dead_letters",
    "dead_letters_to_purge",
    "list_records",
    "purge_dead_letters",
    "record_index",
    "record_meta",
    "replay",
    "replay_capability",
    "scan",
    "scan_page",
]

log = logging.getLogger("reach.tasks")

_BATCH = 256
_SCAN_TIMEOUT = 5.0
_attempts_decoder = msgspec.json.Decoder(list[TaskAttempt])
_submit_decoder = msgspec.json.Decoder(TaskSubmit)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message in the dead-letter stream: a task that failed for good (``kind`` "task"),
    or a callback never acknowledged (``kind`` "callback"). ``data`` and ``headers`` are
    the original message's; ``reason`` says why it is here (``failed``, ``timeout``,
    ``bad_request``, ``max_deliveries``, ``callback_undelivered``...)."""

    seq: int
    task_id: str
    capability: str
    kind: str
    reason: str
    error: str
    attempts: list[TaskAttempt] = field(default_factory=list)
    time: datetime.datetime | None = None
    headers: dict[str, str] = field(default_factory=dict)
    data: bytes = b""
    #: a durable topic's letter (``kind`` "topic"): its topic, and the agent name whose
    #: subscription gave up on it (``capability`` is empty)
    topic: str = ""
    group: str = ""

    def submit(self) -> TaskSubmit:
        """The task to run again; ``NotReplayable`` saying why when there is none."""
        if self.kind == "topic":
            raise NotReplayable(
                f"dead letter {self.seq} is a message of topic {self.topic!r} that agent"
                f" {self.group!r} gave up on, not a task: replay it with"
                f" 'reach dlq replay {self.seq}' (client.replay_topic)"
            )
        if self.kind != "task":
            raise NotReplayable(
                f"dead letter {self.seq} is an undelivered {self.kind} of task {self.task_id}, "
                "not a task: it is not replayed (the task's result is in its record)"
            )
        try:
            return _submit_decoder.decode(self.data)
        except msgspec.DecodeError as exc:
            raise NotReplayable(
                f"dead letter {self.seq} ({self.reason}) does not decode as a task ({exc}); "
                "it cannot be replayed: resubmit its payload by hand"
            ) from None


@dataclass(frozen=True, slots=True)
class Seen:
    """One stream message as a headers-only scan saw it."""

    subject: str
    seq: int
    headers: dict[str, str]
    at_ms: int


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """A task record as its headers tell it, without its body."""

    task_id: str
    revision: int
    state: TaskState | None  # None: a record written without the header
    agent_id: str
    changed_ms: int


async def scan(
    js: JetStreamContext, stream: str, subject: str, *, last_per_subject: bool
) -> list[Seen]:
    """Every message of ``stream`` on ``subject`` (or the newest one of each subject),
    headers only, through a short-lived consumer; [] when the stream does not exist."""
    seen, _ = await scan_page(js, stream, subject, last_per_subject=last_per_subject)
    return seen


async def scan_page(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    last_per_subject: bool,
    limit: int | None = None,
    each: Callable[[Seen], None] | None = None,
) -> tuple[list[Seen], int]:
    """``scan``, stopping after ``limit`` messages (None: all), in stream order; also the
    number of messages there were to see when it started. With ``each``, every message
    goes to it as it comes instead of into the list (memory stays flat however many)."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT if last_per_subject else DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        headers_only=True,
        inactive_threshold=60.0,
        mem_storage=True,
        num_replicas=1,
    )
    try:
        psub = await js.pull_subscribe(subject, stream=stream, config=config)
    except nats.js.errors.NotFoundError:
        return [], 0
    seen: list[Seen] = []
    total = count = 0
    try:
        total = pending = (await psub.consumer_info()).num_pending or 0
        if limit is not None:
            pending = min(pending, limit)
        while pending > 0:
            try:
                msgs = await psub.fetch(min(_BATCH, pending), timeout=_SCAN_TIMEOUT)
            except TimeoutError:
                break  # what was pending went away meanwhile (expired or deleted)
            for m in msgs:
                md = m.metadata
                at = int(md.timestamp.timestamp() * 1000)
                one = Seen(m.subject, md.sequence.stream, dict(m.headers or {}), at)
                if each is None:
                    seen.append(one)
                else:
                    each(one)
                count += 1
                pending = md.num_pending
            if limit is not None:
                pending = min(pending, limit - count)
    finally:
        try:
            await psub.unsubscribe()
            if config.name:
                await js.delete_consumer(stream, config.name)
        except TRANSIENT as exc:  # it goes by itself after inactive_threshold
            log.debug("scan of %s: cleanup: %s", stream, exc)
    return seen, total


# -- task records --------------------------------------------------------------------------


async def record_index(store: TaskStore) -> list[RecordMeta]:
    """Every live record's state, agent and revision, from headers only."""
    prefix = f"$KV.{store.bucket}."
    seen = await scan(store.js, f"KV_{store.bucket}", f"{prefix}>", last_per_subject=True)
    return [m for m in (record_meta(prefix, s) for s in seen) if m is not None]


async def each_record(store: TaskStore, visit: Callable[[RecordMeta], None]) -> None:
    """``record_index`` one record at a time (a sweep keeps only what it needs)."""
    prefix = f"$KV.{store.bucket}."

    def one(s: Seen) -> None:
        m = record_meta(prefix, s)
        if m is not None:
            visit(m)

    await scan_page(store.js, f"KV_{store.bucket}", f"{prefix}>", last_per_subject=True, each=one)


def record_meta(prefix: str, s: Seen) -> RecordMeta | None:
    """What the headers of a record's last message say (None: deleted or expired)."""
    if KV_OP in s.headers or MARKER_REASON in s.headers:
        return None
    raw = s.headers.get(STATE_HEADER, "")
    state = TaskState(raw) if raw in TaskState.__members__ else None
    agent = s.headers.get(AGENT_HEADER, "-")
    return RecordMeta(
        s.subject[len(prefix) :], s.seq, state, "" if agent == "-" else agent, s.at_ms
    )


async def list_records(
    store: TaskStore,
    *,
    state: TaskState | str | None = None,
    capability: str | None = None,
    limit: int = 100,
) -> list[TaskRecord]:
    """Records in ``state`` and of ``capability`` (None: any), most recently changed
    first, at most ``limit``."""
    try:
        want = TaskState(state.upper()) if state else None
    except ValueError:
        names = ", ".join(s.lower() for s in TaskState)
        raise ConfigurationError(f"state {state!r} is not one of {names}") from None
    out: list[TaskRecord] = []
    if want in (None, TaskState.PENDING, TaskState.SCHEDULED):
        out = await pending_tasks(store, capability=capability, state=want, limit=limit)
    metas = [m for m in await record_index(store) if want is None or m.state in (want, None)]
    metas.sort(key=lambda m: m.revision, reverse=True)
    found: list[TaskRecord] = []
    for m in metas:
        if len(found) >= limit:
            break
        try:
            st = await store.get(m.task_id)
        except CorruptRecord as exc:  # a list is not stopped by one bad record
            log.warning("list of tasks: %s", exc.message)
            continue
        if st is None:
            continue  # expired since the scan
        rec = st.record
        if (want is None or rec.state is want) and (not capability or rec.capability == capability):
            found.append(rec)
    out.extend(found)
    out.sort(key=lambda r: r.updated_ms, reverse=True)
    return out[:limit]


async def pending_tasks(
    store: TaskStore,
    *,
    capability: str | None = None,
    state: TaskState | None = None,
    limit: int = 100,
    scan: int = 10_000,
) -> list[TaskRecord]:
    """Tasks no agent has taken yet: messages in the task stream without a record (the
    message is the PENDING state; a schedule the server holds, the SCHEDULED state), only
    those in ``state`` if given (filtered before ``limit`` counts them). Walks the stream
    with direct gets (a work queue takes no second consumer), at most ``scan`` messages."""
    subject = f"{store.subjects.prefix}.task.>"
    out: list[TaskRecord] = []
    seq = 0
    for _ in range(scan):
        if len(out) >= limit:
            break
        try:
            msg = await store.js.get_msg(
                store.stream, seq=seq + 1, subject=subject, next=True, direct=True
            )
        except nats.js.errors.NotFoundError:
            break
        seq = int(msg.seq or seq + 1)
        try:
            sub = _submit_decoder.decode(msg.data or b"")
        except msgspec.DecodeError:
            continue  # not a task (a periodic schedule, one of its firings), or junk
        if capability and sub.capability != capability:
            continue
        scheduled = SCHEDULE_HEADER in (msg.headers or {})
        if state is not None and state is not (
            TaskState.SCHEDULED if scheduled else TaskState.PENDING
        ):
            continue
        made = scheduled_record if scheduled else pending_record
        try:
            if await store.get(sub.task_id) is None:
                out.append(made(sub, seq))
        except CorruptRecord:
            continue  # it has a record, if a broken one: not PENDING
    return out


# -- dead letters --------------------------------------------------------------------------


def _dead_letter(
    store: TaskStore,
    seq: int,
    subject: str,
    headers: dict[str, str],
    data: bytes,
    time: datetime.datetime | None,
) -> DeadLetter:
    try:
        attempts = _attempts_decoder.decode(headers.get(DLQ_ATTEMPTS, "[]"))
    except msgspec.DecodeError:
        attempts = []  # cut short to fit a header
    error = headers.get(DLQ_ERROR, "")
    name = subject[len(store.subjects.dlq("")) :]
    topic = name[len("$topic.") :] if subject.startswith(store.subjects.topic_dlq("")) else ""
    return DeadLetter(
        seq=seq,
        task_id=headers.get(TASK_ID, ""),
        capability="" if topic else name,
        topic=topic,
        group=headers.get(DLQ_GROUP, ""),
        kind=headers.get(DLQ_KIND, "topic" if topic else "task"),
        reason=headers.get(DLQ_REASON, ""),
        error="" if error == "-" else error,
        attempts=attempts,
        time=time,
        headers=headers,
        data=data,
    )


async def dead_letter_at(store: TaskStore, seq: int) -> DeadLetter:
    """The dead letter at DLQ sequence ``seq``; ``DeadLetterNotFound`` if there is none."""
    if seq < 1:
        raise DeadLetterNotFound(seq, store.dlq_stream)
    try:
        msg = await store.js.get_msg(store.dlq_stream, seq=seq)
    except nats.js.errors.NotFoundError:
        raise DeadLetterNotFound(seq, store.dlq_stream) from None
    subject = msg.subject or ""
    if not subject.startswith(store.subjects.dlq("")):
        raise DeadLetterNotFound(seq, store.dlq_stream)
    headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
    return _dead_letter(store, seq, subject, headers, bytes(msg.data or b""), msg.time)


async def _dlq_seqs(
    store: TaskStore, capability: str | None, topic: str | None = None
) -> list[int]:
    subject = store.subjects.topic_dlq(topic) if topic else store.subjects.dlq(capability or ">")
    return [s.seq for s in await scan(store.js, store.dlq_stream, subject, last_per_subject=False)]


async def dead_letters(
    store: TaskStore, capability: str | None = None, limit: int = 100, *, topic: str | None = None
) -> list[DeadLetter]:
    """Dead letters (of ``capability``, or of durable topic ``topic``, wildcards allowed;
    None: all), newest first, at most ``limit``."""
    out: list[DeadLetter] = []
    for seq in sorted(await _dlq_seqs(store, capability, topic), reverse=True):
        if len(out) >= limit:
            break
        try:
            out.append(await dead_letter_at(store, seq))
        except DeadLetterNotFound:
            continue  # replayed or expired since the scan
    return out


async def dead_letters_to_purge(
    store: TaskStore, capability: str | None = None, older_than: float | None = None
) -> list[int]:
    """The DLQ sequences a purge with these filters removes: every dead letter (tasks,
    callbacks and durable topics' letters), or those of ``capability``; only those stored
    more than ``older_than`` seconds ago, if given. Oldest first. A capability with a
    wildcard or a bad token is a ``ConfigurationError``: a purge takes exact names."""
    if capability:
        try:
            validate_capability(capability)
        except ValueError as exc:
            raise ConfigurationError(f"dead letters of {capability!r}: {exc}") from None
    subject = store.subjects.dlq(capability or ">")
    cutoff = now_ms() - int(older_than * 1000) if older_than is not None else None
    seen = await scan(store.js, store.dlq_stream, subject, last_per_subject=False)
    return sorted(s.seq for s in seen if cutoff is None or s.at_ms < cutoff)


async def purge_dead_letters(
    store: TaskStore,
    capability: str | None = None,
    older_than: float | None = None,
    *,
    expect: int | None = None,
) -> int:
    """Remove the dead letters ``dead_letters_to_purge`` names, at once: one purge of the
    DLQ stream on their subject below the newest of them + 1, so a letter stored after the
    scan (newer, so a higher sequence) stays; how many the server removed. ``expect``: the
    count the caller was shown; when the scan finds another number, nothing is removed
    (``ConfigurationError`` saying both). The one scan is both the check and the bound:
    what goes is what was counted (or less, when some were replayed meanwhile)."""
    seqs = await dead_letters_to_purge(store, capability, older_than)
    if expect is not None and len(seqs) != expect:
        raise ConfigurationError(
            f"{len(seqs)} dead letters match now, not the {expect} expected: nothing"
            " purged; count again"
        )
    if not seqs:
        return 0
    assert store.api is not None, "a purge goes through the store's JetStream API inbox"
    upto = seqs[-1] + 1  # up to, not including: letters are stored in time order
    purged = await store.api.purge(store.dlq_stream, store.subjects.dlq(capability or ">"), upto)
    log.info("purged %d dead letters (%s)", purged, capability or "all")
    return purged


def replay_id(store: TaskStore, seq: int, old_task_id: str) -> str:
    """The task id a replay of dead letter ``seq`` gets: new, and the same every time."""
    digest = hashlib.blake2b(
        f"{store.dlq_stream}.{seq}.{old_task_id}".encode(), digest_size=12
    ).hexdigest()
    return f"r{digest}"


async def replay(store: TaskStore, seq: int, *, notify: str = "") -> str:
    """Run dead letter ``seq`` again as a new task (same payload, options and idempotency
    key; ``replay_of`` the old id), then delete the dead letter; the new task id.
    ``NotReplayable`` for a callback or a message that never decoded."""
    dl = await dead_letter_at(store, seq)
    old = dl.submit()
    new_id = replay_id(store, seq, dl.task_id or old.task_id)
    if await store.lookup(new_id) is None:
        sub = msgspec.structs.replace(
            old,
            task_id=new_id,
            replay_of=dl.task_id or old.task_id,
            notify=notify,
            submitted_ms=now_ms(),
        )
        await publish_task(store, sub)  # the message is the new task's PENDING state
    if old.idempotency_key:  # a submit with this key now finds the new task
        key = idem_key("submit", old.idempotency_key)
        await store.idem_put(key, new_id.encode(), store.settings.task_idempotency_ttl)
    with contextlib.suppress(nats.js.errors.NotFoundError):  # a concurrent replay did
        await store.js.delete_msg(store.dlq_stream, seq)
    log.info("dead letter %s (task %s) replayed as task %s", seq, dl.task_id, new_id)
    return new_id


async def replay_capability(
    store: TaskStore, capability: str, *, notify: str = ""
) -> tuple[list[str], list[tuple[int, str]]]:
    """Replay every dead letter of ``capability``, oldest first: the new task ids, and
    the dead letters left in place with the reason (``(seq, message)``)."""
    replayed: list[str] = []
    skipped: list[tuple[int, str]] = []
    for seq in sorted(await _dlq_seqs(store, capability)):
        try:
            replayed.append(await replay(store, seq, notify=notify))
        except NotReplayable as exc:
            skipped.append((seq, exc.message))
        except DeadLetterNotFound:
            continue  # replayed by someone else meanwhile
    return replayed, skipped
