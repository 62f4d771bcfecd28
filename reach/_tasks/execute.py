"""One delivery of a task message, from the claim to the ack: the state machine's I/O.

Order matters for "nothing is lost": the record is written before the message is acked,
naked or terminated; a dead letter is published before ``term()``. A worker whose attempt
is no longer the newest (it was stopped, its claim expired, another attempt started) writes
nothing and does not ack: the newer attempt owns the message now.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from .._codec import encode_payload, now_ms
from .._nats import TRANSIENT, NatsConnection
from ..errors import RemoteError
from ..wire import ErrorBody
from ..wire.tasks import TaskAttempt, TaskRecord, TaskState
from .callbacks import deliver_callback
from .dlq import dead_letter
from .model import Delivery, TaskStats, new_record
from .states import advance, can_write, end_attempt, retry_delay
from .store import Conflict, Stored, TaskStore, idem_key

__all__ = ["Executor"]

log = logging.getLogger("reach.tasks")
S = TaskState
_encode = msgspec.json.Encoder().encode


class Executor:
    """Runs deliveries for one agent; shared by all its task capabilities."""

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

    def claim_key(self, d: Delivery) -> str:
        """One claim per idempotency key: two tasks with the same key (a replay, a submit
        after the key's TTL) never run at once."""
        return idem_key("run", d.sub.idempotency_key)

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
        """
        at = now_ms()
        stored = await self.store.get(d.task_id)
        for _ in range(8):
            rec, rev = (
                (stored.record, stored.revision)
                if stored
                else (new_record(d.sub, d.msg.metadata.sequence.stream, at), 0)
            )
            if rec.final:
                d.stored = Stored(rec, rev)
                if rec.state is S.FAILED:  # its dead letter may never have been stored
                    await self._dead_letter(d, rec, rec.error.code if rec.error else "")
                await self.after_final(d, rec)
                self.stats.duplicates += 1
                return False
            if rec.seq and rec.seq != d.msg.metadata.sequence.stream:
                # a second message of a task whose own message is still in the stream
                # (that one comes back if its agent dies): drop this one
                self.stats.duplicates += 1
                await d.msg.ack()
                return False
            if not d.claim_rev and not await self._claim(d):
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
            elif rec.attempt >= max_attempts:
                code = "timeout" if attempts and attempts[-1].outcome == "timeout" else "failed"
                err = ErrorBody(code=code, message=f"no attempts left ({rec.attempt} used)")
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
                stored = await self.store.get(d.task_id)
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

    async def confirm(self, d: Delivery) -> bool:
        """Write RUNNING if it is not written yet; False when another write came first."""
        st = d.stored
        if st is None:
            return False
        if st.revision:
            return True
        try:
            d.stored = Stored(st.record, await self.store.write(st.record, 0))
        except Conflict:
            d.stored = await self.store.get(d.task_id)
            self.stats.fenced += 1
            return False
        return True

    async def _claim(self, d: Delivery) -> bool:
        """Tasks with an idempotency key are claimed in ``reach_idem`` (create with TTL,
        renewed while running). Without a key, JetStream's ack timer is the lease: a
        message comes back only after its holder sent no ``in_progress`` for ack_wait,
        and the attempt number fences the holder if it wakes up."""
        if not d.sub.idempotency_key:
            return True
        value = f"{self.agent_id} {d.msg.metadata.num_delivered}".encode()
        try:
            d.claim_rev = await self.store.idem_claim(
                self.claim_key(d), value, self.settings.task_ack_wait
            )
        except Conflict:
            self.stats.claim_busy += 1
            await self._put_back(d, self.settings.task_ack_wait / 3)
            return False
        return True

    async def renew(self, d: Delivery) -> bool:
        """Extend our claim and the message's ack timer; False when we lost the claim."""
        try:
            await d.msg.in_progress()
        except TRANSIENT as exc:
            log.debug("task %s: in_progress: %s", d.task_id, exc)
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

    # -- writes while and after running ------------------------------------------------

    async def fenced(self, d: Delivery) -> None:
        """Our attempt lost the record. If the task has ended (a cancel, another agent
        finished it), clear its message; if a newer attempt runs it, leave the message to
        that attempt."""
        st = d.stored if d.stored and d.stored.revision else await self.store.get(d.task_id)
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
            new = advance(st.record, states, now_ms(), note, **changes)
            try:
                d.stored = Stored(new, await self.store.write(new, st.revision))
                return new
            except Conflict:
                d.stored = await self.store.get(d.task_id)
        if finishing:
            await self.fenced(d)
        return None

    async def progress(self, d: Delivery, fraction: float, note: str) -> None:
        await self.commit(d, [], progress=fraction, progress_note=note)

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
                return await self.settle(d, "failed", exc=e)
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
        error = _error_body(exc, outcome)
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
        if retry and d.n < st.record.max_attempts:
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

    async def release(self, d: Delivery) -> None:
        """Give our claim up (compare-and-set: a newer holder's claim stays)."""
        if d.claim_rev:
            rev, d.claim_rev = d.claim_rev, 0
            try:
                await self.store.idem_delete(self.claim_key(d), rev)
            except Conflict:
                pass  # a newer holder's claim: theirs to release
            except TRANSIENT as exc:
                log.debug("task %s: claim release: %s", d.task_id, exc)

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
        try:
            await d.msg.nak(delay=delay if delay > 0 else None)
        except TRANSIENT as exc:
            log.debug("task %s: nak: %s", d.task_id, exc)


def _error_body(exc: Any, outcome: str) -> ErrorBody:
    if outcome == "timeout":
        return ErrorBody(code="timeout", message="the task overran its timeout", retryable=True)
    if outcome == "cancelled":
        return ErrorBody(code="cancelled", message="cancelled")
    if isinstance(exc, RemoteError):
        return ErrorBody(code=exc.code, message=exc.message[:500], retryable=exc.retryable)
    if isinstance(exc, BaseException):
        return ErrorBody(code="failed", message=f"{type(exc).__name__}: {exc}"[:500])
    return ErrorBody(code="failed", message=str(exc or outcome)[:500])
