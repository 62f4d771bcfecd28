"""Durable-task promises an audit found unproven, on a real nats-server: records expire
after their retention, a lease outlives many ack_waits beside an idle agent, and a record
write that fails loses nothing (the ack waits for the record; the handler stays watched)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest
from nats.aio.msg import Msg

import reach
from reach import Agent, Client, ReachSettings, TaskNotFound, TaskState
from reach._tasks import runner
from reach._tasks.store import consumer_name
from reach.testing import eventually
from reach.wire import Priority

from .task_helpers import counting_agent, fail_write_once, stream_empty, task_stream

S = TaskState


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_ack_wait": 2.0, "task_retry_base": 0.05})


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
    """ack_wait is 2.5 s; the handler runs for more than 3 of them while a second agent of
    the same capability idles. Kept by in_progress (and, with a key, the renewed claim),
    the task is never redelivered: one attempt, one run."""
    # not shorter: a stall of a second on a loaded machine must not look like a lost lease
    settings = reach_settings.model_copy(update={"task_ack_wait": 2.5})
    kept: dict[str, int] = {}
    real = runner.keep_alive

    async def counted(msgs: Iterable[Msg]) -> None:
        msgs = list(msgs)
        for msg in msgs:
            kept[msg.subject] = kept.get(msg.subject, 0) + 1
        await real(msgs)

    monkeypatch.setattr(runner, "keep_alive", counted)
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
async def test_a_final_write_that_fails_is_written_again_and_the_task_runs_once(
    settings: ReachSettings, monkeypatch: pytest.MonkeyPatch, stored: bool
):
    """The write of SUCCEEDED gets no answer once (not stored; or stored, its answer
    lost). The message stays held and the end is written again: the task ends SUCCEEDED
    after one run, with no redelivery (it used to come back after ack_wait and, when
    nothing was stored, run again)."""
    runs: list[str] = []
    agent = counting_agent(settings, "writer", "write.op", runs)
    async with agent, Client(settings=settings) as client:
        failed = fail_write_once(monkeypatch, agent, S.SUCCEEDED, stored=stored)
        ref = await client.submit("write.op", {"n": 5})
        assert (await ref.result(timeout=30))["n"] == 10
        await eventually(stream_empty(client, settings), timeout=30)  # acked
        rec = await ref.status()
    assert len(failed) == 1
    assert rec.state is S.SUCCEEDED
    assert runs == [ref.task_id]
    assert agent.task_stats.redelivered == 0
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

    async with agent, Client(settings=settings) as client:
        failed = fail_write_once(monkeypatch, agent, S.RUNNING, stored=stored)
        ref = await client.submit("hiccup.op", {"n": 1})
        await eventually(lambda: bool(failed), timeout=30)
        # the lease loop writes RUNNING again when it did not land, or adopts it
        await eventually(lambda: _running(ref), timeout=30)
        assert agent.task_stats.running == 1  # still its task, kept alive
        release.set()
        assert await ref.result(timeout=30) == {"n": 1, "attempt": 1}
        await eventually(stream_empty(client, settings), timeout=30)
        rec = await ref.status()
    assert runs == [ref.task_id]
    assert [(a.n, a.outcome) for a in rec.attempts] == [(1, "succeeded")]
    assert agent.task_stats.redelivered == 0
    assert agent.task_stats.fenced == 0  # the lease loop writing RUNNING again is no fence


async def _running(ref: Any) -> bool:
    return (await ref.status()).state is S.RUNNING
