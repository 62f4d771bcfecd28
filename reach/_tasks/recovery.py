"""Recovery of tasks that nobody would finish; run by registries (``TaskRecovery``).

Two safety nets under the agents' own retries:

- **Max deliveries.** A message delivered ``task_max_deliver`` times without an ack stays in
  the work-queue stream, never delivered again, and the server announces it on
  ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>``. One listener of a
  queue group (one registry of several) takes each: the record becomes FAILED (unless it is
  final), the message becomes a dead letter (reason ``max_deliveries``), and only then is
  it deleted from the task stream.
- **The sweep**, every ``task_sweep_interval`` seconds. A RUNNING record whose agent has no
  lease in the agents bucket, unchanged for ``lease_ttl + task_ack_wait``, goes to RETRYING
  (its attempt "lost"): its agent died without a trace. A record that is not final and
  whose message is gone from the task stream (lost with a store, deleted by hand) gets its
  message back, rebuilt from the record, and the new sequence is written into the record.

Every write is a compare-and-set, so any number of registries may run this at once; the
republished message's ``Nats-Msg-Id`` (``<task_id>.s<attempt>``) makes their republishes
one message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .._codec import now_ms
from .._kv.leases import KV_OP, MARKER_REASON
from .._nats import TRANSIENT, NatsConnection
from .._owner import TaskOwner
from .._subjects import Subjects
from ..settings import ReachSettings
from ..wire import ErrorBody
from ..wire.tasks import TaskRecord, TaskState, TaskSubmit
from .admin import RecordMeta, record_index, scan
from .dlq import TASK_ID, dead_letter
from .states import IllegalTransition, advance, end_attempt, is_final
from .store import Conflict, Stored, TaskStore, pending_record
from .submit import publish_task

__all__ = ["RecoveryStats", "TaskRecovery", "submit_of"]

log = logging.getLogger("reach.tasks")
S = TaskState
_submit_decoder = msgspec.json.Decoder(TaskSubmit)
_encode = msgspec.json.Encoder().encode
_MAX_DELIVERIES = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"
_QUEUE = "task-recovery"
_TRIES = 8
_PARALLEL = 32
#: what a failed advisory or record recovery may raise: counted, logged, tried again later
_RETRIED: tuple[type[BaseException], ...] = (*TRANSIENT, Conflict, IllegalTransition)


@dataclass(slots=True)
class RecoveryStats:
    """What the recovery did (copied into ``RegistryStats``)."""

    sweeps: int = 0
    #: RUNNING tasks of lost agents returned to RETRYING, and tasks whose message was
    #: published again
    tasks_recovered: int = 0
    #: messages that reached max deliveries and were moved to the DLQ
    max_deliveries: int = 0
    #: advisories or records that could not be handled (logged; tried again later)
    errors: int = 0


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


class TaskRecovery:
    """The max-deliveries listener and the sweep for one subject prefix, on ``nc``; its
    loops live in ``owner``."""

    def __init__(
        self,
        nc: NatsConnection,
        settings: ReachSettings,
        subjects: Subjects,
        owner: TaskOwner,
        stats: RecoveryStats | None = None,
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = subjects
        self.owner = owner
        self.stats = stats if stats is not None else RecoveryStats()
        self.store = TaskStore(nc.jetstream(), subjects, settings)
        self.agents_bucket = subjects.bucket("agents")
        self._sub: Subscription | None = None

    async def start(self) -> Subscription:
        """Listen for max-deliveries advisories (queue group: one replica takes each) and
        start the sweep; the advisory subscription, which the caller flushes and, at a
        stop, drains (so an advisory being handled is finished, not cut in half)."""
        subject = f"{_MAX_DELIVERIES}.{self.store.stream}.>"
        self._sub = await self.nc.subscribe(subject, queue=_QUEUE, cb=self._on_advisory)
        if self.settings.task_sweep_interval > 0:
            self.owner.keep(self._sweeping, "tasks: sweep")
        return self._sub

    async def stop(self) -> None:
        """Drain the advisory subscription (the owner's close ends the sweep)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.drain()  # type: ignore[no-untyped-call]
            except TRANSIENT as exc:
                log.debug("task recovery: drain: %s", exc)

    # -- max deliveries ------------------------------------------------------------------

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            await self.on_max_deliveries(msg.data)
        except _RETRIED as exc:
            self.stats.errors += 1
            log.warning("task recovery: a max-deliveries advisory failed: %r", exc)
        except Exception:
            self.stats.errors += 1
            log.exception("task recovery: a bug handling a max-deliveries advisory")

    async def on_max_deliveries(self, data: bytes) -> bool:
        """Handle one advisory; True when this call removed the message (after its dead
        letter was stored), so replicas racing on one message count it once."""
        try:
            advisory: dict[str, Any] = json.loads(data)
            seq = int(advisory["stream_seq"])
            deliveries = int(advisory.get("deliveries", 0))
        except (ValueError, KeyError, TypeError) as exc:
            self.stats.errors += 1
            log.warning("task recovery: an advisory that does not parse: %s", exc)
            return False
        store = self.store
        try:
            msg = await store.js.get_msg(store.stream, seq=seq)
        except nats.js.errors.NotFoundError:
            return False  # acked late, or another replica handled it
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
        rec = await self._fail(task_id, sub, seq) if task_id else None
        if rec is None or rec.state is S.FAILED:
            await dead_letter(
                store,
                capability=capability,
                task_id=task_id,
                data=data,
                headers=headers,
                reason="max_deliveries",
                error=f"delivered {deliveries} times without being acknowledged",
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

    async def _fail(self, task_id: str, sub: TaskSubmit | None, seq: int) -> TaskRecord | None:
        """Mark the task FAILED unless it is final; the record as it ends, None if none.
        A task no agent ever took has no record yet: it is made from its message."""
        for _ in range(_TRIES):
            st = await self.store.get(task_id)
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

    # -- the sweep -----------------------------------------------------------------------

    async def _sweeping(self) -> None:
        while True:
            await asyncio.sleep(self.settings.task_sweep_interval)
            await self.sweep()

    async def sweep(self) -> int:
        """One pass over the records; how many tasks it recovered. Records are checked
        ``_PARALLEL`` at a time (two reads each: the record, and its message)."""
        self.stats.sweeps += 1
        metas = [m for m in await record_index(self.store) if not _final(m)]
        needs_leases = any(m.state in (S.RUNNING, None) for m in metas)
        live = await self._live_agents() if needs_leases else set()
        recovered = 0
        for i in range(0, len(metas), _PARALLEL):
            batch = metas[i : i + _PARALLEL]
            recovered += sum(await asyncio.gather(*(self._check(m, live) for m in batch)))
        self.stats.tasks_recovered += recovered
        return recovered

    async def _check(self, m: RecordMeta, live: set[str]) -> int:
        try:
            return await self._recover(m, live)
        except _RETRIED as exc:
            self.stats.errors += 1
            log.warning("task %s: recovery failed (next sweep tries again): %r", m.task_id, exc)
            return 0

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

    async def _recover(self, m: RecordMeta, live: set[str]) -> int:
        st = await self.store.get(m.task_id)
        if st is None or st.record.final:
            return 0
        done = 0
        if st.record.state is S.RUNNING and st.record.agent_id not in live:
            lost = await self._lost(st)
            if lost is not None:
                st, done = lost, 1
        gone = await self._message_gone(st)
        if gone is None:
            return done
        await self._republish(gone)
        return 1

    async def _lost(self, st: Stored) -> Stored | None:
        """RUNNING -> RETRYING for a task whose agent is gone; None when it is not (yet)."""
        rec = st.record
        quiet_ms = (self.settings.lease_ttl + self.settings.task_ack_wait) * 1000
        at = now_ms()
        if at - rec.updated_ms < quiet_ms:
            return None
        if await self.store.idem_get(f"run.{rec.task_id}") is not None:
            return None  # its claim is still renewed: the agent lives, unregistered
        attempts = end_attempt(list(rec.attempts), rec.attempt, at, "lost", "its agent went away")
        new = advance(rec, [S.RETRYING], at, "lost", attempts=attempts)
        try:
            rev = await self.store.write(new, st.revision)
        except Conflict:
            return None  # it changed: not lost after all
        log.warning("task %s: agent %s is gone; retried", rec.task_id, rec.agent_id)
        return Stored(new, rev)

    async def _message_gone(self, st: Stored) -> Stored | None:
        """The record, read again, when its message is gone; None when it is there."""
        if st.record.seq > 0 and await self.store.message_exists(st.record.seq):
            return None
        # Final records are written before their message is acked: read it again, so a
        # task that ended (or was republished) since our first read is left alone.
        fresh = await self.store.get(st.record.task_id)
        if fresh is None or fresh.record.final:
            return None
        seq = fresh.record.seq
        if seq != st.record.seq and seq > 0 and await self.store.message_exists(seq):
            return None
        return fresh

    async def _republish(self, st: Stored) -> None:
        """Publish the task's message again and write its sequence into the record."""
        rec = st.record
        seq = await publish_task(self.store, submit_of(rec), msg_id=f"{rec.task_id}.s{rec.attempt}")
        for _ in range(_TRIES):
            if rec.final or rec.seq == seq:
                break
            new = msgspec.structs.replace(rec, seq=seq, updated_ms=now_ms())
            try:
                await self.store.write(new, st.revision)
                break
            except Conflict:
                fresh = await self.store.get(rec.task_id)
                if fresh is None:
                    break
                st, rec = fresh, fresh.record
        log.warning("task %s: its message was gone; published again as %s", rec.task_id, seq)


def _final(m: RecordMeta) -> bool:
    return m.state is not None and is_final(m.state)
