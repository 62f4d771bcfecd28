"""Delayed tasks (``submit(at=..., delay=...)``) and retries a handler asks for
(``RetryLater``), on the server's own schedules (sdk/PROTOCOL.md 8.2 and 8.4): the task
waits SCHEDULED as a schedule the server holds, then enters its work queue as PENDING;
a cancel before then removes it; a retry later waits the same way without spending a
delivery."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any

import pytest

import reach
from reach import Agent, Client, ReachSettings, TaskState
from reach.testing import eventually

from .task_helpers import stream_empty

S = TaskState


def _ms() -> int:
    return int(time.time() * 1000)


def starts_agent(settings: ReachSettings, cap: str, starts: list[tuple[str, int]]) -> Agent:
    """Records (task id, unix ms) at the start of every run."""
    agent = Agent("delayed", settings=settings)

    @agent.task(cap)
    async def op(payload: Any, ctx: reach.TaskContext) -> Any:
        starts.append((ctx.task_id, _ms()))
        return payload

    return agent


async def test_delayed_task_runs_at_its_due_time(reach_settings: ReachSettings) -> None:
    """PROTOCOL 8.8 promise 8 (not before its due time): a task delayed by 2 s is
    SCHEDULED (due shown) at once, runs no earlier than 2 s after the submit (and runs:
    the 30 s wait for its result only guards against a hang); its record says when it
    was due."""
    starts: list[tuple[str, int]] = []
    async with (
        starts_agent(reach_settings, "delay.op", starts),
        Client(settings=reach_settings) as client,
    ):
        before = _ms()
        ref = await client.submit("delay.op", {"n": 1}, delay=datetime.timedelta(seconds=2))
        rec = await ref.status()
        assert rec.state is S.SCHEDULED
        assert before + 2000 <= rec.due_ms <= _ms() + 2000
        listed = await client.list_tasks(state="scheduled")
        assert [r.task_id for r in listed] == [ref.task_id]
        assert await ref.result(timeout=30) == {"n": 1}
        ((task_id, started),) = starts
        assert task_id == ref.task_id
        assert started >= before + 2000, "ran before its delay was over"
        assert started >= rec.due_ms, "ran before its due time"
        done = await ref.status()
        assert done.due_ms == rec.due_ms
        assert [s.state for s in done.history] == [S.PENDING, S.RUNNING, S.SUCCEEDED]
        assert done.history[0].at_ms == rec.due_ms


async def test_cancelled_delayed_task_never_runs(reach_settings: ReachSettings) -> None:
    """PROTOCOL 8.8 promise 8 (cancelled before then, never runs): a delayed task
    cancelled before its due time never runs, even once that time has passed with an
    agent up: the cancel removed the schedule."""
    starts: list[tuple[str, int]] = []
    async with (
        starts_agent(reach_settings, "delay.cancel", starts),
        Client(settings=reach_settings) as client,
    ):
        ref = await client.submit("delay.cancel", {"n": 1}, delay=1.0)
        later = await client.submit("delay.cancel", {"n": 2}, delay=1.5)  # runs: the witness
        rec = await ref.cancel()
        assert rec.state is S.CANCELLED
        assert await later.result(timeout=10) == {"n": 2}  # its due time (after ref's) passed
        assert [t for t, _ in starts] == [later.task_id]
        assert (await ref.status()).state is S.CANCELLED
        await eventually(stream_empty(client, reach_settings), timeout=5)


async def test_delayed_submit_at_and_idempotency(reach_settings: ReachSettings) -> None:
    """``at`` takes an aware datetime (a naive one is refused); an idempotency key gives the
    same task again while it waits; a time already past runs at once (PENDING)."""
    async with Client(settings=reach_settings) as client:
        due = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        with pytest.raises(reach.ConfigurationError, match="time zone"):
            await client.submit("delay.at", 1, at=due.replace(tzinfo=None))
        with pytest.raises(reach.ConfigurationError, match="not both"):
            await client.submit("delay.at", 1, at=due, delay=3)
        a = await client.submit("delay.at", 1, at=due, idempotency_key="k-at")
        b = await client.submit("delay.at", 1, at=due, idempotency_key="k-at")
        assert a.task_id == b.task_id
        rec = await a.status()
        assert rec.state is S.SCHEDULED
        assert rec.due_ms == int(due.timestamp() * 1000)
        past = await client.submit("delay.at", 2, at=due - datetime.timedelta(hours=2))
        assert (await past.status()).state is S.PENDING
        await a.cancel()
        await past.cancel()


async def test_retry_later_reruns_after_the_delay(reach_settings: ReachSettings) -> None:
    """``RetryLater(after=1)`` ends the attempt RETRYING (due shown), and the task runs
    again no earlier than 1 s later, from a new message: each run was the first delivery
    of its message (waiting spent no delivery: nothing was naked or redelivered)."""
    runs: list[tuple[int, int]] = []  # (attempt, unix ms)
    agent = Agent("later", settings=reach_settings)

    @agent.task("later.op", max_attempts=3)
    async def op(payload: Any, ctx: reach.TaskContext) -> Any:
        runs.append((ctx.attempt, _ms()))
        if len(runs) == 1:
            raise reach.RetryLater(after=1, reason="rate limited")
        return "done"

    async with agent, Client(settings=reach_settings) as client:
        ref = await client.submit("later.op", None)
        waiting = None
        async with asyncio.timeout(30):  # a hang guard only
            async for rec in ref.watch():
                if rec.state is S.RETRYING:
                    waiting = rec
                if rec.final:
                    break
        assert waiting is not None
        assert waiting.error is not None
        assert waiting.error.code == "retry_later"
        assert waiting.error.message == "rate limited"
        assert await ref.result(timeout=30) == "done"
        (a1, t1), (a2, t2) = runs
        assert (a1, a2) == (1, 2)
        assert waiting.due_ms - t1 >= 1000
        assert t2 >= waiting.due_ms, "ran again before the retry's due time"
        stats = agent.task_stats
        assert (stats.redelivered, stats.handed_back) == (0, 0), "a retry later spent a delivery"
        rec = await ref.status()
        assert [a.outcome for a in rec.attempts] == ["retry_later", "succeeded"]
        assert agent.task_stats.retried_later == 1
        await eventually(stream_empty(client, reach_settings), timeout=5)


async def test_retry_later_counts_unless_told(reach_settings: ReachSettings) -> None:
    """A counted RetryLater uses an attempt: with none left the task fails
    (``retry_later``, dead-lettered); ``count=False`` does not use one."""
    agent = Agent("later2", settings=reach_settings)
    seen: dict[str, int] = {}

    @agent.task("later.counted", max_attempts=2)
    async def counted(payload: Any, ctx: reach.TaskContext) -> Any:
        raise reach.RetryLater(after=0.1, reason="never ready")

    @agent.task("later.free", max_attempts=1)
    async def free(payload: Any, ctx: reach.TaskContext) -> Any:
        seen[ctx.task_id] = seen.get(ctx.task_id, 0) + 1
        if seen[ctx.task_id] < 3:
            raise reach.RetryLater(after=0.1, count=False)
        return seen[ctx.task_id]

    async with agent, Client(settings=reach_settings) as client:
        a = await client.submit("later.counted", None)
        b = await client.submit("later.free", None)
        rec = await a.wait(timeout=10)
        assert rec.state is S.FAILED
        assert rec.error is not None
        assert rec.error.code == "retry_later"
        assert [x.outcome for x in rec.attempts] == ["retry_later", "retry_later"]
        letters = await client.dead_letters("later.counted")
        assert [dl.task_id for dl in letters] == [a.task_id]
        assert await b.result(timeout=10) == 3
        outcomes = [x.outcome for x in (await b.status()).attempts]
        assert outcomes == ["deferred", "deferred", "succeeded"]


async def test_cancel_while_waiting_for_retry_later(reach_settings: ReachSettings) -> None:
    """A task waiting for its retry later is cancelled at once, and never runs again."""
    runs: list[int] = []
    agent = Agent("later3", settings=reach_settings)

    @agent.task("later.cancel")
    async def op(payload: Any, ctx: reach.TaskContext) -> Any:
        runs.append(ctx.attempt)
        raise reach.RetryLater(after=1)

    async with agent, Client(settings=reach_settings) as client:
        ref = await client.submit("later.cancel", None)
        await eventually(lambda: runs == [1], timeout=5)

        async def waiting() -> bool:
            return (await ref.status()).state is S.RETRYING

        await eventually(waiting, timeout=5)
        assert (await ref.cancel()).state is S.CANCELLED
        witness = await client.submit("later.cancel", None, delay=1.5)
        await eventually(lambda: len(runs) == 2, timeout=10)  # the witness ran: time passed
        await witness.cancel()
        assert runs == [1, 1]
        assert (await ref.status()).state is S.CANCELLED


class _StaleOnce:
    """A task store whose first ``lookup`` answers what it answered before (the cancel's
    read just before the schedule fired); everything else is the real store's."""

    def __init__(self, store: Any, stale: Any) -> None:
        self._store, self._stale = store, stale

    async def lookup(self, task_id: str) -> Any:
        stale, self._stale = self._stale, None
        return stale or await self._store.lookup(task_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_cancel_that_saw_scheduled_after_the_firing(reach_settings: ReachSettings) -> None:
    """A cancel that read SCHEDULED just before the schedule fired does not record
    "cancelled before it ran" over a task an agent may be running: deleting the schedule
    finds it gone, so it looks again and cancels the PENDING task (its history says so,
    and an agent that holds it is told). Forced in order: the read, the firing, the
    cancel."""
    from reach._tasks.refs import cancel_record

    async with Client(settings=reach_settings) as client:
        ref = await client.submit("delay.race", None, delay=0.3)
        store = client._tasks.store
        stale = await store.lookup(ref.task_id)
        assert stale is not None
        assert stale.record.state is S.SCHEDULED

        async def fired() -> bool:
            return (await ref.status()).state is S.PENDING

        await eventually(fired, timeout=5)
        rec = await cancel_record(_StaleOnce(store, stale), ref.task_id)  # type: ignore[arg-type]
        assert rec.state is S.CANCELLED
        assert [h.state for h in rec.history] == [S.PENDING, S.CANCELLED]
        await ref.cancel()  # finishes it: the fired message goes
        await eventually(stream_empty(client, reach_settings), timeout=5)


async def test_retry_later_longer_than_the_retention(reach_settings: ReachSettings) -> None:
    """A retry later past ``task_retention`` keeps the record until it runs again (kept
    past its due time): the attempts add up and the task ends FAILED when they run out,
    never starting over as attempt 1 forever."""
    settings = reach_settings.model_copy(
        update={"task_retention": 2.0, "task_timeout": 1.0, "task_idempotency_ttl": 1.0}
    )
    runs: list[int] = []
    agent = Agent("later-ret", settings=settings)

    @agent.task("later.ret", max_attempts=2)
    async def op(payload: Any, ctx: reach.TaskContext) -> Any:
        runs.append(ctx.attempt)
        raise reach.RetryLater(after=3)

    async with agent, Client(settings=settings) as client:
        ref = await client.submit("later.ret", None)
        rec = await ref.wait(timeout=15)
        assert rec.state is S.FAILED
        assert runs == [1, 2]
        assert [a.outcome for a in rec.attempts] == ["retry_later", "retry_later"]


async def test_retry_later_whose_ack_was_lost(
    reach_settings: ReachSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that scheduled a retry later and then lost the old message's ack (a crash
    between the two): the old message comes back after ack_wait, long before the retry is
    due, and is dropped; the task runs again once, at its due time, from the schedule."""
    from nats.aio.msg import Msg

    settings = reach_settings.model_copy(update={"task_ack_wait": 1.0})
    starts: list[tuple[int, int]] = []
    agent = Agent("later-lost", settings=settings)

    @agent.task("later.lost")
    async def op(payload: Any, ctx: reach.TaskContext) -> Any:
        starts.append((ctx.attempt, _ms()))
        if ctx.attempt == 1:
            raise reach.RetryLater(after=4)
        return "done"

    real_ack = Msg.ack_sync
    lost: list[int] = []

    async def ack_lost_once(self: Msg, timeout: float = 1.0) -> Msg:
        if not lost:
            lost.append(self.metadata.sequence.stream)
            return self  # the crash: the ack is never sent
        return await real_ack(self, timeout)

    monkeypatch.setattr(Msg, "ack_sync", ack_lost_once)
    async with agent, Client(settings=settings) as client:
        ref = await client.submit("later.lost", None)
        assert await ref.result(timeout=20) == "done"
        rec = await ref.status()
        assert lost, "the retry later's ack was never reached"
        assert [n for n, _ in starts] == [1, 2], "ran again before its due time"
        assert starts[1][1] >= rec.attempts[0].ended_ms + 4000 - 50
        await eventually(stream_empty(client, settings), timeout=5)


async def test_list_scheduled_tasks_behind_many_pending(reach_settings: ReachSettings) -> None:
    """``list_tasks(state="scheduled")`` filters by state before the limit counts: five
    PENDING tasks stored first do not hide the SCHEDULED one (nor the reverse)."""
    async with Client(settings=reach_settings) as client:
        pending = [await client.submit("list.now", i) for i in range(5)]
        later = await client.submit("list.later", 0, delay=3600)
        listed = await client.list_tasks(state="scheduled", limit=5)
        assert [r.task_id for r in listed] == [later.task_id]
        listed = await client.list_tasks(state="pending", limit=5)
        assert {r.task_id for r in listed} == {p.task_id for p in pending}
        for ref in [*pending, later]:
            await ref.cancel()


async def test_a_requeued_message_does_not_take_over_a_running_attempt(
    reach_settings: ReachSettings,
) -> None:
    """A message put back as a new one (``Reach-Requeued-From`` naming the task's own
    message) while that old message is held by a RUNNING attempt, whose agent is alive
    (its ack was lost, or it came back and runs): the new one is put back, never ends
    that attempt as lost and runs the task a second time at once. Forced in order: the
    old message taken and begun, the new one published, then taken."""
    import msgspec

    from reach._tasks.execute import REQUEUED_FROM, Executor
    from reach._tasks.model import Delivery, TaskStats
    from reach.wire.tasks import TaskSubmit

    async with Client(settings=reach_settings) as client:
        ref = await client.submit("requeue.held", None, max_attempts=3)
        store = await client._tasks.ready(client.nc)
        psub = await store.js.pull_subscribe(
            f"{reach_settings.subject_prefix}.task.*.requeue.held.>",
            durable="held",
            stream=store.stream,
        )
        (old,) = await psub.fetch(1, timeout=5)
        sub = msgspec.json.decode(old.data, type=TaskSubmit)
        alive = Executor("alive", client.nc, store, TaskStats())
        assert await alive.begin(Delivery(old, sub))  # RUNNING, attempt 1, old held
        seq = old.metadata.sequence.stream
        headers = {k: v for k, v in (old.headers or {}).items() if not k.startswith("Nats-")}
        headers |= {REQUEUED_FROM: str(seq), "Nats-Msg-Id": f"{ref.task_id}.q{seq}"}
        await store.publish(old.subject, old.data, headers)
        (new,) = await psub.fetch(1, timeout=5)
        assert new.metadata.sequence.stream != seq
        other = Executor("other", client.nc, store, TaskStats())
        assert not await other.begin(Delivery(new, sub))
        rec = await ref.status()
        assert (rec.state, rec.attempt, rec.agent_id) == (S.RUNNING, 1, "alive")
        assert [a.outcome for a in rec.attempts] == ["running"]
        assert other.stats.handed_back == 1
        await ref.cancel()


async def test_a_waiting_task_is_never_scheduled_in_its_record(
    reach_settings: ReachSettings,
) -> None:
    """PROTOCOL 8.3: SCHEDULED is never written in a record (agents of earlier versions
    would not decode it). While a delayed task waits, with an agent of its capability up,
    the ``<prefix>_tasks`` bucket has no key for it: the schedule message is its state. A
    cancel before its due time writes its first record, holding only CANCELLED. A task
    waiting for a retry later is RETRYING in its record, and no revision of the key ever
    says SCHEDULED."""
    import msgspec
    import nats.js.errors

    from reach.wire.tasks import TaskRecord

    agent = Agent("kv-watcher", settings=reach_settings)

    @agent.task("delay.kv")
    async def op(payload: Any) -> Any:
        raise reach.RetryLater(after=3600)

    async with agent, Client(settings=reach_settings) as client:
        store = await client._tasks.ready(client.nc)
        kv = await client.nc.jetstream().key_value(store.bucket)
        delayed = await client.submit("delay.kv", {"n": 1}, delay=3600)
        assert (await delayed.status()).state is S.SCHEDULED
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(delayed.task_id)
        assert (await delayed.cancel()).state is S.CANCELLED
        cancelled = msgspec.json.decode((await kv.get(delayed.task_id)).value, type=TaskRecord)
        assert [h.state for h in cancelled.history] == [S.CANCELLED]

        later = await client.submit("delay.kv", {"n": 2})

        async def waiting() -> bool:
            return (await later.status()).state is S.RETRYING

        await eventually(waiting, timeout=30)
        revisions = await kv.history(later.task_id)
        states = [msgspec.json.decode(e.value, type=TaskRecord).state for e in revisions]
        assert states[-1] is S.RETRYING
        assert S.SCHEDULED not in states, states
        await later.cancel()
