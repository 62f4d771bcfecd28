"""Durable-task defects a review found, each pinned by a test that failed before its fix:
colliding consumer names, a drain that used up the last attempt, a republished message
dropped as a duplicate, a result too large for its record, progress during an outage, a
slow callback sent twice, and a paused agent that kept pulling tasks."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

import reach
from reach import Agent, Client, ReachSettings, TaskState
from reach.testing import NatsServer, eventually
from reach.wire import TaskRecord, TaskStep, TaskSubmit

S = TaskState


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_ack_wait": 2.0, "task_retry_base": 0.05})


def echo_agent(settings: ReachSettings, name: str, *caps: str, **kw: Any) -> Agent:
    agent = Agent(name, settings=settings, **kw)
    for cap in caps:

        @agent.task(cap)
        async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
            return {**payload, "by": ctx.agent_id, "cap": ctx.capability}

    return agent


async def test_capabilities_that_differ_by_a_dot_or_an_underscore_do_not_share_a_consumer(
    settings: ReachSettings,
):
    one = echo_agent(settings, "one", "rep_x")
    two = echo_agent(settings, "two", "rep.x")
    async with one, two, Client(settings=settings) as client:
        a = await client.submit("rep_x", {"n": 1})
        b = await client.submit("rep.x", {"n": 2})
        assert await a.result(timeout=30) == {"n": 1, "by": one.agent_id, "cap": "rep_x"}
        assert await b.result(timeout=30) == {"n": 2, "by": two.agent_id, "cap": "rep.x"}


async def test_a_drain_does_not_use_up_the_last_attempt(settings: ReachSettings):
    """A rolling deploy hands a running task back; that run must not count against
    max_attempts, or a task with one attempt would be FAILED by the deploy."""
    entered = asyncio.Event()
    first = Agent("first", settings=settings, drain_timeout=0.2)

    @first.task("deploy.op")
    async def slow(payload: dict[str, Any]) -> dict[str, Any]:
        entered.set()
        await asyncio.Event().wait()  # never ends by itself
        return payload

    second = echo_agent(settings, "second", "deploy.op")
    async with Client(settings=settings) as client:
        await first.start()
        ref = await client.submit("deploy.op", {"n": 1}, max_attempts=1)
        await asyncio.wait_for(entered.wait(), 30)
        await first.stop()
        async with second:
            assert (await ref.result(timeout=30))["by"] == second.agent_id
        rec = await ref.status()
    assert [a.outcome for a in rec.attempts] == ["drained", "succeeded"]


async def test_a_republished_message_runs_when_the_record_names_a_message_that_is_gone(
    settings: ReachSettings,
):
    """A recovery sweep republishes a task whose message was lost; an agent that reads the
    record before the sweep wrote the new sequence must run the new message, not drop it
    as a duplicate of the old one."""
    async with Client(settings=settings) as client:
        ref = await client.submit("sweep.op", {"n": 3})  # nobody serves it yet
        pending = await ref.status()
        record = msgspec.structs.replace(
            pending,
            state=S.RETRYING,
            seq=pending.seq + 1_000_000,  # a message that is not in the stream
            history=[*pending.history, TaskStep(state=S.RUNNING, at_ms=1)],
        )
        js = client.nc.jetstream()
        stream = settings.subject_prefix.upper() + "_TASKS"
        await js.delete_msg(stream, pending.seq)
        bucket = f"{settings.subject_prefix}_tasks"
        await js.publish(f"$KV.{bucket}.{ref.task_id}", msgspec.json.encode(record))
        sub = TaskSubmit(task_id=ref.task_id, capability="sweep.op", payload=b'{"n": 3}')
        subject = f"{settings.subject_prefix}.task.{ref.task_id}.sweep.op.normal"
        await js.publish(subject, msgspec.json.encode(sub), headers={"Nats-Msg-Id": "again"})
        async with echo_agent(settings, "sweeper", "sweep.op"):
            assert (await ref.result(timeout=30))["n"] == 3


async def test_a_result_too_large_for_its_record_fails_once_with_a_clear_error(
    settings: ReachSettings,
):
    runs: list[int] = []
    agent = Agent("big", settings=settings)

    @agent.task("big.op")
    async def big(payload: dict[str, Any], ctx: reach.TaskContext) -> bytes:
        runs.append(ctx.attempt)
        return b"x" * 900_000  # base64 in the record: more than the server's 1 MB

    async with agent, Client(settings=settings) as client:
        ref = await client.submit("big.op", {})
        with pytest.raises(reach.HandlerFailed, match="does not fit in the task record"):
            await ref.result(timeout=30)
    assert runs == [1]


async def test_progress_during_a_server_outage_does_not_fail_the_task():
    reached, resume, noted = asyncio.Event(), asyncio.Event(), asyncio.Event()
    async with NatsServer() as server:
        settings = ReachSettings(nats_url=server.url, subject_prefix="outage", task_ack_wait=5)
        agent = Agent("steady", settings=settings)

        @agent.task("steady.op")
        async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
            await ctx.progress(0.1, "started")  # writes the RUNNING record
            reached.set()
            await resume.wait()
            await ctx.progress(0.5, "while the server is away")  # must not raise
            noted.set()
            return payload

        async with agent, Client(settings=settings) as client:
            ref = await client.submit("steady.op", {"n": 5})
            await asyncio.wait_for(reached.wait(), 30)
            await server.akill()
            await eventually(lambda: not agent.client.connected)
            resume.set()
            await asyncio.wait_for(noted.wait(), 30)
            await server.astart()
            assert await ref.result(timeout=60) == {"n": 5}


async def test_a_callback_slower_than_ack_wait_is_sent_once(settings: ReachSettings):
    """The lease is kept until the ack, through a slow callback: no redelivery sends it
    a second time."""
    settings = settings.model_copy(update={"task_ack_wait": 1.0})
    calls: list[str] = []
    agent = echo_agent(settings, "caller", "slowcb.op")
    spare = echo_agent(settings, "spare", "slowcb.op")  # would take a redelivery
    async with agent, spare, Client(settings=settings) as client:

        async def receiver(msg: Msg) -> None:
            calls.append(msgspec.json.decode(msg.data, type=TaskRecord).task_id)
            await asyncio.sleep(2.5)  # the receiver's own slow work: 2.5 ack_waits
            await msg.respond(b"ok")

        await client.nc.subscribe("billing.slow", cb=receiver)
        await client.flush()
        ref = await client.submit("slowcb.op", {"n": 1}, callback="billing.slow")

        async def delivered() -> bool:
            return (await ref.status()).callback_state == "delivered"

        await eventually(delivered, timeout=30)
        rec = await ref.status()
    assert calls == [ref.task_id]
    assert len(rec.attempts) == 1


async def test_a_paused_agent_takes_no_tasks_until_it_resumes(settings: ReachSettings):
    paused = echo_agent(settings, "paused", "pause.op")
    other = echo_agent(settings, "other", "pause.op")
    async with paused, Client(settings=settings) as client:
        await paused.pause()
        ref = await client.submit("pause.op", {"n": 1})  # paused is the only instance
        async with other:
            assert (await ref.result(timeout=30))["by"] == other.agent_id
            await other.pause()
            await paused.resume()
            ref2 = await client.submit("pause.op", {"n": 2})
            assert (await ref2.result(timeout=30))["by"] == paused.agent_id


def idem_subject(settings: ReachSettings, kind: str, key: str) -> str:
    """The claim/idempotency key of ``key`` in the ``<prefix>_idem`` bucket (PROTOCOL 8.1)."""
    digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    return f"$KV.{settings.subject_prefix}_idem.{kind}.{digest}"


async def test_a_claim_left_by_a_crashed_agent_expires_and_is_taken_over(
    settings: ReachSettings,
):
    agent = echo_agent(settings, "heir", "claim.op")
    async with Client(settings=settings) as client:
        ref = await client.submit("claim.op", {"n": 1}, idempotency_key="order-77")
        # a crashed agent's claim: held, never renewed, gone after its TTL (2 s)
        await client.nc.jetstream().publish(
            idem_subject(settings, "run", "order-77"),
            b"ghost 1",
            headers={"Nats-TTL": "2s", "Nats-Expected-Last-Subject-Sequence": "0"},
        )
        async with agent:
            assert (await ref.result(timeout=30))["by"] == agent.agent_id
    assert agent.task_stats.claim_busy >= 1  # it found the claim held, and waited


async def test_a_redelivered_task_that_already_succeeded_is_not_run_again(
    settings: ReachSettings,
):
    ran: list[str] = []
    agent = Agent("once", settings=settings)

    @agent.task("once.op")
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        ran.append(ctx.task_id)
        return payload

    async with Client(settings=settings) as client:
        ref = await client.submit("once.op", {"n": 1})  # its message waits
        done = msgspec.structs.replace(
            await ref.status(),
            state=S.SUCCEEDED,
            result=b'{"n": "from the record"}',
            history=[TaskStep(state=S.PENDING, at_ms=1), TaskStep(state=S.SUCCEEDED, at_ms=2)],
        )
        bucket = f"{settings.subject_prefix}_tasks"
        await client.nc.jetstream().publish(
            f"$KV.{bucket}.{ref.task_id}", msgspec.json.encode(done)
        )
        async with agent:
            await eventually(lambda: agent.task_stats.duplicates == 1, timeout=30)
        assert await ref.result(timeout=30) == {"n": "from the record"}
    assert ran == []


async def test_two_tasks_with_one_idempotency_key_never_run_at_once(settings: ReachSettings):
    """A replay (a new task, the same key) must wait while the first still runs."""
    running: list[str] = []
    overlap: list[int] = []
    release = asyncio.Event()

    def worker(name: str) -> Agent:
        agent = Agent(name, settings=settings)

        @agent.task("key.op")
        async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
            running.append(ctx.task_id)
            overlap.append(len(running))
            await release.wait()
            running.remove(ctx.task_id)
            return payload

        return agent

    first, second = worker("first"), worker("second")
    async with first, second, Client(settings=settings) as client:
        a = await client.submit("key.op", {"n": 1}, idempotency_key="invoice-9")
        await eventually(lambda: len(running) == 1, timeout=30)
        twin = TaskSubmit(
            task_id="twinTask1",
            capability="key.op",
            payload=b'{"n": 2}',
            idempotency_key="invoice-9",
        )
        subject = f"{settings.subject_prefix}.task.twinTask1.key.op.normal"
        await client.nc.jetstream().publish(
            subject, msgspec.json.encode(twin), headers={"Nats-Msg-Id": "twinTask1"}
        )
        b = await client.task("twinTask1")
        busy = first.task_stats.claim_busy + second.task_stats.claim_busy
        await eventually(
            lambda: first.task_stats.claim_busy + second.task_stats.claim_busy > busy,
            timeout=30,
        )
        release.set()
        assert await a.result(timeout=30) == {"n": 1}
        assert await b.result(timeout=60) == {"n": 2}
    assert max(overlap) == 1
