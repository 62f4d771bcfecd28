"""The durable-task promises of sdk/PROTOCOL.md section 8.8 as a model, not examples: a
Hypothesis state machine submits, cancels, starts, stops and kills agents, delivers
twice and corrupts records against a real nats-server, and checks every promise after
each step and, once everything has settled with an agent up, at the end.

``REACH_MODEL_EXAMPLES`` (``make chaos`` sets it) selects the long run; ``make test`` runs
a short one. Hypothesis prints the failing sequence of steps when a promise breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import nats.js.errors
from hypothesis import HealthCheck, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import reach
from reach import Agent, Client, ReachSettings, Registry, TaskState
from reach._agent.lifecycle import State
from reach._tasks.store import TaskStore, idem_key
from reach.testing import NatsServer, eventually, unique_prefix
from reach.wire.tasks import TaskRecord

from .task_helpers import stream_empty, task_stream

S = TaskState
FINAL = {S.SUCCEEDED, S.FAILED, S.CANCELLED}
OK, FAIL, SLOW = "model.ok", "model.fail", "model.slow"
JUNK = b"\x00 not a record"
MAX_AGENTS = 3
#: the long run (``make chaos``): examples; the short one (``make test``) runs a few
EXAMPLES = int(os.environ.get("REACH_MODEL_EXAMPLES", "0") or 0)
STEPS = 30 if EXAMPLES else 15
#: the steps taken, by rule, over every example (the test says what it explored)
TAKEN: Counter[str] = Counter()


class Handlers:
    """What the handlers saw: starts per task id, and runs per idempotency key at once."""

    def __init__(self) -> None:
        self.starts: Counter[str] = Counter()
        self.running: Counter[str] = Counter()  # per idempotency key
        self.overlaps: list[tuple[str, str]] = []  # (key, task id) of a run beside another

    def serve(self, agent: Agent) -> None:
        @agent.task(OK)
        async def ok(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
            async with self.run(payload, ctx):
                return {"n": payload["n"]}

        @agent.task(FAIL)
        async def fail(payload: dict[str, Any], ctx: reach.TaskContext) -> None:
            async with self.run(payload, ctx):
                raise reach.HandlerFailed("it fails, as asked")

        @agent.task(SLOW)
        async def slow(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
            async with self.run(payload, ctx):
                await asyncio.sleep(0.3)  # work that takes a while, not synchronization
                return {"n": payload["n"]}

    @contextlib.asynccontextmanager
    async def run(self, payload: dict[str, Any], ctx: reach.TaskContext) -> AsyncIterator[None]:
        """Counts the start (first thing a run does) and the runs of its key at once (the
        key comes in the payload: known to the handler before the submit returns)."""
        self.starts[ctx.task_id] += 1
        key = payload.get("key")
        if key is None:
            yield
            return
        if self.running[key]:
            self.overlaps.append((key, ctx.task_id))
        self.running[key] += 1
        try:
            yield
        finally:
            self.running[key] -= 1


class TaskModel(RuleBasedStateMachine):
    url: str = ""  # the session server's, set by the test

    tasks = Bundle("tasks")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.settings = ReachSettings(nats_url=self.url, subject_prefix=unique_prefix()).model_copy(
            update={
                "task_ack_wait": 1.0,
                "task_max_deliver": 3,
                "task_max_attempts": 2,
                "task_retry_base": 0.05,
                "task_retry_cap": 0.1,
                "task_sweep_interval": 0.2,
                "task_timeout": 5.0,
                "drain_timeout": 1.0,
            }
        )
        self.handlers = Handlers()
        self.agents: list[Agent] = []
        self.names = itertools.count(1)
        self.dups = itertools.count(1)
        self.submitted: list[str] = []
        self.originals: dict[str, tuple[str, bytes, dict[str, str]]] = {}
        #: the final state first seen per task (promise 2)
        self.final_seen: dict[str, TaskState] = {}
        #: tasks seen CANCELLED while the handler had never started them (promise 3)
        self.cancelled_unrun: set[str] = set()
        #: the idempotency key each task was submitted with
        self.keys: dict[str, str | None] = {}
        #: tasks whose record expired, with the runs they had then (never one more)
        self.expired: dict[str, int] = {}
        self.client = Client(settings=self.settings)
        self.registry = Registry(settings=self.settings)
        self.run(self._open())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 60))

    async def _open(self) -> None:
        await self.client.connect()
        await self.registry.start()
        self.store = TaskStore(self.client.nc.jetstream(), self.client.subjects, self.settings)
        await self.store.ensure()

    # -- reading what Reach says ---------------------------------------------------------

    async def _records(self) -> dict[str, TaskRecord | None]:
        """Each submitted task's record (None: does not decode, or not found)."""
        out: dict[str, TaskRecord | None] = {}
        for tid in self.submitted:
            try:
                out[tid] = await self.client.task_record(tid)
            except (reach.CorruptRecord, reach.TaskNotFound):
                out[tid] = None
        return out

    def _check(self, records: dict[str, TaskRecord | None]) -> None:
        for tid, rec in records.items():
            if rec is None:
                continue
            states = [s.state for s in rec.history]
            finals = [s for s in states if s in FINAL]
            # 1. at most one final state, as the last entry of the history
            assert len(finals) <= 1, (tid, states)
            if finals:
                assert states[-1] is finals[0], (tid, states)
            assert rec.final == (rec.state in FINAL), (tid, rec.state)
            if rec.final:
                assert states, tid
                assert states[-1] is rec.state, (tid, rec.state, states)
                # 2. a final state never changes once seen
                seen = self.final_seen.setdefault(tid, rec.state)
                assert seen is rec.state, (tid, seen, rec.state, states)
            else:
                assert tid not in self.final_seen, (tid, self.final_seen[tid], rec.state)
            # 3. seen CANCELLED before any run started: never starts a run
            if rec.state is S.CANCELLED and not self.handlers.starts[tid]:
                self.cancelled_unrun.add(tid)
        for tid in self.cancelled_unrun:
            assert self.handlers.starts[tid] == 0, (tid, self.handlers.starts[tid])
        # 4. two runs of one idempotency key never overlap
        assert self.handlers.overlaps == []

    # -- rules -----------------------------------------------------------------------------

    @rule(
        target=tasks,
        cap=st.sampled_from([OK, FAIL, SLOW]),
        key=st.one_of(st.none(), st.sampled_from(["k1", "k2"])),
    )
    def submit(self, cap: str, key: str | None) -> str:
        TAKEN["submit"] += 1

        async def go() -> str:
            # a key names one task per capability here, as a caller would use it
            idem = f"{cap}:{key}" if key else None
            ref = await self.client.submit(cap, {"n": 1, "key": idem}, idempotency_key=idem)
            assert ref.task_id not in self.expired, ref.task_id  # its key expired first
            if ref.task_id not in self.submitted:
                self.keys[ref.task_id] = idem
                self.submitted.append(ref.task_id)
                await self._keep_message(ref.task_id)
            return ref.task_id

        tid = self.run(go())
        assert tid in self.submitted
        return tid

    async def _keep_message(self, task_id: str) -> None:
        """The task's message as stored, to deliver it again later."""
        try:
            raw = await self.client.nc.jetstream().get_msg(
                task_stream(self.settings),
                subject=self.client.subjects.task_lookup(task_id),
                direct=True,
            )
        except Exception:  # taken already: nothing to keep
            return
        headers = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-")}
        self.originals[task_id] = (raw.subject or "", raw.data or b"", headers)

    @rule(tid=tasks)
    def cancel(self, tid: str) -> None:
        TAKEN["cancel"] += 1

        async def go() -> TaskRecord | None:
            try:
                return await (await self.client.task(tid)).cancel()
            except reach.CorruptRecord:
                return None
            except reach.TaskNotFound:
                assert tid in self.expired, tid
                return None

        rec = self.run(go())
        if rec is not None:
            # CANCELLED, or asked for (RUNNING), or it had ended already
            assert rec.final or rec.cancel_requested, (tid, rec.state)
            self._check({tid: rec})

    @precondition(lambda self: len(self.agents) < MAX_AGENTS)
    @rule()
    def start_agent(self) -> None:
        TAKEN["start_agent"] += 1
        agent = Agent(f"model-{next(self.names)}", settings=self.settings, max_concurrency=2)
        self.handlers.serve(agent)
        self.run(agent.start())
        self.agents.append(agent)
        assert agent.state in (State.UP, State.DEGRADED), agent.state

    @precondition(lambda self: self.agents)
    @rule(i=st.integers(0, MAX_AGENTS - 1))
    def stop_agent(self, i: int) -> None:
        TAKEN["stop_agent"] += 1
        agent = self.agents.pop(i % len(self.agents))
        self.run(agent.stop())
        assert agent._nc is None

    @precondition(lambda self: self.agents)
    @rule(i=st.integers(0, MAX_AGENTS - 1))
    def kill_agent(self, i: int) -> None:
        """As a process killed: its connection gone at once (nothing acked, nothing written,
        no drain), then its coroutines, handlers included, are gone too."""
        TAKEN["kill_agent"] += 1
        agent = self.agents.pop(i % len(self.agents))

        async def go() -> None:
            nc = agent._nc
            assert nc is not None
            await nc.close()
            stopping = agent._begin_stop(graceful=False)
            if stopping is not None:
                await asyncio.shield(stopping)

        self.run(go())
        assert agent._nc is None

    @rule(tid=tasks)
    def deliver_twice(self, tid: str) -> None:
        """The task's message published again under a new message id (a redelivery the
        duplicate window does not catch)."""
        TAKEN["deliver_twice"] += 1
        if tid in self.expired:
            return  # a producer's retry after the retention is a new task: out of the model
        if tid not in self.originals:
            # taken before we could keep its message: an agent wrote its record
            assert self.run(self._has_record(tid)), tid
            return
        subject, data, headers = self.originals[tid]

        async def go() -> Any:
            return await self.client.nc.jetstream().publish(
                subject, data, headers={**headers, "Nats-Msg-Id": f"dup-{next(self.dups)}"}
            )

        ack = self.run(go())
        assert not ack.duplicate

    async def _has_record(self, tid: str) -> bool:
        try:
            return await self.store.get(tid) is not None
        except reach.CorruptRecord:
            return True

    @rule(tid=tasks)
    def corrupt(self, tid: str) -> None:
        """Junk as the record of a task not ended (compare-and-set on what we read, so a
        final state is never overwritten by us)."""
        TAKEN["corrupt"] += 1
        if tid in self.expired:
            return

        async def go() -> str:
            try:
                stored = await self.store.get(tid)
            except reach.CorruptRecord:
                return "corrupt already"
            if stored is not None and stored.record.final:
                return "final"
            bucket = f"{self.settings.subject_prefix}_tasks"
            last = str(stored.revision if stored else 0)
            try:
                await self.client.nc.jetstream().publish(
                    f"$KV.{bucket}.{tid}",
                    JUNK,
                    headers={"Nats-Expected-Last-Subject-Sequence": last},
                )
            except nats.js.errors.BadRequestError:
                return "changed since read"
            return "corrupted"

        done = self.run(go())
        assert done in ("corrupt already", "final", "changed since read", "corrupted")
        if done == "corrupted":
            # a typed error until an agent, or the sweep, replaces it: FAILED, undecodable
            try:
                rec = self.run(self.client.task_record(tid))
            except reach.CorruptRecord:
                return
            assert rec.state is S.FAILED, (tid, rec.state)
            assert rec.error is not None
            assert rec.error.code == "undecodable"

    @rule(tid=tasks)
    def expire(self, tid: str) -> None:
        """The retention of a final task's record lapses, as its TTL would: with no message
        of the task left (a message is acked before its record's last change, from which
        the TTL counts) and its idempotency keys gone first (their TTL is no longer, and
        began earlier). From then on the task is unknown, and nothing may run it again."""
        TAKEN["expire"] += 1
        if tid in self.expired:
            return

        async def go() -> str:
            try:
                rec = await self.client.task_record(tid)
            except reach.CorruptRecord:
                return "corrupt"
            if not rec.final:
                return "not final"
            if await self._message_left(tid):
                return "message left"
            js = self.client.nc.jetstream()
            key = self.keys.get(tid)
            if key is not None:
                for kind in ("submit", "run"):
                    await js.purge_stream(
                        f"KV_{self.store.idem_bucket}",
                        subject=f"$KV.{self.store.idem_bucket}.{idem_key(kind, key)}",
                    )
            await js.purge_stream(
                f"KV_{self.store.bucket}", subject=f"$KV.{self.store.bucket}.{tid}"
            )
            return "expired"

        done = self.run(go())
        assert done in ("corrupt", "not final", "message left", "expired")
        TAKEN[f"expire: {done}"] += 1
        if done == "expired":
            self.expired[tid] = self.handlers.starts[tid]
            self.submitted.remove(tid)
            self.originals.pop(tid, None)
            with contextlib.suppress(KeyError):
                del self.final_seen[tid]
            self.cancelled_unrun.discard(tid)

            async def gone() -> None:
                try:
                    await self.client.task_record(tid)
                except reach.TaskNotFound:
                    return
                raise AssertionError(f"{tid}: a record after it expired")

            self.run(gone())

    async def _message_left(self, tid: str) -> bool:
        try:
            await self.client.nc.jetstream().get_msg(
                task_stream(self.settings),
                subject=self.client.subjects.task_lookup(tid),
                direct=True,
            )
        except nats.js.errors.NotFoundError:
            return False
        return True

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def promises_hold(self) -> None:
        self._check(self.run(self._records()))
        # 7. an expired task is never run again
        for tid, starts in self.expired.items():
            assert self.handlers.starts[tid] == starts, (tid, starts, self.handlers.starts[tid])

    def teardown(self) -> None:
        try:
            self.run(self._settle())
        finally:
            try:
                self.run(self._close())
            finally:
                self.loop.close()

    async def _settle(self) -> None:
        if not self.agents:
            agent = Agent(f"model-{next(self.names)}", settings=self.settings, max_concurrency=2)
            self.handlers.serve(agent)
            await agent.start()
            self.agents.append(agent)

        async def all_final() -> bool:
            records = await self._records()
            self._check(records)
            return all(r is not None and r.final for r in records.values())

        # 6. every task ends: deadline (5 s) + ack_wait (1 s) + a sweep (0.2 s), with room
        await eventually(all_final, timeout=30)
        await eventually(stream_empty(self.client, self.settings), timeout=30)
        records = await self._records()
        self._check(records)
        # 5. dead-lettered only after a run, or with a reason that says it never ran
        for dl in await self.client.dead_letters(limit=1000):
            if dl.kind != "task":
                continue
            if dl.reason in ("bad_request", "undecodable"):
                continue
            if dl.reason == "max_deliveries" and not dl.attempts:
                assert "it never ran" in dl.error, (dl.task_id, dl.error)
                continue
            assert self.handlers.starts[dl.task_id] > 0, (dl.task_id, dl.reason, dl.error)
            assert dl.attempts, (dl.task_id, dl.reason)

    async def _close(self) -> None:
        for agent in self.agents:
            await agent.stop()
        await self.registry.stop()
        await self.client.close()


def test_the_task_promises_hold_whatever_the_steps(nats_server: NatsServer) -> None:
    TaskModel.url = nats_server.url
    TAKEN.clear()
    run_state_machine_as_test(
        TaskModel,
        settings=settings(
            max_examples=EXAMPLES or 15,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=not EXAMPLES,  # the short run: the same steps each time
            suppress_health_check=list(HealthCheck),
            database=None,
            verbosity=Verbosity.verbose
            if os.environ.get("REACH_MODEL_VERBOSE")
            else Verbosity.normal,
        ),
    )
    print("steps taken:", dict(TAKEN))
    for step in ("submit", "cancel", "kill_agent", "deliver_twice", "corrupt", "expire"):
        assert TAKEN[step], (step, TAKEN)
    if EXAMPLES:  # the long run let some records expire
        assert TAKEN["expire: expired"], TAKEN
