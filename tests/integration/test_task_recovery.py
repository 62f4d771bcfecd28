"""The registry's task recovery: max-deliveries advisories and the sweep, on a real server."""

import asyncio

import msgspec
import nats.errors
import nats.js.errors
import pytest

from reach import Agent, Client, Registry, TaskState
from reach._codec import now_ms
from reach._tasks.dlq import dead_letter
from reach._tasks.store import TaskStore
from reach.testing import eventually
from reach.wire import Priority
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


def dlq_stream(settings) -> str:
    return f"{settings.subject_prefix.upper()}_DLQ"


def lost_record(task_id: str, seq: int = 10_000_000) -> TaskRecord:
    """A RUNNING record of an agent that is gone, unchanged for an hour, whose message
    (``seq``: none such) is gone too: what a crash plus a lost store leaves."""
    long_ago = now_ms() - 3_600_000
    return TaskRecord(
        task_id=task_id,
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
        seq=seq,
        submitted_ms=long_ago,
        updated_ms=long_ago,
    )


async def die_holding(client: Client, settings, tasks: int = 1) -> None:
    """What agents that die holding a task before they begin it do to ``tasks`` waiting
    tasks: every delivery spent, none run (naks here, to be quick). An agent that cannot
    run a task spends none (``test_task_hand_back.py``): this is the one way left. Then one
    more pull, at which JetStream finds max deliveries reached and announces it."""
    js = client.nc.jetstream()
    name = await TaskStore(js, client.subjects, settings).ensure_consumer(CAP, Priority.NORMAL)
    psub = await js.pull_subscribe_bind(name, task_stream(settings))
    try:
        spent = 0
        while spent < tasks * settings.task_max_deliver:
            for msg in await psub.fetch(tasks, timeout=10):
                await msg.nak()
                spent += 1
        with pytest.raises(nats.errors.TimeoutError):
            await psub.fetch(1, timeout=1)
    finally:
        await psub.unsubscribe()


async def test_a_task_whose_deliveries_run_out_unrun_goes_to_the_dlq_saying_it_never_ran(
    settings,
):
    """JetStream stops after task_max_deliver deliveries, and a registry moves the message
    to the DLQ and fails the task, so neither waits for ever; the letter says it never ran.
    (A task no agent can run, for want of a tag, is not this: it waits, spending none.)"""
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 1})
        await die_holding(client, settings)
        rec = await ref.wait(timeout=60)
        assert rec.state is TaskState.FAILED
        assert rec.attempts == []
        assert rec.error is not None
        assert rec.error.message == "max deliveries reached"

        await eventually(lambda: registry.stats.max_deliveries == 1, timeout=30)
        [dl] = await client.dead_letters()
        assert (dl.task_id, dl.reason, dl.kind) == (ref.task_id, "max_deliveries", "task")
        assert dl.error.endswith("; it never ran")
        with pytest.raises(nats.js.errors.NotFoundError):
            await client.nc.jetstream().get_msg(task_stream(settings), seq=rec.seq)


async def test_two_registries_move_each_task_to_the_dlq_once(settings):
    async with (
        Registry(settings=settings) as r1,
        Registry(settings=settings) as r2,
        Client(settings=settings) as client,
    ):
        refs = [await client.submit(CAP, {"n": i}) for i in range(4)]
        await die_holding(client, settings, len(refs))
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
                # sequence 0: announced in the record, not published yet
                return rec.state is TaskState.RETRYING and rec.seq not in (0, record.seq)

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
    """Sweeps made after every record has been quiet for lease_ttl + task_ack_wait still
    leave alone a task running on a live agent, a task waiting out its retry backoff
    (RETRYING: its message held back in the stream) and one no agent serves (PENDING)."""
    quick = settings.model_copy(
        update={
            "lease_ttl": 1.0,
            "heartbeat_interval": 0.3,
            "task_ack_wait": 1.0,
            "task_retry_base": 3600.0,
            "task_retry_cap": 3600.0,
        }
    )
    hold, started = asyncio.Event(), asyncio.Event()
    agent = Agent("slowpoke", settings=quick)

    @agent.task(CAP)
    async def build(payload: dict) -> dict:
        if payload["n"] == 1:
            started.set()
            await hold.wait()
        else:
            await asyncio.Event().wait()  # overruns its timeout: retried in an hour
        return payload

    async with Registry(settings=quick) as registry, agent, Client(settings=quick) as client:
        running = await client.submit(CAP, {"n": 1})
        backing_off = await client.submit(CAP, {"n": 2}, timeout=0.5)
        waiting = await client.submit("report.nobody", {"n": 3})
        await asyncio.wait_for(started.wait(), 30)

        async def settled() -> bool:
            a, b = await running.status(), await backing_off.status()
            return a.state is TaskState.RUNNING and b.state is TaskState.RETRYING

        await eventually(settled, timeout=30)
        await eventually(lambda: agent.agent_id in registry.records(), timeout=30)
        newest = max((await running.status()).updated_ms, (await backing_off.status()).updated_ms)
        quiet_ms = (quick.lease_ttl + quick.task_ack_wait) * 1000
        await eventually(lambda: now_ms() - newest > quiet_ms, timeout=30)
        before = registry.stats.sweeps

        async def swept_thrice() -> bool:
            return registry.stats.sweeps >= before + 3

        await eventually(swept_thrice, timeout=30)
        assert registry.stats.tasks_recovered == 0
        assert registry.stats.recovery_errors == 0
        rec = await running.status()
        assert (rec.state, rec.attempt, rec.agent_id) == (TaskState.RUNNING, 1, agent.agent_id)
        rec = await backing_off.status()
        assert (rec.state, rec.attempt) == (TaskState.RETRYING, 1)
        assert (await waiting.status()).state is TaskState.PENDING
        hold.set()
        assert await running.result(timeout=30) == {"n": 1}


async def test_recovery_is_off_with_tasks_false_and_sweeps_off_with_interval_zero(settings):
    no_sweeps = settings.model_copy(update={"task_sweep_interval": 0})
    async with (
        Registry(settings=settings, tasks=False) as off,
        Registry(settings=no_sweeps) as advisories_only,
        Registry(settings=settings) as on,
        Client(settings=settings) as client,
    ):
        assert on.stats.sweeps == 0  # no task used under this prefix: nothing to sweep
        await client.submit("report.nobody", {})  # tasks are used from now on
        await eventually(lambda: on.stats.sweeps >= 3, timeout=30)
        assert off.stats.sweeps == 0
        assert advisories_only.stats.sweeps == 0


# -- max deliveries, caught even when no registry listens ------------------------------------


async def test_max_deliveries_reached_while_no_registry_runs_is_handled_by_a_later_one(settings):
    """The advisory is kept in a stream of our own: a registry started after the message
    reached max deliveries still fails the task and moves it to the DLQ."""
    async with Client(settings=settings) as client:
        advised = asyncio.Event()

        async def on_advisory(msg) -> None:
            advised.set()

        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{task_stream(settings)}.>"
        await client.nc.subscribe(subject, cb=on_advisory)
        await client.nc.flush()
        ref = await client.submit(CAP, {"n": 1})
        await die_holding(client, settings)
        await asyncio.wait_for(advised.wait(), 30)
        assert (await ref.status()).state is TaskState.PENDING

        async with Registry(settings=settings) as registry:
            rec = await ref.wait(timeout=30)
            assert rec.state is TaskState.FAILED
            assert rec.error is not None
            assert rec.error.message == "max deliveries reached"
            await eventually(lambda: registry.stats.max_deliveries == 1, timeout=30)
        [dl] = await client.dead_letters()
        assert (dl.task_id, dl.reason) == (ref.task_id, "max_deliveries")
        info = await client.nc.jetstream().stream_info(task_stream(settings))
        assert info.state.messages == 0


async def test_a_dead_letter_that_could_not_be_stored_is_stored_on_a_later_try(settings):
    """The DLQ stream is missing when the task reaches max deliveries: the advisory is
    handled again (not dropped) until the dead letter is stored and the message removed."""
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        js = client.nc.jetstream()
        await client.list_tasks()  # the task streams exist
        config = (await js.stream_info(dlq_stream(settings))).config
        await js.delete_stream(dlq_stream(settings))
        ref = await client.submit(CAP, {"n": 1})
        await die_holding(client, settings)
        assert (await ref.wait(timeout=30)).state is TaskState.FAILED
        await eventually(lambda: registry.stats.recovery_errors >= 1, timeout=30)
        assert registry.stats.max_deliveries == 0
        await js.add_stream(config)

        async def stored() -> bool:
            return len(await client.dead_letters()) == 1

        await eventually(stored, timeout=30)
        await eventually(lambda: registry.stats.max_deliveries == 1, timeout=30)
        [dl] = await client.dead_letters()
        assert (dl.task_id, dl.reason) == (ref.task_id, "max_deliveries")
        assert (await js.stream_info(task_stream(settings))).state.messages == 0


async def test_the_agent_and_the_registry_store_one_dead_letter_per_task_and_attempts(settings):
    """An agent dead-letters a failed task (no stream sequence); the registry's
    max-deliveries handler may do it again for the same attempts (with the message's
    sequence): the stream keeps one letter."""
    async with Client(settings=settings) as client:
        store = TaskStore(client.nc.jetstream(), client.subjects, settings)
        await store.ensure()
        attempts = lost_record("deadTask1").attempts
        for seq in (0, 42):
            await dead_letter(
                store,
                capability=CAP,
                task_id="deadTask1",
                data=b'{"n": 1}',
                headers={},
                reason="max_deliveries",
                error="delivered 2 times",
                attempts=attempts,
                seq=seq,
            )
        [dl] = await client.dead_letters()
        assert dl.task_id == "deadTask1"


# -- the sweep -------------------------------------------------------------------------------


async def test_sweep_leaves_a_long_task_of_a_live_unregistered_agent_alone(settings):
    """An agent that holds no lease (it started before any registry and has not registered
    yet) runs a task for longer than lease_ttl + task_ack_wait while a registry sweeps: its
    message is still in the stream, so the sweep leaves it alone and it succeeds on its
    first attempt."""
    quick = settings.model_copy(update={"lease_ttl": 0.5, "task_ack_wait": 1.0})
    unregistered = quick.model_copy(
        update={"heartbeat_interval": 3600.0, "register_backoff": 1e6, "register_backoff_max": 1e6}
    )
    hold, started = asyncio.Event(), asyncio.Event()
    agent = Agent("lonely", settings=unregistered)

    @agent.task(CAP)
    async def build(payload: dict, ctx) -> dict:
        started.set()
        await hold.wait()
        return {"attempt": ctx.attempt}

    async with agent, Client(settings=quick) as client:
        ref = await client.submit(CAP, {"n": 1})
        await asyncio.wait_for(started.wait(), 30)

        async def running() -> bool:
            return (await ref.status()).state is TaskState.RUNNING

        await eventually(running, timeout=30)
        written = (await ref.status()).updated_ms
        quiet_ms = (quick.lease_ttl + quick.task_ack_wait) * 1000
        async with Registry(settings=quick) as registry:
            await eventually(lambda: now_ms() - written > quiet_ms, timeout=30)
            before = registry.stats.sweeps
            await eventually(lambda: registry.stats.sweeps >= before + 3, timeout=30)
            assert agent.agent_id not in registry.records()
            assert (await ref.status()).state is TaskState.RUNNING
            hold.set()
            assert await ref.result(timeout=30) == {"attempt": 1}
            assert registry.stats.tasks_recovered == 0
        rec = await ref.status()
        assert [s.state for s in rec.history] == [
            TaskState.PENDING,
            TaskState.RUNNING,
            TaskState.SUCCEEDED,
        ]
        assert [(a.agent_id, a.outcome) for a in rec.attempts] == [(agent.agent_id, "succeeded")]


async def test_a_republished_message_follows_the_record_that_announces_it(settings):
    """The sweep writes the record (RETRYING, no message sequence yet) before it publishes
    the task's new message, so an agent that takes the message at once never reads the old,
    gone sequence in the record (and never drops the message as a duplicate)."""
    async with Client(settings=settings) as client:
        store = TaskStore(client.nc.jetstream(), client.subjects, settings)
        await store.ensure()
        lost = lost_record("lostTask2")
        await store.write(lost, 0)
        key = f"$KV.{store.bucket}.lostTask2"
        task_subject = f"{settings.subject_prefix}.task.lostTask2."
        seen: list[TaskRecord | None] = []  # None: the new task message
        published = asyncio.Event()

        async def on_msg(msg) -> None:
            # one subscription for both subjects: the registry's writes arrive in its order
            if msg.subject == key and msg.data:
                seen.append(msgspec.json.decode(msg.data, type=TaskRecord))
            elif msg.subject.startswith(task_subject):
                seen.append(None)
                published.set()

        await client.nc.subscribe(">", cb=on_msg)
        await client.nc.flush()
        async with Registry(settings=settings):
            await asyncio.wait_for(published.wait(), 30)
        announced = seen[: seen.index(None)]
        assert announced, "no record written before the message"
        last = announced[-1]
        assert last is not None
        assert last.state is TaskState.RETRYING
        assert last.seq != lost.seq


async def test_one_registry_of_two_sweeps_per_interval(settings):
    hourly = settings.model_copy(update={"task_sweep_interval": 3600.0})
    async with Client(settings=settings) as client:
        await client.submit("report.nobody", {})  # tasks are used under this prefix
    async with Registry(settings=hourly) as r1, Registry(settings=hourly) as r2:

        def tried() -> int:
            return sum(r.stats.sweeps + r.stats.sweeps_skipped for r in (r1, r2))

        await eventually(lambda: tried() == 2, timeout=30)
        assert sorted([r1.stats.sweeps, r2.stats.sweeps]) == [0, 1]
        assert sorted([r1.stats.sweeps_skipped, r2.stats.sweeps_skipped]) == [0, 1]
