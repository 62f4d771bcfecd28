"""The durable-task promises of sdk/PROTOCOL.md section 8.8, on a real nats-server, for the
records: each test is named after the promise it holds to, and each failed on the code
before issue 20's fixes.

- A CANCELLED task never starts a run (its message leaves the work queue with the cancel,
  so a record that expires later cannot bring it back).
- A task is dead-lettered only after a run, or with a reason that says it never ran
  (``undecodable`` for a record that does not decode).
- No task stays non-final without progress: a record that does not decode is replaced, a
  message whose max-deliveries advisory was lost is found by the sweep, a cancelled task
  whose agent vanished is ended, and a run longer than the record's retention keeps its
  record (a timeout longer than the retention is refused where it is set).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

import reach
from reach import Agent, Client, ReachSettings, Registry, TaskNotFound, TaskState, Telemetry
from reach._background import Background
from reach._codec import now_ms
from reach._tasks.recovery import TaskRecovery
from reach._tasks.refs import cancel_record
from reach._tasks.states import advance
from reach._tasks.store import TaskStore, pending_record
from reach.testing import eventually
from reach.wire import Priority
from reach.wire.tasks import TaskAttempt, TaskRecord, TaskStep, TaskSubmit

from .task_helpers import stream_empty, task_stream

S = TaskState
CAP = "promise.op"
JUNK = b"\x00 not a record"
#: what a newer Reach could write: a state this one does not know
NEWER = msgspec.json.encode(
    {"type": "reach.task.record", "task_id": "x", "capability": CAP, "state": "ARCHIVED"}
)


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(
        update={
            "task_ack_wait": 1.0,
            "task_max_deliver": 2,
            "task_max_attempts": 1,
            "task_retry_base": 0.05,
            "task_retry_cap": 0.1,
            "task_sweep_interval": 0.2,
        }
    )


async def ready_store(client: Client, settings: ReachSettings) -> TaskStore:
    store = TaskStore(client.nc.jetstream(), client.subjects, settings)
    await store.ensure()
    return store


async def put_raw_record(
    client: Client, settings: ReachSettings, task_id: str, data: bytes
) -> None:
    """Store bytes as the task's record, as a bug, a disk fault or a newer Reach could."""
    bucket = f"{settings.subject_prefix}_tasks"
    await client.nc.jetstream().publish(f"$KV.{bucket}.{task_id}", data)


def events_stream(settings: ReachSettings) -> str:
    return settings.subject_prefix.upper() + "_TASK_EVENTS"


async def message_seq(client: Client, settings: ReachSettings, task_id: str) -> int:
    raw = await client.nc.jetstream().get_msg(
        task_stream(settings), subject=client.subjects.task_lookup(task_id), direct=True
    )
    return int(raw.seq or 0)


async def exhaust_deliveries(client: Client, settings: ReachSettings, store: TaskStore) -> None:
    """Take the task's message ``task_max_deliver`` times and never ack it (an agent that
    dies holding it, each time), until JetStream gives up on it and says so in a
    max-deliveries advisory; returns once that advisory is stored in the events stream."""
    js = client.nc.jetstream()
    advised = asyncio.Event()

    async def on_advisory(msg: Any) -> None:
        advised.set()

    subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{task_stream(settings)}.>"
    watch = await client.nc.subscribe(subject, cb=on_advisory)
    await client.nc.flush()
    name = await store.ensure_consumer(CAP, Priority.NORMAL)
    psub = await js.pull_subscribe_bind(name, task_stream(settings))
    deliveries: list[int] = []

    async def pull_until_given_up() -> None:
        while not advised.is_set():
            try:
                msgs = await psub.fetch(1, timeout=1.5)
            except TimeoutError:
                continue
            deliveries.extend(m.metadata.num_delivered for m in msgs)  # never acked

    try:
        await asyncio.wait_for(pull_until_given_up(), 30)
    finally:
        await psub.unsubscribe()
        await watch.unsubscribe()
    assert deliveries == [1, 2]

    async def stored() -> bool:
        return (await js.stream_info(events_stream(settings))).state.messages == 1

    await eventually(stored, timeout=10)


async def replaced(client: Client, task_id: str) -> bool:
    """Whether the task's record decodes again, and is final."""
    try:
        return (await client.task_record(task_id)).final
    except reach.CorruptRecord:
        return False


def ghost_record(task_id: str, **changes: Any) -> TaskRecord:
    """A RUNNING record of an agent that is gone, quiet for an hour, whose message is gone
    too: what a crash plus a lost message leaves."""
    long_ago = now_ms() - 3_600_000
    record = TaskRecord(
        task_id=task_id,
        capability=CAP,
        state=S.RUNNING,
        attempt=1,
        max_attempts=3,
        timeout=10.0,
        payload=b'{"n": 21}',
        agent_id="ghost-1",
        attempts=[TaskAttempt(n=1, agent_id="ghost-1", started_ms=long_ago)],
        history=[
            TaskStep(state=S.PENDING, at_ms=long_ago),
            TaskStep(state=S.RUNNING, at_ms=long_ago),
        ],
        seq=10_000_000,
        submitted_ms=long_ago,
        updated_ms=long_ago,
    )
    return msgspec.structs.replace(record, **changes)


# -- no task stays stuck on a record that does not decode -------------------------------------


@pytest.mark.parametrize("stored", [JUNK, NEWER], ids=["junk", "newer-state"])
async def test_a_record_that_does_not_decode_is_dead_lettered_undecodable_not_stuck(
    settings: ReachSettings, stored: bytes
):
    """The typed error while it is there (not the base ReachError); then the first agent
    that takes the task replaces the record with FAILED (``undecodable``), stores the dead
    letter with that reason, removes the message and counts it; the handler never runs."""
    runs: list[str] = []
    metrics = CollectorRegistry()
    agent = Agent("reader", settings=settings, telemetry=Telemetry(metrics))

    @agent.task(CAP)
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        runs.append(ctx.task_id)
        return payload

    async with Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 1})
        await put_raw_record(client, settings, ref.task_id, stored)
        with pytest.raises(reach.CorruptRecord) as info:
            await ref.status()
        assert (info.value.code, info.value.task_id) == ("corrupt_record", ref.task_id)
        assert "does not decode" in info.value.message
        with pytest.raises(reach.CorruptRecord):
            await client.task_record(ref.task_id)

        async with agent:
            await eventually(lambda: replaced(client, ref.task_id), timeout=30)
            await eventually(stream_empty(client, settings), timeout=30)  # its last step
            labels = {"agent": "reader"}
            count = metrics.get_sample_value("reach_agent_task_records_undecodable_total", labels)
            assert count == 1
        rec = await ref.status()
        assert rec.state is S.FAILED
        assert rec.error is not None
        assert rec.error.code == "undecodable"
        [dl] = await client.dead_letters()
        assert (dl.task_id, dl.reason, dl.kind) == (ref.task_id, "undecodable", "task")
        assert dl.submit().payload == b'{"n":1}'  # the message, so it can be replayed
        assert await stream_empty(client, settings)()
        assert runs == []
        assert (agent.task_stats.undecodable, agent.task_stats.started) == (1, 0)


async def test_a_record_that_does_not_decode_at_max_deliveries_is_dead_lettered_once(
    settings: ReachSettings,
):
    """The advisory of a task whose record does not decode is handled, not naked and
    retried for ever (the registry logged "a bug" every second)."""
    async with Client(settings=settings) as client:
        store = await ready_store(client, settings)
        ref = await client.submit(CAP, {"n": 1})
        await exhaust_deliveries(client, settings, store)
        await put_raw_record(client, settings, ref.task_id, JUNK)
        async with Registry(settings=settings) as registry:
            await eventually(lambda: replaced(client, ref.task_id), timeout=30)
            await eventually(lambda: registry.stats.max_deliveries == 1, timeout=30)
            assert registry.stats.recovery_errors == 0
        rec = await ref.status()
        assert rec.state is S.FAILED
        assert rec.error is not None
        assert rec.error.code == "undecodable"
        [dl] = await client.dead_letters()
        assert (dl.task_id, dl.reason) == (ref.task_id, "undecodable")
        assert await stream_empty(client, settings)()


async def test_a_record_that_does_not_decode_and_has_no_message_is_replaced_by_the_sweep(
    settings: ReachSettings,
):
    """No message will bring an agent: the sweep replaces the record and keeps what was
    stored in a dead letter (it does not crash on it, sweep after sweep)."""
    async with Client(settings=settings) as client:
        await ready_store(client, settings)
        await put_raw_record(client, settings, "corruptAlone1", JUNK)
        async with Registry(settings=settings) as registry:
            await eventually(lambda: replaced(client, "corruptAlone1"), timeout=30)
            assert registry.stats.background_failures == 0
        rec = await client.task_record("corruptAlone1")
        assert (rec.state, rec.error.code if rec.error else "") == (S.FAILED, "undecodable")
        [dl] = await client.dead_letters()
        assert (dl.task_id, dl.reason, dl.data) == ("corruptAlone1", "undecodable", JUNK)
        with pytest.raises(reach.NotReplayable):
            dl.submit()


# -- no task stays stuck because its max-deliveries advisory was lost --------------------------


@pytest.mark.parametrize("with_record", [False, True], ids=["message-only", "retrying-record"])
async def test_a_task_whose_max_deliveries_advisory_was_lost_is_found_by_the_sweep(
    settings: ReachSettings, with_record: bool
):
    """JetStream gave up on the message and its advisory never reached a registry (lost
    while the events stream changed leader): the sweep finds the message all the same, and
    the task ends FAILED, in the DLQ, its message removed."""
    async with Client(settings=settings) as client:
        store = await ready_store(client, settings)
        ref = await client.submit(CAP, {"n": 1})
        if with_record:
            sub = msgspec.json.decode(
                (
                    await client.nc.jetstream().get_msg(
                        task_stream(settings),
                        subject=client.subjects.task_lookup(ref.task_id),
                        direct=True,
                    )
                ).data,
                type=TaskSubmit,
            )
            seq = await message_seq(client, settings, ref.task_id)
            at = now_ms()
            first = TaskAttempt(
                n=1, agent_id="gone-1", started_ms=at, ended_ms=at, outcome="failed"
            )
            rec = advance(
                pending_record(sub, seq, at),
                [S.RUNNING, S.RETRYING],
                at,
                attempt=1,
                max_attempts=3,
                attempts=[first],
            )
            await store.write(rec, 0)
        await exhaust_deliveries(client, settings, store)
        await client.nc.jetstream().purge_stream(events_stream(settings))  # the advisory is lost

        async with Registry(settings=settings) as registry:
            rec = await ref.wait(timeout=30)
            assert rec.state is S.FAILED
            await eventually(lambda: registry.stats.max_deliveries == 1, timeout=30)
        assert rec.error is not None
        assert rec.error.message == "max deliveries reached"
        [dl] = await client.dead_letters()
        assert (dl.task_id, dl.reason) == (ref.task_id, "max_deliveries")
        assert await stream_empty(client, settings)()


async def test_the_sweep_leaves_alone_a_message_jetstream_still_delivers(
    settings: ReachSettings,
):
    """The other side of the lost-advisory search: a message delivered and not acked, but
    not given up (JetStream still counts it pending and will deliver it again), is left
    alone sweep after sweep; the sweep fails only what JetStream gave up on."""
    async with Client(settings=settings) as client:
        store = await ready_store(client, settings)
        ref = await client.submit(CAP, {"n": 1})
        name = await store.ensure_consumer(CAP, Priority.NORMAL)
        psub = await client.nc.jetstream().pull_subscribe_bind(name, task_stream(settings))
        try:
            [held] = await psub.fetch(1, timeout=10)
            assert held.metadata.num_delivered == 1  # one of two deliveries used
            async with Registry(settings=settings) as registry:
                await eventually(lambda: registry.stats.sweeps >= 3, timeout=30)
                assert registry.stats.max_deliveries == 0
            assert (await ref.status()).state is S.PENDING
            assert not await stream_empty(client, settings)()
        finally:
            await psub.unsubscribe()


# -- a CANCELLED task never starts a run --------------------------------------------------


async def test_a_cancelled_task_never_starts_a_run_after_its_record_expires(
    settings: ReachSettings,
):
    """A PENDING task is cancelled while no agent serves its capability; its CANCELLED
    record expires (retention 1 s here, 24 h by default); then an agent comes. It runs the
    task submitted after it, and never the cancelled one."""
    short = settings.model_copy(
        update={"task_retention": 1.0, "task_timeout": 1.0, "task_idempotency_ttl": 1.0}
    )
    runs: list[str] = []
    async with Client(settings=short) as client:
        cancelled = await client.submit(CAP, {"n": 1})
        assert (await cancelled.cancel()).state is S.CANCELLED

        async def expired() -> bool:  # (before the fix it read PENDING again then)
            try:
                return (await cancelled.status()).state is not S.CANCELLED
            except TaskNotFound:
                return True

        await eventually(expired, timeout=30)
        after = await client.submit(CAP, {"n": 2})
        agent = Agent("late", settings=short, max_concurrency=1)  # in the queue's order

        @agent.task(CAP)
        async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
            runs.append(ctx.task_id)
            return {"n": payload["n"] * 2}

        async with agent:
            assert (await after.result(timeout=30))["n"] == 4
        assert runs == [after.task_id]
        assert await stream_empty(client, short)()


async def test_a_cancel_takes_the_message_of_a_waiting_task_out_of_the_work_queue(
    settings: ReachSettings,
):
    """PENDING (nobody took it) and RETRYING (waiting out its backoff, held back by
    JetStream): after the cancel returns, no message of the task is left to run."""
    slow = settings.model_copy(
        update={"task_retry_base": 3600.0, "task_retry_cap": 3600.0, "task_max_deliver": 5}
    )
    agent = Agent("flaky", settings=slow)

    @agent.task("promise.flaky")
    async def flaky(payload: dict[str, Any]) -> dict[str, Any]:
        raise reach.ResourceExhausted("busy, try later")  # retryable

    async with agent, Client(settings=slow) as client:
        pending = await client.submit(CAP, {"n": 1})
        retrying = await client.submit("promise.flaky", {"n": 2}, max_attempts=3)

        async def backing_off() -> bool:
            return (await retrying.status()).state is S.RETRYING

        await eventually(backing_off, timeout=30)
        for ref in (pending, retrying):
            assert (await ref.cancel()).state is S.CANCELLED
        assert await stream_empty(client, slow)()
        assert (await retrying.status()).state is S.CANCELLED


async def test_a_message_acked_between_its_lookup_and_its_removal_is_already_gone(
    settings: ReachSettings,
):
    """A cancel finds the task's message, an agent acks it (the work queue drops it), then
    the cancel removes it: the server answers 400 "sequence not found", which means gone,
    not a task store out of reach (the model test found a cancel failing so)."""
    async with Client(settings=settings) as client:
        store = await ready_store(client, settings)
        # the first message is one before the last; the second, the last
        refs = [await client.submit(CAP, {"n": n}) for n in (1, 2)]
        for ref in refs:
            seq = await store.message_of(ref.task_id)
            assert seq
            assert await store.delete_message(seq)  # as an ack would
            assert not await store.delete_message(seq)  # the cancel's removal, after it


async def test_a_cancel_that_stopped_before_removing_the_message_is_finished_by_the_sweep(
    settings: ReachSettings,
):
    """The canceller died between writing CANCELLED and removing the message: the sweep
    removes it, and the final state stays as it was."""
    async with Client(settings=settings) as client:
        store = await ready_store(client, settings)
        ref = await client.submit(CAP, {"n": 1})
        await cancel_record(store, ref.task_id)  # the record only, as a cancel cut short
        assert not await stream_empty(client, settings)()
        async with Registry(settings=settings):
            await eventually(stream_empty(client, settings), timeout=30)
        rec = await ref.status()
        assert rec.state is S.CANCELLED
        assert [s.state for s in rec.history] == [S.PENDING, S.CANCELLED]


async def test_the_callback_of_a_task_cancelled_before_any_agent_took_it_is_sent(
    settings: ReachSettings,
):
    """Its message left with the cancel, so no agent will meet it: a sweep sends the
    callback (before, the agent that took the message did)."""
    received: asyncio.Queue[TaskRecord] = asyncio.Queue()

    async def receiver(msg: Any) -> None:
        await received.put(msgspec.json.decode(msg.data, type=TaskRecord))
        await msg.respond(b"ok")

    async with Client(settings=settings) as client:
        subject = f"{settings.subject_prefix}.callback.cancelled"
        await client.nc.subscribe(subject, cb=receiver)
        await client.nc.flush()
        ref = await client.submit(CAP, {"n": 1}, callback=subject)
        assert (await ref.cancel()).callback_state == "pending"
        async with Registry(settings=settings):
            rec = await asyncio.wait_for(received.get(), 30)
            assert (rec.task_id, rec.state) == (ref.task_id, S.CANCELLED)

            async def delivered() -> bool:
                return (await ref.status()).callback_state == "delivered"

            await eventually(delivered, timeout=30)
        assert received.empty()


async def test_a_cancel_requested_task_whose_agent_vanished_ends_cancelled_not_republished(
    settings: ReachSettings,
):
    """RUNNING with a cancel asked for, its agent gone and its message gone: the sweep
    writes CANCELLED; publishing it again would run a cancelled task."""
    async with Client(settings=settings) as client:
        store = await ready_store(client, settings)
        await store.write(ghost_record("ghostCancel1", cancel_requested=True), 0)
        ref = await client.task("ghostCancel1")
        async with Registry(settings=settings) as registry:
            rec = await ref.wait(timeout=30)
            assert registry.stats.tasks_recovered == 0
        assert rec.state is S.CANCELLED
        assert [(a.agent_id, a.outcome) for a in rec.attempts] == [("ghost-1", "lost")]
        assert await stream_empty(client, settings)()


# -- a record lives as long as its run -----------------------------------------------------


async def test_a_submit_timeout_longer_than_the_retention_is_refused_naming_both(
    reach_settings: ReachSettings,
):
    short = reach_settings.model_copy(
        update={"task_retention": 60.0, "task_timeout": 30.0, "task_idempotency_ttl": 60.0}
    )
    async with Client(settings=short) as client:
        for submit in (
            lambda: client.submit(CAP, {}, timeout=120),
            lambda: client.submit_batch(CAP, [{}], timeout=120),
        ):
            with pytest.raises(reach.ConfigurationError) as info:
                await submit()
            text = info.value.message
            assert "120" in text
            assert "60" in text
            assert "REACH_TASK_RETENTION" in text
        assert await client.submit(CAP, {}, timeout=60)  # as long as the record is kept


def test_a_declared_timeout_longer_than_the_retention_is_refused(reach_settings: ReachSettings):
    short = reach_settings.model_copy(
        update={"task_retention": 60.0, "task_timeout": 30.0, "task_idempotency_ttl": 60.0}
    )
    agent = Agent("declared", settings=short)
    with pytest.raises(reach.ConfigurationError) as info:
        agent.task(CAP, timeout=120)
    assert "120" in info.value.message
    assert "60" in info.value.message
    assert CAP not in agent._tasks.decls
    agent.task(CAP, timeout=60)  # as long as the record is kept


async def test_a_run_longer_than_the_agents_retention_keeps_its_record_and_runs_once(
    settings: ReachSettings,
):
    """The agent keeps records 2 s, the submitter asked for a 60 s timeout (its own
    retention is a day). The run lasts more than twice the agent's retention: its RUNNING
    record is written again before it expires, so the run is never fenced and the task
    does not start over at attempt 1 (before: 5 starts, 0 completions)."""
    kept = settings.model_copy(
        update={"task_retention": 2.0, "task_timeout": 2.0, "task_idempotency_ttl": 2.0}
    )
    release = asyncio.Event()
    starts: list[int] = []
    agent = Agent("longrun", settings=kept)

    @agent.task(CAP)
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> str:
        starts.append(ctx.attempt)
        await release.wait()
        return "done"

    async with agent, Client(settings=settings) as client:
        ref = await client.submit(CAP, {}, timeout=60, max_attempts=1)
        first: list[int] = []

        async def long_running() -> bool:
            try:
                rec = await ref.status()
            except reach.ReachError:
                return False
            if rec.state is not S.RUNNING or rec.attempt != 1 or starts != [1]:
                return False
            first[:] = first or [rec.updated_ms]
            return rec.updated_ms >= first[0] + 2.5 * kept.task_retention * 1000

        await eventually(long_running, timeout=30)
        release.set()
        assert await ref.result(timeout=30) == "done"
        rec = await ref.status()
    assert starts == [1]
    assert [a.outcome for a in rec.attempts] == ["succeeded"]


def _advisory(seq: int) -> bytes:
    return json.dumps({"stream_seq": seq, "deliveries": 2}).encode()


async def test_an_advisory_for_a_record_that_does_not_decode_is_handled_not_raised(
    settings: ReachSettings,
):
    """The handler itself: before, it raised msgspec's ValidationError (logged as a bug,
    naked, handled again every second, for ever)."""
    async with Client(settings=settings) as client:
        await ready_store(client, settings)
        ref = await client.submit(CAP, {"n": 1})
        await put_raw_record(client, settings, ref.task_id, NEWER)
        owner = Background("test")
        recovery = TaskRecovery(client.nc, settings, client.subjects, owner)
        seq = await message_seq(client, settings, ref.task_id)
        assert await recovery.on_max_deliveries(_advisory(seq)) is True
        assert await recovery.on_max_deliveries(_advisory(seq)) is False  # once
        await owner.close()
        rec = await ref.status()
        assert (rec.state, rec.error.code if rec.error else "") == (S.FAILED, "undecodable")
