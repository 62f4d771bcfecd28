"""Recovery of tasks that nobody would finish; run by registries (``TaskRecovery``).

Two safety nets under the agents' own retries: the sweep (``sweep.py``: a task whose
message is gone gets it back) and max deliveries, here.

A message delivered ``task_max_deliver`` times without an ack stays in the work-queue
stream, never delivered again, and the server announces it on core NATS,
``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>``. Stream
``<PREFIX>_TASK_EVENTS`` (made with the task streams; work queue, file, kept
``dlq_retention``) catches every such advisory, so it waits for a registry when none runs.
The registries share one durable pull consumer on it, so one of them takes each advisory:

1. the record becomes FAILED (made from the message if there is none; a final one stays);
2. the message becomes a dead letter (reason ``max_deliveries``);
3. the message is deleted from the task stream;
4. only then is the advisory acked.

A record that does not decode is replaced by a FAILED one (error ``undecodable``), and
the letter's reason is ``undecodable``. An advisory can be lost (the events stream between
leaders when the server publishes it): the sweep then finds the message (``given_up``).

Any failure naks it with a backoff, and it is handled again from the start: each step is
idempotent (a compare-and-set; the letter's ``Nats-Msg-Id`` is the one the agent would use
for the same attempts, so the two never store two letters). FAILED comes before the letter,
as on an agent: a late success of the last attempt is then fenced, where a letter stored
first would stay behind for a task that succeeded (and a replay would run it again).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from .._background import Background
from .._codec import now_ms
from .._nats import TRANSIENT, NatsConnection, jetstream_unready
from .._subjects import Subjects
from ..errors import CorruptRecord
from ..settings import ReachSettings
from ..wire import ErrorBody
from ..wire.tasks import TaskRecord, TaskState, TaskSubmit
from .dlq import TASK_ID, dead_letter
from .states import advance, end_attempt, retry_delay
from .store import UNDECODABLE, Conflict, Stored, TaskStore, pending_record, undecodable_record
from .sweep import RETRIED, RecoveryStats, Sweeper, submit_of

__all__ = ["RecoveryStats", "TaskRecovery", "submit_of"]

_UNUSED_POLL = 1.0  # seconds between looks for task streams while tasks are unused
log = logging.getLogger("reach.tasks")
S = TaskState
_submit_decoder = msgspec.json.Decoder(TaskSubmit)
_encode = msgspec.json.Encoder().encode
_CONSUMER = "registries"  # on the events stream: one, shared by every replica
_ACK_WAIT = 30.0  # fixed, so replicas with other settings never rewrite the consumer
_BATCH = 16
_FETCH_WAIT = 2.0  # also how long a stop may wait for the loop
_NAK_BASE, _NAK_CAP = 0.5, 30.0  # seconds before an advisory that failed is handled again
_TRIES = 8


class TaskRecovery:
    """The max-deliveries consumer and the sweep for one subject prefix, on ``nc``; both
    loops live in ``owner`` (its close ends them; an advisory cut in half is handled again,
    every step being idempotent)."""

    def __init__(
        self,
        nc: NatsConnection,
        settings: ReachSettings,
        subjects: Subjects,
        owner: Background,
        stats: RecoveryStats | None = None,
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = subjects
        self.owner = owner
        self.stats = stats if stats is not None else RecoveryStats()
        self.store = TaskStore(nc.jetstream(), subjects, settings, nc=nc)
        self.stopping = asyncio.Event()
        self.sweeper = Sweeper(
            self.store,
            settings,
            subjects,
            self.stats,
            self.stopping,
            nc=nc,
            given_up=self.given_up,
        )

    def start(self) -> None:
        """Take max-deliveries advisories, and sweep unless ``task_sweep_interval`` is 0."""
        self.owner.keep(
            self._taking_advisories, "tasks: max deliveries", expected=jetstream_unready
        )
        if self.settings.task_sweep_interval > 0:
            self.owner.keep(self.sweeper.sweeping, "tasks: sweep", expected=jetstream_unready)

    def stop(self) -> None:
        """Ask the loops to end; call it before closing the owner. A nats-py request may
        swallow the owner's cancellation (Python 3.11, gh-86296): the loops then end at
        their next look at this flag instead of running on and holding the close."""
        self.stopping.set()

    # -- max deliveries ------------------------------------------------------------------

    async def _taking_advisories(self) -> None:
        store = self.store
        if not await store.wait_in_use(_UNUSED_POLL, self.stopping):
            return
        config = ConsumerConfig(
            durable_name=_CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=_ACK_WAIT,
            max_deliver=-1,
            description="Agent-Reach registries: tasks that reached max deliveries",
        )
        await store.js.add_consumer(store.events_stream, config)
        psub = await store.js.pull_subscribe_bind(_CONSUMER, store.events_stream)
        try:
            while not self.stopping.is_set():
                try:
                    msgs = await psub.fetch(_BATCH, timeout=_FETCH_WAIT)
                except TimeoutError:
                    continue
                for msg in msgs:
                    await self._take(msg)
        finally:
            try:
                await psub.unsubscribe()
            except TRANSIENT as exc:
                log.debug("task recovery: unsubscribe: %s", exc)

    async def _take(self, msg: Msg) -> None:
        """Handle one captured advisory: ack it when done, nak it (later) when not."""
        try:
            await self.on_max_deliveries(msg.data)
        except Exception as exc:  # counted, logged, handled again after a backoff
            self.stats.errors += 1
            if isinstance(exc, RETRIED):
                log.warning("task recovery: a max-deliveries advisory failed: %r", exc)
            else:
                log.exception("task recovery: a bug handling a max-deliveries advisory")
            delay = retry_delay(msg.metadata.num_delivered, _NAK_BASE, _NAK_CAP)
            await _reply(msg.nak(delay=delay))
            return
        await _reply(msg.ack())

    async def on_max_deliveries(self, data: bytes) -> bool:
        """Handle one advisory; True when this call removed the message (after its record
        is final and its dead letter stored), so replicas racing on one count it once.
        Raises what failed, leaving the rest to a later call."""
        try:
            advisory: dict[str, Any] = json.loads(data)
            seq = int(advisory["stream_seq"])
            deliveries = int(advisory.get("deliveries", 0))
        except (ValueError, KeyError, TypeError) as exc:
            self.stats.errors += 1
            log.warning("task recovery: an advisory that does not parse: %s", exc)
            return False
        return await self.given_up(seq, deliveries)

    async def given_up(self, seq: int, deliveries: int) -> bool:
        """Handle message ``seq``, which JetStream gave up on after ``deliveries``: told by
        its advisory, or found by a sweep when the advisory was lost. As
        ``on_max_deliveries``."""
        store = self.store
        try:
            msg = await store.js.get_msg(store.stream, seq=seq)
        except nats.js.errors.NotFoundError:
            return False  # acked late, or handled already
        data = bytes(msg.data or b"")
        headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
        task_id = headers.get(TASK_ID, "")
        capability = self._capability(msg.subject or "")
        sub: TaskSubmit | None = None
        try:
            sub = _submit_decoder.decode(data)
            task_id, capability = sub.task_id, sub.capability
        except msgspec.DecodeError:
            pass  # dead-lettered as it is
        rec = await self._fail(task_id, sub, seq, capability) if task_id else None
        if rec is None or rec.state is S.FAILED:
            # no attempt: deliveries spent by agents that died holding it before they
            # began it (an agent that puts a task back spends none)
            never = "" if rec is not None and rec.attempts else "; it never ran"
            error = f"delivered {deliveries} times without being acknowledged{never}"
            reason = "max_deliveries"
            if rec is not None and rec.error is not None and rec.error.code == UNDECODABLE:
                reason, error = UNDECODABLE, rec.error.message  # what the record says
            await dead_letter(
                store,
                capability=capability,
                task_id=task_id,
                data=data,
                headers=headers,
                reason=reason,
                error=error,
                attempts=rec.attempts if rec else (),
                seq=seq,
            )
        try:
            await store.js.delete_msg(store.stream, seq)
        except nats.js.errors.NotFoundError:
            return False  # another replica got there first: it counts this one
        self.stats.max_deliveries += 1
        log.warning("task %s: max deliveries reached; moved to the DLQ", task_id or f"#{seq}")
        return True

    def _capability(self, subject: str) -> str:
        """``<prefix>.task.<id>.<cap>.<prio>`` -> ``<cap>``."""
        head = f"{self.subjects.prefix}.task."
        if not subject.startswith(head):
            return ""
        return subject[len(head) :].partition(".")[2].rpartition(".")[0]

    async def _fail(
        self, task_id: str, sub: TaskSubmit | None, seq: int, capability: str
    ) -> TaskRecord | None:
        """Mark the task FAILED unless it is final; the record as it ends, None if none.
        A task no agent ever took has no record yet: it is made from its message. A record
        that does not decode is replaced (error and dead-letter reason ``undecodable``)."""
        for _ in range(_TRIES):
            try:
                st = await self.store.get(task_id)
            except CorruptRecord as exc:
                new = undecodable_record(exc, sub, seq, now_ms(), capability)
                try:
                    await self.store.write(new, exc.revision)
                except Conflict:
                    continue
                self.stats.undecodable += 1
                log.error("task recovery: %s", exc.message)
                await self._notify(new)
                return new
            if st is None and sub is not None:
                st = Stored(pending_record(sub, seq), 0)
            if st is None:
                return None
            rec = st.record
            if rec.final:
                return rec
            at = now_ms()
            new = advance(
                rec,
                [S.FAILED],
                at,
                "max deliveries reached",
                attempts=end_attempt(
                    list(rec.attempts), rec.attempt, at, "failed", "max deliveries reached"
                ),
                error=ErrorBody(code="failed", message="max deliveries reached"),
            )
            try:
                await self.store.write(new, st.revision)
            except Conflict:
                continue
            await self._notify(new)
            return new
        raise Conflict(task_id)

    async def _notify(self, rec: TaskRecord) -> None:
        if rec.notify:
            try:
                await self.nc.publish(rec.notify, _encode(rec))
            except TRANSIENT as exc:
                log.debug("task %s: notify: %s", rec.task_id, exc)

    async def sweep(self) -> int:
        """One sweep now (without the lock); how many tasks it recovered."""
        return await self.sweeper.sweep()


async def _reply(reply: Any) -> None:
    """Send an ack or nak; one lost is redelivered after ack_wait anyway."""
    try:
        await reply
    except TRANSIENT as exc:
        log.debug("task recovery: ack: %s", exc)
