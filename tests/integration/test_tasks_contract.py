"""Durable-task promises an audit found unproven, on a real nats-server: typed payloads,
cancel twice and cancel through the record alone, one message per task id, and the
storage of every stream and bucket."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
from nats.js.api import RetentionPolicy, StorageType

import reach
from reach import Agent, Client, ReachSettings, Registry, TaskState
from reach._tasks.refs import cancel_record
from reach._tasks.store import consumer_name
from reach._tasks.submit import publish_task
from reach.testing import eventually
from reach.wire import Priority

from .task_helpers import counting_agent, task_stream

S = TaskState


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_ack_wait": 2.0, "task_retry_base": 0.05})


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
