"""One delivery of a task message, from the claim to the ack: the state machine's I/O.

Order matters for "nothing is lost": the record is written before the message is acked,
naked or terminated; a dead letter is published before ``term()``. A worker whose attempt
is no longer the newest (it was stopped, its claim expired, another attempt started) writes
nothing and does not ack: the newer attempt owns the message now.

Putting a message back (``hand_back``: a retry, a busy claim, a task for another instance,
a drain) must not spend the task's deliveries, which JetStream counts toward
``max_deliver`` whatever the reason: on the last one the task goes back as a new message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.msg import Msg

from .._codec import encode_payload, now_ms
from .._nats import TRANSIENT, NatsConnection, jetstream_unready
from ..errors import CorruptRecord, RemoteError, Unauthorized
from ..wire import ErrorBody
from ..wire.tasks import TaskAttempt, TaskRecord, TaskState, TaskSubmit
from .callbacks import deliver_callback
from .dlq import TASK_ID, dead_letter
from .model import Delivery, TaskStats
from .states import (
    IllegalTransition,
    advance,
    attempts_used,
    can_write,
    end_attempt,
    error_body,
    retry_delay,
)
from .store import (
    UNDECODABLE,
    Conflict,
    Stored,
    TaskStore,
    idem_key,
    pending_record,
    undecodable_record,
)

__all__ = ["Executor", "republish"]

log = logging.getLogger("reach.tasks")
_RECORD_OVERHEAD = 8192  # bytes of a record besides its payload and result (history...)
#: seconds an attempt's end is written again while JetStream cannot answer (the records
#: bucket between leaders); the message stays held (in_progress) meanwhile
_END_PATIENCE = 30.0
_END_PAUSE = 0.25, 2.0  # first and longest pause between those writes
#: on a task put back as a new message: the stream sequence of the message it replaces
REQUEUED_FROM = "Reach-Requeued-From"
#: what putting a message back may raise (a refused publish: permissions without the
#: agent's task subjects): logged, as the message then comes back or reaches max deliveries
_NOT_PUT_BACK: tuple[type[BaseException], ...] = (
    *TRANSIENT,
    Unauthorized,
    nats.js.errors.APIError,
)
S = TaskState
_encode = msgspec.json.Encoder().encode


class Executor:
    """Runs deliveries for one agent; shared by all its task capabilities.

    A task with an idempotency key is claimed in ``reach_idem`` while it runs, so two tasks
    with one key never run at once, and a crashed agent's claim expires (TTL ack_wait)."""

    def __init__(
        self,
        agent_id: str,
        nc: NatsConnection,
        store: TaskStore,
        stats: TaskStats,
    ) -> None:
        self.agent_id = agent_id
        self.nc = nc
        self.store = store
        self.settings = store.settings
        self.stats = stats

    # -- before the handler ------------------------------------------------------------

    async def begin(self, d: Delivery, *, early: bool = False) -> bool:
        """Claim the task and write RUNNING; False when there is nothing to run (final,
        cancelled, claimed by a live agent, out of attempts): the message is handled.

        ``early``: for a task no agent has taken yet (no record; claimed if it has a key),
        RUNNING is not written yet: the handler starts at once and ``confirm`` writes
        RUNNING if it is still running after a moment; a task done by then is recorded
        in one write (its history still says PENDING, RUNNING, SUCCEEDED). Any write of
        this attempt creates the record, so if another wrote first (a cancel, a newer
        attempt) ours fails and the attempt is fenced.

        A first delivery of a task with an idempotency key claims the key while its record
        is read: one round trip before the handler, not two. The decisions are taken in
        the same order as ever (the record first); a claim taken for a delivery that then
        runs nothing (its task has ended: almost never on a first delivery) is given back.
        """
        try:
            ran = await self._begin(d, early)
        except Exception:
            await self.release(d)  # a claim taken for a run that does not start
            raise
        if not ran:
            await self.release(d)  # likewise (a no-op when none is held)
        return ran

    async def _begin(self, d: Delivery, early: bool) -> bool:
        at = now_ms()
        #: the claim taken beside the read: None when there was none, else its outcome
        ahead: bool | BaseException | None = None
        try:
            if d.sub.idempotency_key and d.msg.metadata.num_delivered == 1:
                stored, ahead = await self._read_claiming(d)
            else:
                stored = await self.store.get(d.task_id)
        except CorruptRecord as exc:
            return await self.replace_undecodable(d, exc)
        for _ in range(8):
            rec, rev = (
                (stored.record, stored.revision)
                if stored
                else (pending_record(d.sub, d.msg.metadata.sequence.stream, at), 0)
            )
            if rec.final:
                d.stored = Stored(rec, rev)
                if rec.state is S.FAILED:  # its dead letter may never have been stored
                    await self._dead_letter(d, rec, rec.error.code if rec.error else "")
                await self.after_final(d, rec)
                self.stats.duplicates += 1
                return False
            seq = d.msg.metadata.sequence.stream
            if await self._retry_waits(d, rec, seq):
                # the message a retry later replaced, back because its ack was lost: the
                # retry's schedule holds the task until its due time
                self.stats.duplicates += 1
                await d.msg.ack()
                return False
            if rec.seq and rec.seq != seq:
                adopted = rec.seq == requeued_from(d.msg)
                if not adopted and await self.store.message_exists(rec.seq):
                    # a second message of a task whose own message is still in the
                    # stream (that one comes back if its agent dies): drop this one
                    self.stats.duplicates += 1
                    await d.msg.ack()
                    return False
                if adopted and rec.state is S.RUNNING and await self.store.message_exists(rec.seq):
                    # the message we replace is held by a running attempt (its ack was
                    # lost and it came back): never end that attempt as lost; if its
                    # agent dies, that message comes back and ends it
                    await self._put_back(d, self.settings.task_ack_wait / 3)
                    return False
                rec = msgspec.structs.replace(rec, seq=seq)  # a republished message: ours
            if not d.claim_rev:
                got = await self._claim(d) if ahead is None else ahead
                ahead = None  # a later turn (the record changed) claims afresh
                if isinstance(got, BaseException):
                    raise got  # as the claim would have raised here
                if not got:
                    self.stats.claim_busy += 1
                    await self._put_back(d, self.settings.task_ack_wait / 3)
                    return False
            at = now_ms()
            steps: list[TaskState] = []
            attempts = list(rec.attempts)
            if rec.state in (S.RUNNING, S.TIMEOUT):
                # a previous attempt whose agent stopped renewing its claim: lost
                attempts = end_attempt(attempts, rec.attempt, at, "lost", "its agent went away")
                steps.append(S.RETRYING)
            # the agent's defaults, for a submit that named none
            max_attempts = rec.max_attempts or d.sub.max_attempts
            if rec.cancel_requested:
                new = advance(rec, [*steps, S.CANCELLED], at, "cancelled", attempts=attempts)
            elif (used := attempts_used(attempts)) >= max_attempts:
                code = "timeout" if attempts and attempts[-1].outcome == "timeout" else "failed"
                err = ErrorBody(code=code, message=f"no attempts left ({used} used)")
                new = advance(rec, [*steps, S.FAILED], at, "attempts exhausted", attempts=attempts)
                new = msgspec.structs.replace(new, error=err)
            else:
                d.n = rec.attempt + 1
                d.attempt = TaskAttempt(n=d.n, agent_id=self.agent_id, started_ms=at)
                attempts.append(d.attempt)
                new = advance(
                    rec,
                    [*steps, S.RUNNING],
                    at,
                    attempt=d.n,
                    agent_id=self.agent_id,
                    attempts=attempts,
                    progress=0.0,
                    progress_note="",
                    max_attempts=max_attempts,
                    timeout=rec.timeout or d.sub.timeout,
                )
            if early and rev == 0 and new.state is S.RUNNING:
                d.stored = Stored(new, 0)  # not written: the first write creates it
                return True
            try:
                d.stored = Stored(new, await self.store.write(new, rev))
            except Conflict:
                try:
                    stored = await self.store.get(d.task_id)
                except CorruptRecord as exc:
                    return await self.replace_undecodable(d, exc)
                d.n = 0
                continue
            if new.final:
                await self.finished(d, new, reason="attempts exhausted")
                return False
            return True
        log.warning("task %s: record kept changing; trying again later", d.task_id)
        await self.release(d)
        await self._put_back(d, 1.0)
        return False

    async def _retry_waits(self, d: Delivery, rec: TaskRecord, seq: int) -> bool:
        """Whether ``rec`` waits for a retry later whose schedule (not message ``seq``) the
        stream still holds: then message ``seq`` is one the retry replaced."""
        if rec.state is not S.RETRYING or rec.due_ms <= now_ms():
            return False
        subject = self.store.subjects.task_at(d.task_id, d.sub.capability)
        waiting = await self.store.last_on(subject)
        return waiting is not None and waiting.seq != seq

    async def confirm(self, d: Delivery, *, count: bool = True) -> bool:
        """Write RUNNING if it is not written yet; False when another write came first.

        A write the server did not answer leaves the attempt running, unconfirmed: its
        handler stays under our lease, timeout and cancel, and the end of the attempt
        writes the record (creating it, or over our RUNNING if that landed after all)."""
        st = d.stored
        if st is None:
            return False
        if st.revision:
            return True
        try:
            d.stored = Stored(st.record, await self.store.write(st.record, 0))
        except Conflict:
            d.stored = await self._reread(d)
            if count:  # not when the lease loop retries: the attempt's end may have won
                self.stats.fenced += 1
            return False
        except TRANSIENT as exc:
            d.unconfirmed = True  # the lease loop reads the record and adopts or fences it
            log.warning("task %s: RUNNING not recorded (%s); recorded at its end", d.task_id, exc)
        return True

    async def replace_undecodable(self, d: Delivery, exc: CorruptRecord) -> bool:
        """The task's record does not decode (junk, or a state a newer version wrote):
        replace it with a FAILED record made from the message (compare-and-set on the
        revision read), then dead-letter the message with reason ``undecodable`` and clear
        it, as for any failed task (a redelivery after a crash finds it FAILED and finishes
        that). A record written meanwhile stands: the message is put back to be looked at
        again. False: nothing to run."""
        new = undecodable_record(exc, d.sub, d.msg.metadata.sequence.stream, now_ms())
        if new.callback:
            new = msgspec.structs.replace(new, callback_state="pending")
        try:
            d.stored = Stored(new, await self.store.write(new, exc.revision))
        except Conflict:
            await self.release(d)
            await self._put_back(d, 0)
            return False
        self.stats.undecodable += 1
        log.error("agent %s: %s", self.agent_id, exc.message)
        await self.finished(d, new, reason=UNDECODABLE)
        return False

    async def _reread(self, d: Delivery) -> Stored | None:
        """The record as it is now, for an attempt whose write was refused. One that does
        not decode reads as none, which fences the attempt: the message is not acked, and
        its next delivery replaces the record (``replace_undecodable``)."""
        try:
            return await self.store.get(d.task_id)
        except CorruptRecord as exc:
            log.error("agent %s: attempt %s stopped: %s", self.agent_id, d.n, exc.message)
            return None

    async def keep_record(self, d: Delivery) -> None:
        """Write our RUNNING record again once half the retention has passed since its
        last write: a record's TTL runs from its last write, and a run may outlast it (a
        timeout near the retention, a submitter with a longer retention than ours, a
        handler slow to stop). Without it the record would expire mid-run, the run be
        fenced, and the task start over at attempt 1. Costs no write in a run shorter than
        half the retention (12 h by default)."""
        st = d.stored
        if st is None or not st.revision or not can_write(st.record, d.n, self.agent_id):
            return
        if now_ms() - st.record.updated_ms < self.settings.task_retention * 500:
            return
        new = msgspec.structs.replace(st.record, updated_ms=now_ms())
        try:
            d.stored = Stored(new, await self.store.write(new, st.revision))
        except Conflict:
            pass  # written meanwhile (the attempt's end, progress): the next check looks
        except TRANSIENT as exc:
            log.debug("task %s: record not renewed (%s); tried again later", d.task_id, exc)

    # -- claims ------------------------------------------------------------------------

    def claim_key(self, d: Delivery) -> str:
        """One claim per idempotency key: two tasks with the same key (a replay, a submit
        after the key's TTL) never run at once."""
        return idem_key("run", d.sub.idempotency_key)

    async def _claim(self, d: Delivery) -> bool:
        """Tasks with an idempotency key are claimed in ``reach_idem`` (create with TTL,
        renewed while running); False when another holds the claim. Without a key,
        JetStream's ack timer is the lease: a message comes back only after its holder sent
        no ``in_progress`` for ack_wait, and the attempt number fences the holder if it
        wakes up."""
        if not d.sub.idempotency_key:
            return True
        value = f"{self.agent_id} {d.msg.metadata.num_delivered}".encode()
        try:
            d.claim_rev = await self.store.idem_claim(
                self.claim_key(d), value, self.settings.task_ack_wait
            )
        except Conflict:
            return False
        return True

    async def _read_claiming(self, d: Delivery) -> tuple[Stored | None, bool | BaseException]:
        """The record (raised: what reading it raised) and, at the same time, the claim
        (its outcome, or what it raised: the caller raises that where it would have
        claimed). Both have ended when this returns, so the claim is known to be held
        (``d.claim_rev``) or not before anything is decided."""
        read, claimed = await asyncio.gather(
            self.store.get(d.task_id), self._claim(d), return_exceptions=True
        )
        if isinstance(read, BaseException):
            raise read
        return read, claimed

    async def renew(self, d: Delivery) -> bool:
        """Extend our claim (the ack timer is reset by the lease loop); False when we lost
        the claim."""
        if not d.claim_rev:
            return True
        value = f"{self.agent_id} {d.n}".encode()
        try:
            d.claim_rev = await self.store.idem_renew(
                self.claim_key(d), value, self.settings.task_ack_wait, d.claim_rev
            )
        except Conflict:
            return False
        except TRANSIENT as exc:
            log.debug("task %s: claim renewal: %s", d.task_id, exc)
        return True

    async def release(self, d: Delivery) -> None:
        """Give our claim up (compare-and-set: a newer holder's claim stays); not while
        the handler runs on (``d.abandoned``): the runner releases it when it has returned."""
        if d.claim_rev and not d.abandoned:
            rev, d.claim_rev = d.claim_rev, 0
            try:
                await self.store.idem_delete(self.claim_key(d), rev)
            except Conflict:
                pass  # a newer holder's claim: theirs to release
            except TRANSIENT as exc:
                log.debug("task %s: claim release: %s", d.task_id, exc)

    # -- writes while and after running ------------------------------------------------

    async def fenced(self, d: Delivery) -> None:
        """Our attempt lost the record. If the task has ended (a cancel, another agent
        finished it), clear its message; if a newer attempt runs it, leave the message to
        that attempt."""
        st = d.stored if d.stored and d.stored.revision else await self._reread(d)
        if st is not None and st.record.final:
            rec = await self._note_cancelled_run(d, st)
            await self.after_final(d, rec)

    async def _note_cancelled_run(self, d: Delivery, st: Stored) -> TaskRecord:
        """A cancel that found the task PENDING while our attempt had just started (its
        RUNNING not written yet) stopped our handler: add that run to the record, so it
        says what happened."""
        rec, mine = st.record, d.attempt
        if rec.state is not S.CANCELLED or mine is None or any(a.n == mine.n for a in rec.attempts):
            return rec
        ran = msgspec.structs.replace(mine, ended_ms=now_ms(), outcome="cancelled")
        new = msgspec.structs.replace(
            rec,
            attempts=[*rec.attempts, ran],
            attempt=max(rec.attempt, mine.n),
            agent_id=self.agent_id,
            error=ErrorBody(code="cancelled", message="cancelled while it ran"),
        )
        try:
            await self.store.write(new, st.revision)
        except Conflict:
            return rec
        self.stats.cancelled += 1
        return new

    async def commit(
        self,
        d: Delivery,
        states: list[TaskState],
        note: str = "",
        *,
        finishing: bool = False,
        **changes: Any,
    ) -> TaskRecord | None:
        """Write the next record of our attempt; None when fenced (a newer attempt owns
        the task, or it is final): then we write nothing and must not ack (``finishing``:
        clear the message if the task has ended anyway)."""
        for _ in range(8):
            st = d.stored
            if st is None or not can_write(st.record, d.n, self.agent_id):
                if st is None or st.record.state is not S.CANCELLED or d.stop_reason != "cancelled":
                    self.stats.fenced += 1  # a stale worker, not one a cancel stopped
                    log.info("task %s: attempt %s is no longer current", d.task_id, d.n)
                break
            try:
                new = advance(st.record, states, now_ms(), note, **changes)
            except IllegalTransition as exc:  # a bug of ours: never let it strand the message
                log.error("task %s: %s; treated as fenced", d.task_id, exc)
                break
            try:
                if finishing:
                    rev = await self._write_end(d, new, st.revision)
                else:
                    rev = await self.store.write(new, st.revision)
                d.stored = Stored(new, rev)
                return new
            except Conflict:
                d.stored = await self._reread(d)
        if finishing:
            await self.fenced(d)
        return None

    async def _write_end(self, d: Delivery, new: TaskRecord, revision: int) -> int:
        """Write how an attempt ended, again while JetStream cannot answer (no responders,
        a timeout: the records bucket between leaders), for up to ``_END_PATIENCE``. The
        delivery stays in ``running`` meanwhile, so the lease loop keeps its message
        (``in_progress``): giving up at once would drop the run's result and let the message
        come back after ack_wait to run the task again. A write that landed although its
        answer was lost makes the next one a ``Conflict``: the caller rereads, finds the
        record ended by this attempt, and settles the message as for any fence."""
        until = time.monotonic() + _END_PATIENCE
        pause = _END_PAUSE[0]
        while True:
            try:
                return await self.store.write(new, revision)
            except TRANSIENT as exc:
                if not jetstream_unready(exc) or time.monotonic() + pause > until:
                    raise
                log.warning(
                    "task %s: the end of attempt %s not recorded (%r); trying again",
                    d.task_id,
                    d.n,
                    exc,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _END_PAUSE[1])

    async def progress(self, d: Delivery, fraction: float, note: str) -> None:
        """Best effort: a progress note that cannot be written (the server is away) is
        logged, never raised into the handler; the task goes on."""
        try:
            await self.commit(d, [], progress=fraction, progress_note=note)
        except TRANSIENT as exc:
            log.warning("task %s: progress not recorded: %s", d.task_id, exc)

    async def settle(self, d: Delivery, outcome: str, value: Any = None, exc: Any = None) -> None:
        """Record how our attempt ended, then ack, retry or dead-letter the message."""
        st = d.stored
        if st is None:
            return
        at = now_ms()
        if outcome == "succeeded":
            try:
                result = encode_payload(value)
            except TypeError as e:
                log.error(
                    "agent %s: task %s (%s): its result cannot be encoded",
                    self.agent_id,
                    d.task_id,
                    d.sub.capability,
                    exc_info=e,
                )
                return await self.settle(d, "failed", exc=e)
            room = self.nc.max_payload - _RECORD_OVERHEAD - len(st.record.payload) * 4 // 3
            if len(result) * 4 // 3 > room:
                too_big = RemoteError(
                    f"the result ({len(result)} bytes) does not fit in the task record"
                    f" (about {max(0, room) * 3 // 4} bytes left of the server's max_payload)"
                )
                return await self.settle(d, "failed", exc=too_big)
            attempts = end_attempt(st.record.attempts, d.n, at, "succeeded")
            rec = await self.commit(
                d,
                [S.SUCCEEDED],
                finishing=True,
                attempts=attempts,
                result=result,
                progress=1.0,
                callback_state="pending" if st.record.callback else "",
            )
            if rec is not None:
                self.stats.succeeded += 1
                await self.finished(d, rec)
            return
        error = error_body(exc, outcome)
        attempts = end_attempt(st.record.attempts, d.n, at, outcome, error.message)
        if outcome == "cancelled":
            rec = await self.commit(
                d, [S.CANCELLED], finishing=True, attempts=attempts, error=error
            )
            if rec is not None:
                self.stats.cancelled += 1
                await self.finished(d, rec)
            return
        if outcome == "drained":
            rec = await self.commit(d, [S.RETRYING], "drained", finishing=True, attempts=attempts)
            if rec is not None:
                self.stats.drained += 1
                await self.release(d)
                await self._put_back(d, 0)
            return
        retry = outcome == "timeout" or (error.retryable and outcome == "failed")
        first = [S.TIMEOUT] if outcome == "timeout" else []
        if retry and attempts_used(attempts) < st.record.max_attempts:
            rec = await self.commit(
                d, [*first, S.RETRYING], finishing=True, attempts=attempts, error=error
            )
            if rec is not None:
                self.stats.retried += 1
                s = self.settings
                await self.release(d)
                await self._put_back(d, retry_delay(d.n, s.task_retry_base, s.task_retry_cap))
            return
        rec = await self.commit(
            d,
            [*first, S.FAILED],
            finishing=True,
            attempts=attempts,
            error=error,
            callback_state="pending" if st.record.callback else "",
        )
        if rec is not None:
            await self.finished(d, rec, reason=error.code)

    async def finished(self, d: Delivery, rec: TaskRecord, reason: str = "") -> None:
        """A final record is written: dead-letter a failure, tell the submitter, deliver
        the callback, then remove the message and release our claim."""
        if rec.state is S.FAILED:
            self.stats.failed += 1
            await self._dead_letter(d, rec, reason)
        await self.after_final(d, rec)
        if rec.state is not S.SUCCEEDED:
            await self.release(d)  # a success's claim just expires: one write less

    async def _dead_letter(self, d: Delivery, rec: TaskRecord, reason: str) -> None:
        """Store the dead letter of a FAILED task (again, on a redelivery: its Nats-Msg-Id
        is the same, so the stream keeps one copy)."""
        await dead_letter(
            self.store,
            capability=rec.capability,
            task_id=rec.task_id,
            data=d.msg.data,
            headers=d.msg.headers,
            reason=reason or "failed",
            error=rec.error.message if rec.error else "",
            attempts=rec.attempts,
        )
        self.stats.dead_lettered += 1

    async def invalid(self, msg: Msg, cap: str, reason: str, sub: TaskSubmit | None = None) -> None:
        """A message no agent can run: to the DLQ with the reason, then out of the stream.
        One that decodes gets its FAILED record too, so its id never reads as unknown."""
        self.stats.invalid += 1
        if sub is not None:
            await self.reject(msg, sub, reason)
        log.warning(
            "agent %s: a task message on %s no agent can run: %s", self.agent_id, cap, reason
        )
        await dead_letter(
            self.store,
            capability=cap,
            task_id=(msg.headers or {}).get("Reach-Task-Id", ""),
            data=msg.data,
            headers=msg.headers,
            reason="bad_request",
            error=reason,
            seq=msg.metadata.sequence.stream,
        )
        self.stats.dead_lettered += 1
        await msg.term()

    async def reject(self, msg: Msg, sub: TaskSubmit, reason: str) -> None:
        """Record a message no agent can run as FAILED (``bad_request``), unless the task
        has a record already; the caller dead-letters and terminates the message."""
        at = now_ms()
        rec = pending_record(sub, msg.metadata.sequence.stream, at)
        err = ErrorBody(code="bad_request", message=reason[:500])
        failed = advance(rec, [S.FAILED], at, "rejected", error=err)
        with contextlib.suppress(Conflict):  # it has a record: whatever it says stands
            await self.store.write(failed, 0)

    async def after_final(self, d: Delivery, rec: TaskRecord) -> None:
        """Tell the submitter, deliver the callback, then ack (or term a failure, whose
        dead letter is stored)."""
        if rec.notify:
            try:
                await self.nc.publish(rec.notify, _encode(rec))
            except TRANSIENT as exc:
                log.debug("task %s: notify: %s", d.task_id, exc)
        if rec.callback and rec.callback_state == "pending":
            await deliver_callback(self.nc, self.store, self.stats, d, rec)
        if rec.state is S.FAILED:
            await d.msg.term()  # the dead letter is stored
        else:
            await d.msg.ack()

    async def _put_back(self, d: Delivery, delay: float) -> None:
        await self.hand_back(d.msg, delay)

    async def hand_back(self, msg: Msg, delay: float = 0.0) -> None:
        """Put a message back for another delivery, after ``delay`` seconds: a nak while
        the message has deliveries left after this one. On its last (``max_deliver``) the
        task goes back as a new message instead, whose count starts over, and then the old
        one is acked: waiting for the right instance, a claim or the end of a drain never
        dead-letters a task (a new message cannot wait out ``delay``: the next taker backs
        off again)."""
        self.stats.handed_back += 1
        last = msg.metadata.num_delivered >= self.settings.task_max_deliver
        try:
            if not last:
                await msg.nak(delay=delay if delay > 0 else None)
            else:
                await self._requeue(msg)
        except _NOT_PUT_BACK as exc:
            seq = msg.metadata.sequence.stream
            if last:  # JetStream delivers it no more: max deliveries dead-letters it
                log.error(
                    "task message %s on its last delivery not put back as a new message"
                    " (the agent must be allowed to publish on its task subjects): %s",
                    seq,
                    exc,
                )
            else:
                log.debug("task message %s: nak: %s (it comes back after ack_wait)", seq, exc)

    async def _requeue(self, msg: Msg) -> None:
        """Publish the task again as it is, then ack the old message (``republish``).
        The new one is first, so a crash between the two leaves two messages of one
        task (``begin`` drops the second), never none."""
        await republish(self.store, msg, msg.subject, "q")
        self.stats.requeued += 1


async def republish(
    store: TaskStore, msg: Msg, subject: str, tag: str, extra: dict[str, str] | None = None
) -> None:
    """The one way a task's message is put back as a new one (a hand back on the last
    delivery, tag ``q``; a retry later's schedule, tag ``l`` with its schedule headers in
    ``extra``): publish its body and headers (less ``Nats-*``) on ``subject`` with
    ``Nats-Msg-Id`` ``<task_id>.<tag><old sequence>`` (a second try is one message) and
    ``Reach-Requeued-From`` (a record naming the old message does not make ``begin`` drop
    the new one as a duplicate while the old one is still there), then ack the old one,
    confirmed: one left unacked would come back, or reach max deliveries and fail the
    task; failing that it is deleted. Raises what the publish raises (nothing was put
    back then)."""
    seq = msg.metadata.sequence.stream
    headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
    headers.update(extra or {})
    headers["Nats-Msg-Id"] = f"{headers.get(TASK_ID) or 'task'}.{tag}{seq}"
    headers[REQUEUED_FROM] = str(seq)
    await store.publish(subject, msg.data, headers)
    try:
        await msg.ack_sync()
    except TRANSIENT as exc:  # the ack may be lost: make sure the old one is gone
        log.debug("task message %s put back as a new one: ack: %s", seq, exc)
        with contextlib.suppress(nats.js.errors.NotFoundError, *TRANSIENT):
            await store.js.delete_msg(store.stream, seq)


def requeued_from(msg: Msg) -> int:
    """The stream sequence of the message ``msg`` replaces (``hand_back``); 0: none."""
    try:
        return int((msg.headers or {}).get(REQUEUED_FROM, 0))
    except ValueError:
        return 0
