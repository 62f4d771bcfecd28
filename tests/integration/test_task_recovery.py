"""The registry's task recovery: max-deliveries advisories and the sweep, on a real server."""

import asyncio

import nats.js.errors
import pytest

from reach import Agent, Client, Registry, TaskState
from reach._codec import now_ms
from reach._tasks.store import TaskStore
from reach.testing import eventually
from reach.wire.tasks import TaskAttempt, TaskRecord, TaskStep

CAP = "report.build"


@pytest.fixture
def settings(reach_settings):
    return reach_settings.model_copy(
        update={
            "task_ack_wait": 2.0,
            "task_max_deliver": 2,
            "task_retry_base": 0.05,
            "task_retry_cap": 0.1,
            "task_sweep_interval": 0.2,
        }
    )


def doubling_agent(settings, **kwargs):
    agent = Agent("builder", settings=settings, **kwargs)

    @agent.task(CAP)
    async def build(payload: dict, ctx) -> dict:
        return {"n": payload["n"] * 2, "attempt": ctx.attempt}

    return agent


def task_stream(settings) -> str:
    return f"{settings.subject_prefix.upper()}_TASKS"


async def test_a_task_no_agent_takes_reaches_max_deliveries_and_goes_to_the_dlq(settings):
    """The only agent lacks the tag the task requires: it hands the message back each time,
    JetStream stops after task_max_deliver deliveries, and a registry moves the message
    to the DLQ and fails the task, so neither waits for ever."""
    agent = doubling_agent(settings, tags=["cpu"])
    async with Registry(settings=settings) as registry, agent, Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 1}, required_tags=["gpu"])
        rec = await ref.wait(timeout=60)
        assert rec.state is TaskState.FAILED
        assert rec.error is not None
        assert rec.error.message == "max deliveries reached"

        await eventually(lambda: registry.stats.max_deliveries == 1, timeout=30)
        [dl] = await client.dead_letters()
        assert (dl.task_id, dl.reason, dl.kind) == (ref.task_id, "max_deliveries", "task")
        with pytest.raises(nats.js.errors.NotFoundError):
            await client.nc.jetstream().get_msg(task_stream(settings), seq=rec.seq)
        assert agent.task_stats.started == 0


async def test_two_registries_move_each_task_to_the_dlq_once(settings):
    agent = doubling_agent(settings, tags=["cpu"])
    async with (
        Registry(settings=settings) as r1,
        Registry(settings=settings) as r2,
        agent,
        Client(settings=settings) as client,
    ):
        refs = [await client.submit(CAP, {"n": i}, required_tags=["gpu"]) for i in range(4)]
        for ref in refs:
            assert (await ref.wait(timeout=60)).state is TaskState.FAILED

        await eventually(lambda: r1.stats.max_deliveries + r2.stats.max_deliveries == 4, timeout=30)
        assert sorted(d.task_id for d in await client.dead_letters()) == sorted(
            r.task_id for r in refs
        )
        for ref in refs:
            steps = [s.state for s in (await ref.status()).history]
            assert steps.count(TaskState.FAILED) == 1


async def test_sweep_recovers_a_running_task_of_a_vanished_agent_whose_message_is_gone(
    settings,
):
    """A RUNNING record of an agent that has no lease and whose message is gone (the state
    a crash plus a lost message leaves): the sweep returns it to RETRYING (attempt lost) and
    publishes it again, once; an agent started later finishes it."""
    async with Client(settings=settings) as client:
        store = TaskStore(client.nc.jetstream(), client.subjects, settings)
        await store.ensure()
        long_ago = now_ms() - 3_600_000
        record = TaskRecord(
            task_id="lostTask1",
            capability=CAP,
            state=TaskState.RUNNING,
            attempt=1,
            max_attempts=3,
            timeout=10.0,
            payload=b'{"n": 21}',
            agent_id="ghost-1",
            attempts=[TaskAttempt(n=1, agent_id="ghost-1", started_ms=long_ago)],
            history=[
                TaskStep(state=TaskState.PENDING, at_ms=long_ago),
                TaskStep(state=TaskState.RUNNING, at_ms=long_ago),
            ],
            seq=10_000_000,  # no such message
            submitted_ms=long_ago,
            updated_ms=long_ago,
        )
        await store.write(record, 0)
        ref = await client.task("lostTask1")
        async with Registry(settings=settings) as registry:

            async def retrying() -> bool:
                rec = await ref.status()
                return rec.state is TaskState.RETRYING and rec.seq != record.seq

            await eventually(retrying, timeout=30)
            rec = await ref.status()
            assert [(a.agent_id, a.outcome) for a in rec.attempts] == [("ghost-1", "lost")]
            await client.nc.jetstream().get_msg(task_stream(settings), seq=rec.seq)  # it is back
            assert registry.stats.tasks_recovered == 1
            async with doubling_agent(settings) as agent:
                assert await ref.result(timeout=30) == {"n": 42, "attempt": 2}
            rec = await ref.status()
            assert [(a.agent_id, a.outcome) for a in rec.attempts] == [
                ("ghost-1", "lost"),
                (agent.agent_id, "succeeded"),
            ]
            assert [s.state for s in rec.history] == [
                TaskState.PENDING,
                TaskState.RUNNING,
                TaskState.RETRYING,
                TaskState.RUNNING,
                TaskState.SUCCEEDED,
            ]
            assert registry.stats.tasks_recovered == 1


async def test_sweep_leaves_running_and_waiting_tasks_alone(settings):
    hold, started = asyncio.Event(), asyncio.Event()
    agent = Agent("slowpoke", settings=settings)

    @agent.task(CAP)
    async def build(payload: dict) -> dict:
        started.set()
        await hold.wait()
        return payload

    async with Registry(settings=settings) as registry, agent, Client(settings=settings) as client:
        running = await client.submit(CAP, {"n": 1})
        await asyncio.wait_for(started.wait(), 30)
        waiting = await client.submit("report.nobody", {"n": 2})
        before = registry.stats.sweeps

        async def swept_thrice() -> bool:
            return registry.stats.sweeps >= before + 3

        await eventually(swept_thrice, timeout=30)
        assert registry.stats.tasks_recovered == 0
        assert registry.stats.recovery_errors == 0
        rec = await running.status()
        assert (rec.state, rec.attempt, rec.agent_id) == (TaskState.RUNNING, 1, agent.agent_id)
        assert (await waiting.status()).state is TaskState.PENDING
        hold.set()
        assert await running.result(timeout=30) == {"n": 1}


async def test_recovery_is_off_with_tasks_false_and_sweeps_off_with_interval_zero(settings):
    no_sweeps = settings.model_copy(update={"task_sweep_interval": 0})
    async with (
        Registry(settings=settings, tasks=False) as off,
        Registry(settings=no_sweeps) as advisories_only,
        Registry(settings=settings) as on,
    ):
        await eventually(lambda: on.stats.sweeps >= 3, timeout=30)
        assert off.stats.sweeps == 0
        assert advisories_only.stats.sweeps == 0
