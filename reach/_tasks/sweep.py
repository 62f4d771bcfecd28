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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import msgspec
import nats.js.errors
from nats.nuid import NUID

from .._codec import now_ms
from .._kv.leases import KV_OP, MARKER_REASON
from .._nats import TRANSIENT
from .._subjects import Subjects
from ..settings import ReachSettings
from ..wire.tasks import TaskRecord, TaskState, TaskSubmit
from .admin import RecordMeta, each_record, scan
from .states import IllegalTransition, advance, end_attempt, is_final
from .store import Conflict, Stored, TaskStore
from .submit import publish_task

__all__ = ["RETRIED", "RecoveryStats", "Sweeper", "submit_of"]

log = logging.getLogger("reach.tasks")
S = TaskState
_LOCK = "recovery.sweep"  # in <prefix>_idem: who sweeps this interval
_MIN_TTL = 1.0  # the server's smallest per-message TTL
_TRIES = 8
_PARALLEL = 32
#: what a failed advisory, sweep or record recovery may raise: counted, logged, tried again
RETRIED: tuple[type[BaseException], ...] = (*TRANSIENT, Conflict, IllegalTransition)


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
    #: advisories, sweeps or records that could not be handled (logged; tried again later)
    errors: int = 0
    #: task records by state and messages in the DLQ, as of this replica's last sweep
    states: dict[str, int] | None = None
    dlq_messages: int | None = None


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


class Sweeper:
    """The sweep for one store; ``sweeping`` is its loop (run it in a ``TaskOwner``)."""

    def __init__(
        self,
        store: TaskStore,
        settings: ReachSettings,
        subjects: Subjects,
        stats: RecoveryStats,
        stopping: asyncio.Event,
    ) -> None:
        self.store = store
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
        are recovered one by one."""
        self.stats.sweeps += 1
        states: dict[str, int] = {}
        ids: list[str] = []  # only the non-final ones: memory does not grow with history

        def visit(m: RecordMeta) -> None:
            if m.state is not None:
                states[m.state.value] = states.get(m.state.value, 0) + 1
            if not _final(m):
                ids.append(m.task_id)

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
        try:  # for metrics only: after the recovery, and never in its way
            info = await self.store.js.stream_info(self.store.dlq_stream)
            self.stats.dlq_messages = info.state.messages
        except RETRIED as exc:
            log.debug("task recovery: DLQ size not read: %r", exc)
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
        st = await self.store.get(task_id)
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
        return await self._republish(st)

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
