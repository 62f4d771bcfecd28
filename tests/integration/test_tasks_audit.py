"""Durable-task promises an audit found unproven, each pinned on a real nats-server: records
expire after their retention, a lease outlives many ack_waits with a second agent idle, the
ack waits for the record, typed payloads, cancel twice and cancel through the record alone,
deduplication by task id, and the storage of every stream and bucket."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import RetentionPolicy, StorageType

import reach
from reach import Agent, Client, ReachSettings, Registry, TaskNotFound, TaskState
from reach._tasks import leases
from reach._tasks.refs import cancel_record
from reach._tasks.store import TaskStore, consumer_name
from reach._tasks.submit import publish_task
from reach.testing import eventually
from reach.wire import Priority
from reach.wire.tasks import TaskRecord

S = TaskState


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_ack_wait": 2.0, "task_retry_base": 0.05})


def task_stream(settings: ReachSettings) -> str:
    return settings.subject_prefix.replace(".", "_").upper() + "_TASKS"


def stream_empty(client: Client, settings: ReachSettings) -> Callable[[], Awaitable[bool]]:
    """Whether the task stream is empty (a work queue: an acked message is gone)."""

    async def check() -> bool:
        info = await client.nc.jetstream().stream_info(task_stream(settings))
        return info.state.messages == 0

    return check


def counting_agent(settings: ReachSettings, name: str, cap: str, runs: list[str]) -> Agent:
    """Doubles ``n``; appends the task id to ``runs`` on every execution."""
    agent = Agent(name, settings=settings)

    @agent.task(cap)
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        runs.append(ctx.task_id)
        return {"n": payload["n"] * 2, "attempt": ctx.attempt}

    return agent


# -- retention -------------------------------------------------------------------------------


async def test_a_finished_task_record_expires_after_the_retention(reach_settings: ReachSettings):
    """Records carry a per-key TTL of ``task_retention``; once it runs out the id is
    unknown (TaskNotFound), never PENDING, so the bucket cannot grow without bound."""
    settings = reach_settings.model_copy(
        update={"task_retention": 1.0, "task_timeout": 1.0, "task_idempotency_ttl": 1.0}
    )
    runs: list[str] = []
    async with (
        counting_agent(settings, "brief", "short.op", runs),
        Client(settings=settings) as client,
    ):
        ref = await client.submit("short.op", {"n": 2})
        assert (await ref.result(timeout=30))["n"] == 4
        bucket = f"{settings.subject_prefix}_tasks"
        raw = await client.nc.jetstream().get_msg(
            f"KV_{bucket}", subject=f"$KV.{bucket}.{ref.task_id}"
        )
        assert (raw.headers or {}).get("Nats-TTL") == "1000ms"  # the final write's TTL

        async def expired() -> bool:
            try:
                await client.task(ref.task_id)
            except TaskNotFound:
                return True
            return False

        await eventually(expired, timeout=30)
        with pytest.raises(TaskNotFound):
            await ref.status()
    assert runs == [ref.task_id]


# -- leases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "lease-key"], ids=["ack-timer", "claimed"])
async def test_a_task_longer_than_many_ack_waits_runs_once_beside_an_idle_agent(
    reach_settings: ReachSettings, monkeypatch: pytest.MonkeyPatch, key: str | None
):
    """ack_wait is 1 s; the handler runs for more than 3 of them while a second agent of
    the same capability idles. Kept by in_progress (and, with a key, the renewed claim),
    the task is never redelivered: one attempt, one run."""
    settings = reach_settings.model_copy(update={"task_ack_wait": 1.0})
    kept: dict[str, int] = {}
    real = leases._in_progress

    async def counted(msg: Msg) -> None:
        kept[msg.subject] = kept.get(msg.subject, 0) + 1
        await real(msg)

    monkeypatch.setattr(leases, "_in_progress", counted)
    runs: list[str] = []
    release = asyncio.Event()

    def worker(name: str) -> Agent:
        agent = Agent(name, settings=settings)

        @agent.task("long.op")
        async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
            runs.append(ctx.agent_id)
            await release.wait()
            return {"attempt": ctx.attempt}

        return agent

    one, two = worker("one"), worker("two")
    async with one, two, Client(settings=settings) as client:
        ref = await client.submit("long.op", {}, idempotency_key=key)
        subject = f"{settings.subject_prefix}.task.{ref.task_id}.long.op.normal"
        # the lease loop resets the timer every ack_wait/3: 10 resets span >= 3 ack_waits
        await eventually(lambda: kept.get(subject, 0) >= 10 or len(runs) > 1, timeout=60)
        assert len(runs) == 1  # not redelivered to the idle agent (or back to this one)
        info = await client.nc.jetstream().consumer_info(
            task_stream(settings), consumer_name("long.op", Priority.NORMAL)
        )
        assert (info.num_redelivered, info.num_ack_pending) == (0, 1)
        release.set()
        assert await ref.result(timeout=30) == {"attempt": 1}
        rec = await ref.status()
    assert len(runs) == 1
    assert [(a.n, a.outcome) for a in rec.attempts] == [(1, "succeeded")]
    assert one.task_stats.redelivered == two.task_stats.redelivered == 0
    assert one.task_stats.started + two.task_stats.started == 1


# -- ack only after the record ---------------------------------------------------------------


@pytest.mark.parametrize("stored", [False, True], ids=["write-lost", "ack-of-write-lost"])
async def test_a_final_write_that_fails_is_redelivered_and_the_task_succeeds(
    settings: ReachSettings, monkeypatch: pytest.MonkeyPatch, stored: bool
):
    """The write of SUCCEEDED fails once (not stored; or stored, its ack lost). The
    message was not acked, so it comes back after ack_wait and the task ends SUCCEEDED:
    run again when nothing was stored, answered from the record when it was."""
    runs: list[str] = []
    agent = counting_agent(settings, "writer", "write.op", runs)
    failed: list[TaskRecord] = []
    async with agent, Client(settings=settings) as client:
        store = agent._tasks.store
        assert isinstance(store, TaskStore)
        real = store.write

        async def write(record: TaskRecord, last: int) -> int:
            if record.state is S.SUCCEEDED and not failed:
                failed.append(record)
                if stored:
                    await real(record, last)
                raise nats.errors.TimeoutError  # what a JetStream publish without ack raises
            return await real(record, last)

        monkeypatch.setattr(store, "write", write)
        ref = await client.submit("write.op", {"n": 5})
        assert (await ref.result(timeout=30))["n"] == 10
        await eventually(stream_empty(client, settings), timeout=30)  # acked at last
        rec = await ref.status()
    assert len(failed) == 1
    assert rec.state is S.SUCCEEDED
    assert agent.task_stats.redelivered == 1
    if stored:
        assert runs == [ref.task_id]  # the redelivery found the result and ran nothing
        assert agent.task_stats.duplicates == 1
    else:
        assert runs == [ref.task_id, ref.task_id]  # nothing recorded: run again
        assert [a.outcome for a in rec.attempts] == ["succeeded"]


@pytest.mark.parametrize("stored", [False, True], ids=["write-lost", "ack-of-write-lost"])
async def test_a_running_write_that_fails_leaves_the_handler_supervised(
    settings: ReachSettings, monkeypatch: pytest.MonkeyPatch, stored: bool
):
    """The write of RUNNING fails once (a server hiccup) while the handler runs. The
    handler must stay under the agent's lease, timeout and cancel, and its result must be
    recorded: one run, one attempt. (It was left running unsupervised: its result was
    dropped and the task ran again after ack_wait.)"""
    runs: list[str] = []
    release = asyncio.Event()
    agent = Agent("runner", settings=settings)

    @agent.task("hiccup.op")
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        runs.append(ctx.task_id)
        await release.wait()
        return {"n": payload["n"], "attempt": ctx.attempt}

    failed: list[TaskRecord] = []
    async with agent, Client(settings=settings) as client:
        store = agent._tasks.store
        assert isinstance(store, TaskStore)
        real = store.write

        async def write(record: TaskRecord, last: int) -> int:
            if record.state is S.RUNNING and not failed:
                failed.append(record)
                if stored:
                    await real(record, last)
                raise nats.errors.TimeoutError
            return await real(record, last)

        monkeypatch.setattr(store, "write", write)
        ref = await client.submit("hiccup.op", {"n": 1})
        await eventually(lambda: bool(failed), timeout=30)
        assert agent.task_stats.running == 1  # still its task, kept alive
        release.set()
        assert await ref.result(timeout=30) == {"n": 1, "attempt": 1}
        await eventually(stream_empty(client, settings), timeout=30)
        rec = await ref.status()
    assert runs == [ref.task_id]
    assert [(a.n, a.outcome) for a in rec.attempts] == [(1, "succeeded")]
    assert agent.task_stats.redelivered == 0


# -- typed payloads --------------------------------------------------------------------------


class Order(msgspec.Struct):
    item: str
    qty: int


async def test_a_typed_task_serves_its_struct_and_fails_a_bad_shape_once(settings: ReachSettings):
    runs: list[Order] = []
    agent = Agent("typed", settings=settings)

    @agent.task("typed.op", max_attempts=3)
    async def op(order: Order, ctx: reach.TaskContext) -> dict[str, Any]:
        runs.append(order)
        return {"item": order.item, "double": order.qty * 2}

    async with agent, Client(settings=settings) as client:
        good = await client.submit("typed.op", {"item": "pen", "qty": 2})
        assert await good.result(timeout=30) == {"item": "pen", "double": 4}
        bad = await client.submit("typed.op", {"item": "pen", "qty": "many"})
        with pytest.raises(reach.BadRequest) as info:
            await bad.result(timeout=30)
        rec = await bad.status()

        async def dead_lettered() -> bool:
            return [d.task_id for d in await client.dead_letters()] == [bad.task_id]

        await eventually(dead_lettered, timeout=30)
        [dl] = await client.dead_letters()
    assert runs == [Order("pen", 2)]  # the bad payload never reached the handler
    assert info.value.code == "bad_request"
    assert rec.state is S.FAILED
    assert rec.error is not None
    assert rec.error.code == "bad_request"
    assert [(a.n, a.outcome) for a in rec.attempts] == [(1, "failed")]  # no retry
    assert dl.reason == "bad_request"
    assert agent.task_stats.retried == 0


# -- cancel ----------------------------------------------------------------------------------


def cancellable_agent(
    settings: ReachSettings, entered: asyncio.Event, cancelled: list[str]
) -> Agent:
    agent = Agent("cancellable", settings=settings)

    @agent.task("stop.op")
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(ctx.task_id)
            raise

    return agent


def recorded_running(ref: reach.TaskRef) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await ref.status()).state is S.RUNNING

    return check


async def test_cancelling_a_running_task_twice_cancels_its_handler_once(settings: ReachSettings):
    entered, cancelled = asyncio.Event(), []
    agent = cancellable_agent(settings, entered, cancelled)
    async with agent, Client(settings=settings) as client:
        ref = await client.submit("stop.op", {})
        await asyncio.wait_for(entered.wait(), 30)
        await eventually(recorded_running(ref), timeout=30)
        first = await ref.cancel()
        second = await ref.cancel()  # the handler may be stopping, or stopped: no error
        assert first.cancel_requested
        assert second.cancel_requested
        with pytest.raises(reach.Cancelled):
            await ref.result(timeout=30)
        third = await ref.cancel()  # after the end: the final record, unchanged
        await eventually(lambda: agent.task_stats.running == 0, timeout=30)
    assert third.state is S.CANCELLED
    assert cancelled == [ref.task_id]
    assert [a.outcome for a in third.attempts] == ["cancelled"]
    assert [h.state for h in third.history].count(S.CANCELLED) == 1
    assert agent.task_stats.cancelled == 1


async def test_a_cancel_whose_broadcast_is_missed_is_caught_by_the_record_check(
    settings: ReachSettings,
):
    """Only the record says cancel (the broadcast on reach.taskctl.cancel never reaches
    the agent): the lease loop's look at the record, every ack_wait/3, stops the task."""
    entered, cancelled = asyncio.Event(), []
    agent = cancellable_agent(settings, entered, cancelled)
    async with agent, Client(settings=settings) as client:
        ref = await client.submit("stop.op", {})
        await asyncio.wait_for(entered.wait(), 30)
        await eventually(recorded_running(ref), timeout=30)
        flagged = await cancel_record(client._tasks.store, ref.task_id)  # no broadcast
        assert flagged.state is S.RUNNING
        assert flagged.cancel_requested
        rec = await ref.wait(timeout=30)
    assert rec.state is S.CANCELLED
    assert cancelled == [ref.task_id]
    assert [a.outcome for a in rec.attempts] == ["cancelled"]


# -- deduplication by task id ----------------------------------------------------------------


async def test_a_task_published_twice_under_one_id_is_stored_and_run_once(
    settings: ReachSettings,
):
    runs: list[str] = []
    async with Client(settings=settings) as client:
        tasks = client._tasks
        store = await tasks.ready(client.nc)
        sub = tasks.spec(
            "dedup.op",
            {"n": 3},
            priority="normal",
            timeout=None,
            max_attempts=None,
            idempotency_key=None,
            callback=None,
            required_tags=(),
            version=None,
        )
        seq = await publish_task(store, sub)
        assert await publish_task(store, sub) == seq  # the server's answer: a duplicate
        again = await tasks.submit(client.nc, sub)  # a submit tried again with its id
        assert again.task_id == sub.task_id
        info = await client.nc.jetstream().stream_info(task_stream(settings))
        assert (info.state.messages, info.state.last_seq) == (1, seq)
        async with counting_agent(settings, "dedup", "dedup.op", runs) as agent:
            assert await again.result(timeout=30) == {"n": 6, "attempt": 1}
            await eventually(lambda: agent.task_stats.running == 0, timeout=30)
        info = await client.nc.jetstream().stream_info(task_stream(settings))
    assert runs == [sub.task_id]
    assert info.state.messages == 0


# -- storage of streams and buckets ----------------------------------------------------------


async def test_task_streams_and_buckets_are_stored_as_documented(reach_settings: ReachSettings):
    settings = reach_settings.model_copy(
        update={"dlq_retention": 3 * 86400.0, "task_ack_wait": 7.0}
    )
    async with (
        Registry(settings=settings),
        counting_agent(settings, "stored", "store.op", []),
        Client(settings=settings) as client,
    ):
        js = client.nc.jetstream()
        prefix = settings.subject_prefix
        upper = prefix.upper()
        tasks = (await js.stream_info(f"{upper}_TASKS")).config
        assert (tasks.retention, tasks.storage) == (RetentionPolicy.WORK_QUEUE, StorageType.FILE)
        dlq = (await js.stream_info(f"{upper}_DLQ")).config
        assert (dlq.storage, dlq.max_age) == (StorageType.FILE, settings.dlq_retention)
        events = (await js.stream_info(f"{upper}_TASK_EVENTS")).config
        assert events.storage == StorageType.FILE
        for bucket, storage in (
            ("tasks", StorageType.FILE),
            ("idem", StorageType.FILE),
            ("agents", StorageType.MEMORY),
        ):
            config = (await js.stream_info(f"KV_{prefix}_{bucket}")).config
            assert (bucket, config.storage) == (bucket, storage)  # the bucket in a failure
        consumer = await js.consumer_info(
            f"{upper}_TASKS", consumer_name("store.op", Priority.HIGH)
        )
        assert consumer.config.ack_wait == settings.task_ack_wait
        assert consumer.config.max_deliver == settings.task_max_deliver
