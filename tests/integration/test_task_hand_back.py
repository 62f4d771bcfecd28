"""Handing a task back spends none of its deliveries (issue 20, reproduction 4): an
instance without the required tag, a busy idempotency claim and a drain each put a task
back, and JetStream counts every put-back toward ``max_deliver``. On the last delivery
the task is put back as a new message instead, so waiting for the right instance never
dead-letters a task that has not run (one whose deliveries run out without a run says so:
``test_task_recovery.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

import reach
from reach import Agent, Client, ReachSettings, Registry, TaskState
from reach._codec import now_ms
from reach._tasks.states import advance
from reach._tasks.store import TaskStore, pending_record
from reach.testing import eventually
from reach.wire import Priority, TaskSubmit
from reach.wire.tasks import TaskAttempt

from .task_helpers import task_stream

CAP = "gpu.render"
S = TaskState


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    """Few deliveries, so the old code dead-letters a waiting task within seconds."""
    return reach_settings.model_copy(
        update={
            "task_ack_wait": 1.0,
            "task_max_deliver": 3,
            "task_max_attempts": 2,
            "task_retry_base": 0.05,
            "task_retry_cap": 0.1,
            "task_sweep_interval": 0.5,
        }
    )


def echo_agent(settings: ReachSettings, name: str, **kw: Any) -> Agent:
    agent = Agent(name, settings=settings, **kw)

    @agent.task(CAP)
    async def render(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        return {**payload, "by": ctx.agent_id, "attempt": ctx.attempt}

    return agent


def hanging_agent(settings: ReachSettings, name: str, entered: asyncio.Event) -> Agent:
    """Its handler runs until a drain cancels it."""
    agent = Agent(name, settings=settings, drain_timeout=0.1)

    @agent.task(CAP)
    async def render(payload: dict[str, Any]) -> None:
        entered.set()
        await asyncio.Event().wait()

    return agent


def handed_back(*agents: Agent) -> int:
    return sum(getattr(a.task_stats, "handed_back", 0) for a in agents)


def requeued(*agents: Agent) -> int:
    return sum(getattr(a.task_stats, "requeued", 0) for a in agents)


async def test_a_task_waiting_for_a_tagged_instance_runs_when_it_starts(settings: ReachSettings):
    """Two untagged instances hand a task needing ``gpu`` back many times more than
    JetStream delivers one message; it is neither failed nor dead-lettered, and the gpu
    instance started later runs it."""
    plain = [echo_agent(settings, f"plain{i}") for i in range(2)]
    gpu = echo_agent(settings, "gpu", tags=["gpu"])
    async with Registry(settings=settings) as registry, plain[0], plain[1]:
        async with Client(settings=settings) as client:
            ref = await client.submit(CAP, {"n": 1}, required_tags=["gpu"])
            wanted = 3 * settings.task_max_deliver
            await eventually(
                lambda: handed_back(*plain) >= wanted or registry.stats.max_deliveries > 0,
                timeout=60,
            )
            assert registry.stats.max_deliveries == 0
            assert (await ref.status()).state is S.PENDING
            assert requeued(*plain) >= 2
            async with gpu:
                result = await ref.result(timeout=30)
            assert result == {"n": 1, "by": gpu.agent_id, "attempt": 1}
            assert await client.dead_letters() == []
            info = await client.nc.jetstream().stream_info(task_stream(settings))
            assert info.state.messages == 0


async def test_a_task_waiting_for_its_key_spends_no_deliveries(settings: ReachSettings):
    """A second task with the same idempotency key waits while the first runs, however
    long: its busy claim puts it back without using up its deliveries."""
    release = asyncio.Event()
    ran: list[str] = []
    agent = Agent("keyed", settings=settings)

    @agent.task(CAP)
    async def render(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        ran.append(ctx.task_id)
        if payload["n"] == 1:
            await release.wait()
        return payload

    async with Registry(settings=settings) as registry, agent, Client(settings=settings) as client:
        a = await client.submit(CAP, {"n": 1}, idempotency_key="frame-3")
        await eventually(lambda: ran == [a.task_id], timeout=30)
        twin = TaskSubmit(
            task_id="twinTask2", capability=CAP, payload=b'{"n": 2}', idempotency_key="frame-3"
        )
        subject = f"{settings.subject_prefix}.task.twinTask2.{CAP}.normal"
        await client.nc.jetstream().publish(
            subject, msgspec.json.encode(twin), headers={"Nats-Msg-Id": "twinTask2"}
        )
        b = await client.task("twinTask2")
        wanted = 3 * settings.task_max_deliver
        try:
            await eventually(
                lambda: agent.task_stats.claim_busy >= wanted or registry.stats.max_deliveries > 0,
                timeout=60,
            )
            assert registry.stats.max_deliveries == 0
            assert ran == [a.task_id]
        finally:
            release.set()
        assert await a.result(timeout=30) == {"n": 1}
        assert await b.result(timeout=30) == {"n": 2}
        assert await client.dead_letters() == []


async def test_drains_in_a_row_do_not_dead_letter_a_task(settings: ReachSettings):
    """A rolling deploy drains the instance running a task as many times as JetStream
    delivers one message; the instance after the last drain finishes it."""
    drains = settings.task_max_deliver
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        ref = None
        for i in range(drains):
            entered = asyncio.Event()
            agent = hanging_agent(settings, f"rolling{i}", entered)
            async with agent:
                if ref is None:
                    ref = await client.submit(CAP, {"n": 1}, max_attempts=1)
                await asyncio.wait_for(entered.wait(), 30)
        assert ref is not None
        last = echo_agent(settings, "last")
        async with last:
            assert (await ref.result(timeout=30))["by"] == last.agent_id
        rec = await ref.status()
        assert [a.outcome for a in rec.attempts] == ["drained"] * drains + ["succeeded"]
        assert registry.stats.max_deliveries == 0
        assert await client.dead_letters() == []


async def test_a_requeued_task_runs_while_its_old_message_is_still_held(
    settings: ReachSettings,
):
    """Between publishing the new message and acking the old one, another agent may take
    the new one. The record still names the old message, which is still there; the new one
    is the task's own all the same (``Reach-Requeued-From``), not a duplicate to drop."""
    slow = settings.model_copy(update={"task_ack_wait": 30.0})  # the old one stays held
    async with Client(settings=slow) as client:
        ref = await client.submit(CAP, {"n": 1})
        js = client.nc.jetstream()
        store = TaskStore(js, client.subjects, slow)
        name = await store.ensure_consumer(CAP, Priority.NORMAL)
        psub = await js.pull_subscribe_bind(name, task_stream(slow))
        try:
            [old] = await psub.fetch(1, timeout=10)  # held, as by the agent putting it back
            seq = old.metadata.sequence.stream
            # the task ran once before: its record names the old message
            at = now_ms()
            ran = TaskAttempt(n=1, agent_id="gone-1", started_ms=at, ended_ms=at, outcome="failed")
            sub = msgspec.json.decode(old.data, type=TaskSubmit)
            rec = advance(
                pending_record(sub, seq, at),
                [S.RUNNING, S.RETRYING],
                at,
                attempt=1,
                max_attempts=3,
                attempts=[ran],
            )
            await store.write(rec, 0)
            headers = {k: v for k, v in (old.headers or {}).items() if not k.startswith("Nats-")}
            headers |= {"Nats-Msg-Id": f"{ref.task_id}.q{seq}", "Reach-Requeued-From": str(seq)}
            await js.publish(old.subject, old.data, headers=headers)
            taker = echo_agent(slow, "taker")
            async with taker:
                stats = taker.task_stats
                await eventually(lambda: stats.duplicates + stats.succeeded > 0, timeout=30)
                assert (stats.duplicates, stats.succeeded) == (0, 1)
                await old.ack_sync()  # as the agent that put it back does
                assert (await ref.result(timeout=30))["attempt"] == 2
        finally:
            await psub.unsubscribe()
