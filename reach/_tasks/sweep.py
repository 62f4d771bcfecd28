"""The recovery sweep (``Sweeper``): tasks whose message is gone get it back.

Every ``task_sweep_interval`` seconds ONE registry of several sweeps: the one that takes key
``recovery.sweep`` in ``<prefix>_idem`` (TTL: the interval, at least 1 s; its holder keeps
it). The cost of a sweep: one headers-only scan of the records bucket (the newest message
of each key: state and agent, no bodies), one direct get per non-final record (is a message
of the task in the task stream?), and only for a record whose message is gone, a
headers-only scan of the agents bucket and a read of that record.

A record whose message is in the stream is left alone, whatever its state: JetStream
redelivers the message if its agent died, and a live agent keeps it, registered or not. A
non-final record whose message is gone (lost with a store, deleted by hand) is recovered,
unless it is RUNNING on an agent that holds a lease or changed within ``lease_ttl +
task_ack_wait``. Its RUNNING attempt ends "lost" and the record is written as RETRYING with
sequence 0 ("message being published"); then the message, rebuilt from the record, is
published with ``Nats-Msg-Id`` ``<task_id>.s<attempt>`` (two sweeps make one message); then
its sequence is written into the record. An agent that takes the message before that last
write reads sequence 0, never a gone one, so it cannot drop the message as a duplicate.
Every write is a compare-and-set, so sweeps that overlap (a slow one) do no harm.

Three more nets, so that no task stays stuck and no cancelled task comes back:
- a non-final record with ``cancel_requested`` whose agent and message are gone is ended
  CANCELLED, not republished; one that does not decode (and has no message) is kept as a
  dead letter and replaced by a FAILED record (``undecodable``);
- a CANCELLED record in its first or its last stretch (``_CANCEL_WINDOW`` sweep intervals,
  at least a minute) has any message of its task removed (a cancel cut short before its
  delete; the message would run the task once the record expired) and a pending callback
  sent (a task cancelled before any agent took it has no agent to send it);
- messages JetStream gave up on whose max-deliveries advisory never came are found from the
  task consumers' state (``find_given_up``) and handled as the advisory would have been.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.js.errors
from nats.nuid import NUID

from .._codec import now_ms
from .._kv import KV_OP, MARKER_REASON
from .._nats import TRANSIENT, NatsConnection
from .._subjects import Subjects
from ..errors import CorruptRecord
from ..settings import ReachSettings
from ..wire import ErrorBody
from ..wire.tasks import TaskRecord, TaskState, TaskSubmit
from .admin import RecordMeta, each_record, scan
from .callbacks import send_callback, set_callback_state
from .dlq import dead_letter
from .refs import remove_messages
from .schedules import count_scheduled, count_schedules
from .states import IllegalTransition, advance, end_attempt, is_final
from .store import UNDECODABLE, Conflict, Stored, TaskStore, undecodable_record
from .submit import publish_task

__all__ = ["RETRIED", "RecoveryStats", "Sweeper", "submit_of"]

log = logging.getLogger("reach.tasks")
S = TaskState
_LOCK = "recovery.sweep"  # in <prefix>_idem: who sweeps this interval
_MIN_TTL = 1.0  # the server's smallest per-message TTL
_TRIES = 8
_PARALLEL = 32
#: a CANCELLED record is looked at (is its message gone? its callback sent?) in its first
#: and in its last stretch of this many sweep intervals (at least a minute)
_CANCEL_WINDOW = 10
_encode = msgspec.json.Encoder().encode
#: what a failed advisory, sweep or record recovery may raise: counted, logged, tried again
RETRIED: tuple[type[BaseException], ...] = (*TRANSIENT, Conflict, IllegalTransition)
_FINISH_ERRORS: tuple[type[BaseException], ...] = (*RETRIED, CorruptRecord)


@dataclass(slots=True)
class RecoveryStats:
    """What the recovery did (copied into ``RegistryStats``)."""

    sweeps: int = 0
    #: sweeps not made because another replica held the lock for that interval
    sweeps_skipped: int = 0
    #: tasks whose message was gone, published again (RUNNING ones via RETRYING)
    tasks_recovered: int = 0
    #: messages that reached max deliveries and were moved to the DLQ
    max_deliveries: int = 0
    #: of the messages JetStream gave up on, those a sweep found (their advisory was lost)
    advisories_missed: int = 0
    #: task records that did not decode, replaced by FAILED ones (``undecodable``)
    undecodable: int = 0
    #: cancels finished by a sweep: a CANCELLED task's message removed from the work queue
    #: (its canceller stopped half-way), or a cancel-requested task of a vanished agent ended
    cancels_finished: int = 0
    #: advisories, sweeps or records that could not be handled (logged; tried again later)
    errors: int = 0
    #: task records by state and messages in the DLQ, as of this replica's last sweep
    states: dict[str, int] | None = None
    dlq_messages: int | None = None
    #: periodic schedules by state (active, paused), as of this replica's last sweep
    schedules: dict[str, int] | None = None


def submit_of(rec: TaskRecord) -> TaskSubmit:
    """The task message rebuilt from its record (the record keeps the payload)."""
    return TaskSubmit(
        task_id=rec.task_id,
        capability=rec.capability,
        priority=rec.priority,
        payload=rec.payload,
        timeout=rec.timeout,
        max_attempts=rec.max_attempts,
        idempotency_key=rec.idempotency_key,
        callback=rec.callback,
        notify=rec.notify,
        version=rec.version,
        required_tags=list(rec.required_tags),
        caller=rec.caller,
        submitted_ms=rec.submitted_ms,
        replay_of=rec.replay_of,
    )


#: handles one message JetStream gave up on: (stream sequence, deliveries) -> removed
GivenUp = Callable[[int, int], Awaitable[bool]]


class Sweeper:
    """The sweep for one store; ``sweeping`` is its loop (run it in a ``Background``).
    ``given_up`` handles a message JetStream gave up on as its advisory would have been;
    ``nc`` sends the notices and callbacks of the tasks a sweep ends."""

    def __init__(
        self,
        store: TaskStore,
        settings: ReachSettings,
        subjects: Subjects,
        stats: RecoveryStats,
        stopping: asyncio.Event,
        *,
        nc: NatsConnection | None = None,
        given_up: GivenUp | None = None,
    ) -> None:
        self.store = store
        self.nc = nc
        self.given_up = given_up
        #: set at a stop: the loop ends even if a nats-py call swallowed its cancellation
        self.stopping = stopping
        self.settings = settings
        self.subjects = subjects
        self.stats = stats
        self.agents_bucket = subjects.bucket("agents")
        #: what this replica writes into the sweep lock
        self.holder = bytes(NUID().next())

    async def sweeping(self) -> None:
        """Sweep at once, then every interval, when this replica holds the lock."""
        interval = self.settings.task_sweep_interval
        if not await self.store.wait_in_use(min(interval, 1.0), self.stopping):
            return  # stopped before any task was used: nothing to sweep
        while not self.stopping.is_set():
            try:
                if await self._my_turn(interval):
                    await self.sweep()
                else:
                    self.stats.sweeps_skipped += 1
            except RETRIED as exc:
                self.stats.errors += 1
                log.warning("task recovery: a sweep failed (the next one tries again): %r", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.stopping.wait()

    async def _my_turn(self, interval: float) -> bool:
        """Take (or keep) the sweep lock for one interval; False when another replica
        holds it."""
        ttl = max(interval, _MIN_TTL)
        try:
            await self.store.idem_claim(_LOCK, self.holder, ttl)
            return True
        except Conflict:
            held, rev = await self.store.idem_latest(_LOCK)
        if held != self.holder:
            return False
        try:
            await self.store.idem_renew(_LOCK, self.holder, ttl, rev)
        except Conflict:
            return False
        return True

    async def sweep(self) -> int:
        """One pass over the records; how many tasks it recovered. The non-final ones are
        looked up in the task stream ``_PARALLEL`` at a time; those whose message is gone
        are recovered one by one. Then the CANCELLED ones in their first or last stretch
        (``cancel_finished``), and the messages JetStream gave up on (``find_given_up``)."""
        self.stats.sweeps += 1
        states: dict[str, int] = {}
        ids: list[str] = []  # only the non-final ones: memory does not grow with history
        cancelled: list[str] = []  # only those near their start or their end
        now, window = now_ms(), self._cancel_window_ms()
        retention_ms = self.settings.task_retention * 1000

        def visit(m: RecordMeta) -> None:
            if m.state is not None:
                states[m.state.value] = states.get(m.state.value, 0) + 1
            if not _final(m):
                ids.append(m.task_id)
            elif m.state is S.CANCELLED:
                age = now - m.changed_ms
                if age < window or age > retention_ms - window:
                    cancelled.append(m.task_id)

        await each_record(self.store, visit)
        self.stats.states = states
        gone: list[str] = []
        for i in range(0, len(ids), _PARALLEL):
            batch = ids[i : i + _PARALLEL]
            there = await asyncio.gather(*(self._has_message(t) for t in batch))
            gone += [t for t, yes in zip(batch, there, strict=True) if not yes]
        recovered = 0
        if gone:
            live = await self._live_agents()
            for task_id in gone:
                recovered += await self._check(task_id, live)
        self.stats.tasks_recovered += recovered
        for i in range(0, len(cancelled), _PARALLEL):  # a slow callback holds up no other
            await asyncio.gather(*(self._finish_cancel(t) for t in cancelled[i : i + _PARALLEL]))
        try:
            await self.find_given_up()
        except RETRIED as exc:  # (a user without $JS.API.CONSUMER.LIST on the task stream)
            self.stats.errors += 1
            log.warning("task recovery: given-up messages not looked for: %r", exc)
        try:  # for metrics only: after the recovery, and never in its way
            info = await self.store.js.stream_info(self.store.dlq_stream)
            self.stats.dlq_messages = info.state.messages
            states[S.SCHEDULED.value] = await count_scheduled(self.store)
            self.stats.schedules = await count_schedules(self.store)
        except RETRIED as exc:
            log.debug("task recovery: DLQ size or schedules not read: %r", exc)
        return recovered

    async def _check(self, task_id: str, live: set[str]) -> int:
        try:
            return await self._recover(task_id, live)
        except RETRIED as exc:
            self.stats.errors += 1
            log.warning("task %s: recovery failed (next sweep tries again): %r", task_id, exc)
            return 0

    async def _has_message(self, task_id: str) -> bool:
        """Whether the task stream holds a message of ``task_id`` (its own or one published
        again: any on its subject)."""
        store = self.store
        try:
            await store.js.get_msg(
                store.stream, subject=self.subjects.task_lookup(task_id), direct=True
            )
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def _live_agents(self) -> set[str]:
        """Agent ids that hold a lease now."""
        prefix = f"$KV.{self.agents_bucket}."
        seen = await scan(
            self.store.js, f"KV_{self.agents_bucket}", f"{prefix}>", last_per_subject=True
        )
        return {
            s.subject[len(prefix) :]
            for s in seen
            if KV_OP not in s.headers and MARKER_REASON not in s.headers
        }

    async def _recover(self, task_id: str, live: set[str]) -> int:
        try:
            st = await self.store.get(task_id)
        except CorruptRecord as exc:
            if not await self._has_message(task_id):  # else its next delivery replaces it
                await self._replace_undecodable(exc)
            return 0
        if st is None or st.record.final:
            return 0
        # Final records are written before their message is acked, and a republish writes
        # the record first: a look at the stream after the record settles both.
        if await self._has_message(task_id):
            return 0
        rec = st.record
        if rec.state is S.RUNNING:
            quiet_ms = (self.settings.lease_ttl + self.settings.task_ack_wait) * 1000
            if rec.agent_id in live or now_ms() - rec.updated_ms < quiet_ms:
                return 0  # its agent may still finish it; a later sweep looks again
        if rec.cancel_requested:
            await self._end_cancelled(st)  # published again, it could run once more
            return 0
        return await self._republish(st)

    async def _replace_undecodable(self, exc: CorruptRecord) -> None:
        """A record that does not decode and has no message (nothing will bring an agent
        to it): keep what was stored as a dead letter (reason ``undecodable``), then
        replace it with a FAILED record, compare-and-set on the revision read."""
        raw = await self.store.get_raw(exc.task_id)
        if raw is None or raw[1] != exc.revision:
            return  # changed meanwhile: the next sweep looks again
        await dead_letter(
            self.store,
            capability="",
            task_id=exc.task_id,
            data=raw[0],
            headers={},
            reason=UNDECODABLE,
            error=f"its stored record did not decode ({exc.detail})",
        )
        new = undecodable_record(exc, None, 0, now_ms())
        try:
            await self.store.write(new, exc.revision)
        except Conflict:
            return
        self.stats.undecodable += 1
        log.error("task recovery: %s", exc.message)

    async def _end_cancelled(self, st: Stored) -> None:
        """A task with a cancel asked for, whose agent and message are gone: CANCELLED (its
        attempt lost), rather than published again."""
        rec, at = st.record, now_ms()
        attempts = end_attempt(list(rec.attempts), rec.attempt, at, "lost", "its agent went away")
        new = advance(
            rec,
            [S.CANCELLED],
            at,
            "cancelled",
            attempts=attempts,
            error=ErrorBody(code="cancelled", message="cancelled; its agent went away"),
            callback_state="pending" if rec.callback else "",
        )
        try:
            rev = await self.store.write(new, st.revision)
        except Conflict:
            return  # it changed: the next sweep looks again
        self.stats.cancels_finished += 1
        log.warning("task %s: cancelled, its agent %s gone", rec.task_id, rec.agent_id)
        await self._announce(Stored(new, rev))

    async def _finish_cancel(self, task_id: str) -> None:
        """A CANCELLED task: remove any message of it still in the work queue (a cancel
        cut short between its two steps; a message left there would run the task once the
        record expires), and send its callback if it is still pending."""
        try:
            removed = await remove_messages(self.store, task_id)
            st = await self.store.get(task_id)
            if removed:
                self.stats.cancels_finished += 1
                log.warning("task %s: cancelled, its message still queued: removed", task_id)
            if st is not None and st.record.callback_state == "pending":
                await self._announce(st, notice=False)
        except _FINISH_ERRORS as exc:
            self.stats.errors += 1
            log.warning("task %s: cancel not finished (next sweep tries again): %r", task_id, exc)

    async def _announce(self, st: Stored, *, notice: bool = True) -> None:
        """Tell the submitter of a task a sweep ended (best effort), and deliver its
        callback (recorded as delivered or dead)."""
        rec, nc = st.record, self.nc
        if nc is None:
            return
        if notice and rec.notify:
            try:
                await nc.publish(rec.notify, _encode(rec))
            except TRANSIENT as exc:
                log.debug("task %s: notify: %s", rec.task_id, exc)
        if rec.callback and rec.callback_state == "pending":
            delivered = await send_callback(nc, self.store, rec)
            await set_callback_state(self.store, st, "delivered" if delivered else "dead")

    async def find_given_up(self) -> int:
        """Messages JetStream gave up on (``max_deliver`` reached) whose advisory never
        reached a registry, handled as the advisory would have been; how many.

        JetStream says nothing per message, so this reads each task consumer's state: once
        JetStream gives a message up, it no longer counts it as waiting for an ack, but
        the message stays in the work queue above the ack floor. So when a consumer has no
        message awaiting an ack, every message of its filter between its ack floor and the
        last one it delivered is given up; that is exact, and a consumer with messages in
        flight is looked at again at a later sweep (a quiet moment comes: a given-up
        message stays given up)."""
        if self.given_up is None:
            return 0
        store, found, offset = self.store, 0, 0
        while True:
            page = await store.js.consumers_info(store.stream, offset=offset or None)
            for ci in page:
                cfg = ci.config
                if not cfg.filter_subject or not cfg.max_deliver or cfg.max_deliver < 1:
                    continue
                if ci.num_ack_pending or ci.delivered is None or ci.ack_floor is None:
                    continue  # messages in flight: which of them were given up is unknown
                floor, last = ci.ack_floor.stream_seq or 0, ci.delivered.stream_seq or 0
                while floor < last:
                    try:
                        msg = await store.js.get_msg(
                            store.stream, seq=floor + 1, subject=cfg.filter_subject, next=True
                        )
                    except nats.js.errors.NotFoundError:
                        break
                    floor = int(msg.seq or last)
                    if floor > last:
                        break  # not delivered yet: it waits for an agent
                    self.stats.advisories_missed += 1
                    log.warning("task message %s: given up without an advisory", floor)
                    try:
                        found += int(await self.given_up(floor, cfg.max_deliver))
                    except RETRIED as exc:
                        if not await self._still_there(store, floor):
                            # its advisory came after all, and was handled meanwhile
                            log.debug("task message %s: handled by its advisory", floor)
                            continue
                        self.stats.errors += 1
                        log.warning("task message %s: not handled (next sweep): %r", floor, exc)
            if len(page) < 256:
                return found
            offset += len(page)

    @staticmethod
    async def _still_there(store: TaskStore, seq: int) -> bool:
        try:
            await store.js.get_msg(store.stream, seq=seq)
        except nats.js.errors.NotFoundError:
            return False
        except TRANSIENT:
            return True  # unknown: counted as not handled, the next sweep sees
        return True

    def _cancel_window_ms(self) -> float:
        return max(_CANCEL_WINDOW * self.settings.task_sweep_interval, 60.0) * 1000

    async def _republish(self, st: Stored) -> int:
        """Announce the message in the record (RETRYING, sequence 0), publish it, then
        write its sequence; 1, or 0 when the record changed meanwhile."""
        rec, rev, at = st.record, st.revision, now_ms()
        new = rec
        if rec.state in (S.RUNNING, S.TIMEOUT):
            attempts = end_attempt(
                list(rec.attempts), rec.attempt, at, "lost", "its agent went away"
            )
            new = advance(rec, [S.RETRYING], at, "lost", attempts=attempts, seq=0)
            log.warning("task %s: agent %s is gone, and its message", rec.task_id, rec.agent_id)
        elif rec.seq:
            new = msgspec.structs.replace(rec, seq=0, updated_ms=at)
        if new is not rec:  # (sequence 0 already: an earlier sweep stopped half-way)
            try:
                rev = await self.store.write(new, rev)
            except Conflict:
                return 0  # it changed: the next sweep looks again
        msg_id = f"{rec.task_id}.s{rec.attempt}"
        seq = await publish_task(self.store, submit_of(new), msg_id=msg_id)
        st = Stored(new, rev)
        for _ in range(_TRIES):
            if st.record.final or st.record.seq:
                break  # ended, or another replica wrote the sequence
            try:
                await self.store.write(msgspec.structs.replace(st.record, seq=seq), st.revision)
                break
            except Conflict:
                fresh = await self.store.get(rec.task_id)
                if fresh is None:
                    break
                st = fresh
        log.warning("task %s: its message was gone; published again as %s", rec.task_id, seq)
        return 1


def _final(m: RecordMeta) -> bool:
    return m.state is not None and is_final(m.state)
