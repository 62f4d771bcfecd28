"""Durable tasks end to end: idempotent submits, cancel, priority with aging, batches, reading
a task from another process, callbacks, unknown ids, and a drain that hands work back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

import reach
from reach import Agent, Client, ReachError, ReachSettings, TaskNotFound, TaskState
from reach.testing import eventually
from reach.wire import Header

S = TaskState
ROOT = Path(reach.__file__).resolve().parents[1]


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_ack_wait": 2.0, "task_retry_base": 0.05})


def states(records: list[reach.TaskRecord]) -> list[TaskState]:
    """The states passed through, each run of one state counted once."""
    out: list[TaskState] = []
    for rec in records:
        if not out or out[-1] is not rec.state:
            out.append(rec.state)
    return out


def stream_empty(client: Client, settings: ReachSettings) -> Callable[[], Awaitable[bool]]:
    """Whether no message is left in the task stream (a work queue: acked ones are gone)."""
    stream = settings.subject_prefix.replace(".", "_").upper() + "_TASKS"

    async def check() -> bool:
        info = await client.nc.jetstream().stream_info(stream)
        return info.state.messages == 0

    return check


async def test_concurrent_submits_with_one_key_make_one_task(settings: ReachSettings):
    ran: list[str] = []
    agent = Agent("idem", settings=settings)

    @agent.task("idem.op")
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        ran.append(ctx.task_id)
        return {"n": payload["n"], "attempt": ctx.attempt}

    async with agent, Client(settings=settings) as client:
        refs = await asyncio.gather(
            *(client.submit("idem.op", {"n": 1}, idempotency_key="order-42") for _ in range(5))
        )
        results = await asyncio.gather(*(r.result(timeout=30) for r in refs))
        await eventually(stream_empty(client, settings), timeout=30)
    assert len({r.task_id for r in refs}) == 1
    assert results == [{"n": 1, "attempt": 1}] * 5
    assert ran == [refs[0].task_id]
    assert agent.task_stats.started == 1


async def test_a_task_cancelled_before_it_runs_never_runs(settings: ReachSettings):
    ran: list[int] = []
    async with Client(settings=settings) as client:
        ref = await client.submit("cancel.early", {"n": 1})
        rec = await ref.cancel()
        assert rec.state is S.CANCELLED
        assert (await ref.cancel()).state is S.CANCELLED  # twice is harmless
        assert await stream_empty(client, settings)()  # its message left with the cancel
        agent = Agent("late", settings=settings)

        @agent.task("cancel.early")
        async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> None:
            ran.append(ctx.attempt)

        async with agent:
            await eventually(stream_empty(client, settings), timeout=30)
        rec = await ref.status()
        with pytest.raises(reach.Cancelled):
            await ref.result(timeout=10)
    assert ran == []
    assert agent.task_stats.duplicates == 0  # no agent ever gets its message
    assert rec.state is S.CANCELLED
    assert rec.attempts == []
    assert states([rec]) == [S.CANCELLED]
    assert [h.state for h in rec.history] == [S.PENDING, S.CANCELLED]


async def test_a_running_task_is_cancelled_through_its_handler(settings: ReachSettings):
    entered = asyncio.Event()
    seen: list[str] = []
    agent = Agent("canceller", settings=settings)

    @agent.task("cancel.late")
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(ctx.task_id)
            raise

    async with agent, Client(settings=settings) as client:
        ref = await client.submit("cancel.late", {"n": 1})
        async with asyncio.timeout(30):
            await entered.wait()
        await ref.cancel()
        with pytest.raises(reach.Cancelled) as info:
            await ref.result(timeout=30)
        rec = await ref.status()
    assert seen == [ref.task_id]
    assert info.value.attempts[0].outcome == "cancelled"
    assert rec.state is S.CANCELLED
    assert [a.outcome for a in rec.attempts] == ["cancelled"]
    assert agent.task_stats.cancelled == 1


def gaps(seq: list[str], level: str) -> list[int]:
    at = [i for i, p in enumerate(seq) if p == level]
    return [b - a for a, b in zip([-1, *at], at, strict=False)]


async def test_priority_order_and_aging_with_a_backlog(settings: ReachSettings):
    counts = {"low": 40, "normal": 40, "high": 20}
    order: list[str] = []
    agent = Agent("prio", settings=settings.model_copy(update={"task_concurrency": 1}))

    @agent.task("prio.op")
    async def op(payload: dict[str, Any]) -> None:
        order.append(payload["p"])

    async with Client(settings=settings) as client:
        batches = [  # the lowest first, so arrival order cannot explain the result
            await client.submit_batch("prio.op", [{"p": p}] * n, priority=p)
            for p, n in counts.items()
        ]
        async with agent:
            for batch in batches:
                assert all(r is None for r in await batch.results(timeout=60))
    assert sorted(order) == sorted(p for p, n in counts.items() for _ in range(n))
    last = {p: max(i for i, q in enumerate(order) if q == p) for p in counts}
    assert order[0] == "high"
    assert last["high"] < last["normal"] < last["low"] == len(order) - 1
    mean = {p: sum(i for i, q in enumerate(order) if q == p) / n for p, n in counts.items()}
    assert mean["high"] < mean["normal"] < mean["low"]
    # aging (patience normal 8, low 16): never starved while they have a backlog
    assert max(gaps(order, "low")) <= 17, order
    assert max(gaps(order[: last["normal"] + 1], "normal")) <= 9, order
    assert order[: last["high"] + 1].count("high") > 0.8 * (last["high"] + 1), order


async def test_a_batch_with_mixed_outcomes(settings: ReachSettings):
    agent = Agent("batcher", settings=settings)

    @agent.task("batch.op")
    async def op(payload: dict[str, Any]) -> dict[str, Any]:
        if payload["i"] % 4 == 0:
            raise ValueError(f"bad item {payload['i']}")
        return {"i": payload["i"]}

    async with Client(settings=settings) as client:
        batch = await client.submit_batch("batch.op", [{"i": i} for i in range(100)])
        assert len(batch) == 100
        assert (batch.progress.total, batch.progress.pending) == (100, 100)
        async with agent:
            finished = [ref async for ref in batch.as_completed(timeout=60)]
            assert batch.progress == reach.BatchProgress(done=75, failed=25, total=100)
            values = await batch.results(timeout=60)
    assert sorted(r.task_id for r in finished) == sorted(r.task_id for r in batch.refs)
    assert len(values) == 100
    for i, value in enumerate(values):
        if i % 4:
            assert value == {"i": i}
        else:
            assert isinstance(value, ReachError)
            assert f"bad item {i}" in str(value)
            assert [a.outcome for a in value.attempts] == ["failed"]
    assert batch.progress.pending == 0
    assert agent.task_stats.dead_lettered == 25


READER = """
import asyncio, json, sys
import reach

async def main() -> None:
    async with reach.Client(settings=reach.ReachSettings()) as client:
        ref = await client.task(sys.argv[1])
        print((await ref.status()).state, flush=True)
        print(json.dumps(await ref.result(timeout=60)), flush=True)

asyncio.run(main())
"""


async def test_a_task_is_followed_from_another_process(settings: ReachSettings, tmp_path: Path):
    script = tmp_path / "reader.py"
    script.write_text(READER)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
    }
    agent = Agent("watched", settings=settings)

    @agent.task("watch.op")
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        await ctx.progress(0.5, "half way")
        return {"n": payload["n"] * 2}

    seen: list[reach.TaskRecord] = []
    first = asyncio.Event()
    async with Client(settings=settings) as client:
        ref = await client.submit("watch.op", {"n": 21})

        async def follow() -> None:
            async for rec in ref.watch():
                seen.append(rec)
                first.set()

        watcher = asyncio.create_task(follow())
        reader = await asyncio.create_subprocess_exec(
            sys.executable, str(script), ref.task_id, env=env, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert reader.stdout is not None
            async with asyncio.timeout(60):
                await first.wait()
                assert (await reader.stdout.readline()).decode().strip() == "PENDING"
                async with agent:
                    await watcher
                    line = await reader.stdout.readline()
                    assert await reader.wait() == 0
        finally:
            watcher.cancel()
            if reader.returncode is None:
                reader.kill()
                await reader.wait()
    assert json.loads(line) == {"n": 42}
    assert states(seen) == [S.PENDING, S.RUNNING, S.SUCCEEDED]
    assert any(rec.progress_note == "half way" for rec in seen)


async def test_a_watch_read_after_the_end_still_gives_the_progress_before_it(
    settings: ReachSettings,
):
    """End to end: a watch left unread while its task reports progress and ends (its
    final notice heard meanwhile) still gives the report, then the end. (The notice
    overtaking the watch itself: tests/unit/test_task_watch.py, where it is certain.)"""
    agent = Agent("drained", settings=settings)
    go = asyncio.Event()

    @agent.task("drain.op")
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        await go.wait()
        await ctx.progress(0.5, "half way")
        return {"done": True}

    async with agent, Client(settings=settings) as client:
        ref = await client.submit("drain.op", {})
        seen: list[reach.TaskRecord] = []
        async with contextlib.aclosing(ref.watch()) as watch, asyncio.timeout(60):
            while not seen or seen[-1].state is not S.RUNNING:
                seen.append(await anext(watch))
            go.set()  # the task reports and ends while nobody reads the watch
            await ref.wait()  # its end is known here: the notice came
            seen += [rec async for rec in watch]
    assert states(seen)[-2:] == [S.RUNNING, S.SUCCEEDED]
    assert [(r.progress, r.progress_note) for r in seen if not r.final][-1] == (0.5, "half way")


async def test_a_callback_is_retried_until_acknowledged(settings: ReachSettings):
    agent = Agent("caller-back", settings=settings)

    @agent.task("cb.op")
    async def op(payload: dict[str, Any]) -> dict[str, Any]:
        return {"ok": payload["n"]}

    delivered: list[reach.TaskRecord] = []

    async def receiver(msg: Msg) -> None:
        delivered.append(msgspec.json.decode(msg.data, type=reach.TaskRecord))
        if len(delivered) <= 2:  # refuse twice, as a receiver that is not ready would
            headers = {Header.SERVICE_ERROR_CODE: "503", Header.SERVICE_ERROR: "not yet"}
            await agent_client.nc.publish(msg.reply, b"", headers=headers)
        else:
            await agent_client.nc.publish(msg.reply, b"ok")

    subject = f"{settings.subject_prefix}.callbacks.reports"
    async with agent, Client(settings=settings) as agent_client:
        await agent_client.nc.subscribe(subject, cb=receiver)
        await agent_client.nc.flush()
        ref = await agent_client.submit("cb.op", {"n": 5}, callback=subject)
        assert await ref.result(timeout=30) == {"ok": 5}

        async def acknowledged() -> bool:
            return (await ref.status()).callback_state == "delivered"

        await eventually(acknowledged, timeout=30)
    assert len(delivered) == 3
    assert {(r.task_id, r.state) for r in delivered} == {(ref.task_id, S.SUCCEEDED)}
    assert (agent.task_stats.callbacks_delivered, agent.task_stats.callbacks_failed) == (1, 0)


@pytest.mark.parametrize(
    "task_id", ["nope", "Q" * 22, "a.b", "*", ">", "", "a b", "reach.>", "x" * 300]
)
async def test_an_unknown_id_is_not_found(reach_client: Client, task_id: str):
    with pytest.raises(TaskNotFound):
        await reach_client.task(task_id)
    with pytest.raises(TaskNotFound):
        await reach_client.task_record(task_id)


async def test_a_known_id_is_found_and_never_pending_when_unknown(reach_client: Client):
    ref = await reach_client.submit("known.op", {"n": 1})
    assert (await reach_client.task_record(ref.task_id)).state is S.PENDING
    assert (await reach_client.task(ref.task_id)).task_id == ref.task_id
    with pytest.raises(TaskNotFound):
        await reach_client.task(ref.task_id[:-1])


async def test_a_draining_agent_hands_its_task_to_another(settings: ReachSettings):
    # a long lease: only an immediate hand-back lets the second agent finish within the test
    slow_lease = settings.model_copy(update={"task_ack_wait": 120.0})
    entered = asyncio.Event()
    first = Agent("leaving", settings=slow_lease, drain_timeout=0.2)

    @first.task("drain.op")
    async def slow(payload: dict[str, Any]) -> None:
        entered.set()
        await asyncio.Event().wait()  # longer than any drain

    second = Agent("staying", settings=slow_lease)

    @second.task("drain.op")
    async def quick(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        return {"attempt": ctx.attempt}

    async with Client(settings=slow_lease) as client:
        await first.start()
        try:
            ref = await client.submit("drain.op", {"n": 1})
            async with asyncio.timeout(30):
                await entered.wait()
            async with second:
                await first.stop()
                assert await ref.result(timeout=30) == {"attempt": 2}
        finally:
            await first.stop()
        rec = await ref.status()
    assert [h.state for h in rec.history] == [
        S.PENDING,
        S.RUNNING,
        S.RETRYING,
        S.RUNNING,
        S.SUCCEEDED,
    ]
    assert [(a.outcome, a.agent_id) for a in rec.attempts] == [
        ("drained", first.agent_id),
        ("succeeded", second.agent_id),
    ]
    assert first.task_stats.drained == 1
