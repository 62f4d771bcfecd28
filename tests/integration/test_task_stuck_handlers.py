"""A task handler that ignores its cancellation (issue 20, reproduction 3): its attempt is
recorded as ended, but its slot and its idempotency claim are held until it has really
returned, so it never runs beside its own retry nor beside another task of a
``max_concurrency=1`` agent. It is counted, logged and visible in the heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import reach
from reach import Agent, Client, ReachSettings, TaskState, Telemetry
from reach.testing import eventually

CAP = "stuck.op"
S = TaskState


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(
        update={"task_ack_wait": 2.0, "task_retry_base": 0.05, "task_retry_cap": 0.1}
    )


class Runs:
    """Every run of the handler, and how many ran at once at most."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.starts: list[tuple[str, int, str]] = []  # (task id, attempt, agent id)
        self.release = asyncio.Event()


def stubborn_agent(
    settings: ReachSettings, name: str, runs: Runs, telemetry: Telemetry | None = None
) -> Agent:
    """One slot. The first attempt of a task whose payload says ``stubborn`` ignores every
    cancellation until ``runs.release``; the rest return at once."""
    agent = Agent(name, settings=settings, max_concurrency=1, telemetry=telemetry)

    @agent.task(CAP)
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        runs.now += 1
        runs.most = max(runs.most, runs.now)
        runs.starts.append((ctx.task_id, ctx.attempt, ctx.agent_id))
        try:
            if payload.get("stubborn") and ctx.attempt == 1:
                while not runs.release.is_set():
                    with contextlib.suppress(asyncio.CancelledError):  # the fault under test
                        await runs.release.wait()
            return {"n": payload["n"], "attempt": ctx.attempt, "by": ctx.agent_id}
        finally:
            runs.now -= 1

    return agent


def stuck(agent: Agent) -> int:
    return getattr(agent.task_stats, "stuck", 0)


async def test_a_handler_that_ignores_its_timeout_keeps_its_claim_until_it_returns(
    settings: ReachSettings,
):
    """Two runs of one idempotency key never overlap: the retry of a timed-out attempt
    whose handler runs on finds the key still claimed, and waits."""
    runs = Runs()
    first, second = (
        stubborn_agent(settings, "first", runs),
        stubborn_agent(settings, "second", runs),
    )
    try:
        async with first, Client(settings=settings) as client:
            ref = await client.submit(
                CAP, {"n": 1, "stubborn": True}, idempotency_key="order-7", timeout=0.3
            )
            await eventually(lambda: len(runs.starts) == 1, timeout=30)
            async with second:
                # the old code released the claim when the attempt timed out: the retry
                # ran beside the first run
                await eventually(
                    lambda: len(runs.starts) > 1 or second.task_stats.claim_busy > 0, timeout=30
                )
                assert runs.most == 1
                assert [(t, n) for t, n, _ in runs.starts] == [(ref.task_id, 1)]
                assert (stuck(first), first.task_stats.abandoned) == (1, 1)
                rec = await ref.status()
                assert [a.outcome for a in rec.attempts] == ["timeout"]
                assert rec.state is S.RETRYING

                runs.release.set()
                result = await ref.result(timeout=30)
                assert result["attempt"] == 2
                await eventually(lambda: stuck(first) == 0, timeout=30)
            assert [a.outcome for a in (await ref.status()).attempts] == [
                "timeout",
                "succeeded",
            ]
        assert runs.most == 1
    finally:
        runs.release.set()


async def test_a_one_slot_agent_never_runs_two_tasks_while_a_handler_will_not_stop(
    settings: ReachSettings,
):
    """The slot of a handler that ignored its cancellation stays taken until it returns:
    the agent takes nothing else meanwhile, reports the handler in its heartbeat, and
    runs the queued task (and the retry) once it has returned."""
    runs = Runs()
    metrics = CollectorRegistry()
    agent = stubborn_agent(settings, "single", runs, Telemetry(metrics))

    def gauge() -> float | None:
        labels = {"agent": "single", "kind": "task"}
        return metrics.get_sample_value("reach_agent_handlers_stuck", labels)

    try:
        async with agent, Client(settings=settings) as client:
            first = await client.submit(CAP, {"n": 1, "stubborn": True}, timeout=0.3)
            await eventually(lambda: len(runs.starts) == 1, timeout=30)
            other = await client.submit(CAP, {"n": 2})
            # the old code freed the slot 1 s after the timeout: the queued task started
            await eventually(lambda: len(runs.starts) > 1 or stuck(agent) == 1, timeout=30)
            assert runs.most == 1
            assert len(runs.starts) == 1
            assert agent.task_stats.running == 1
            assert agent.status is reach.Status.DEGRADED
            assert "1 task handler" in agent.heartbeat().reason
            assert gauge() == 1

            runs.release.set()
            assert (await other.result(timeout=30))["n"] == 2
            assert (await first.result(timeout=30))["attempt"] == 2
            await eventually(lambda: agent.status is reach.Status.UP, timeout=30)
            assert stuck(agent) == 0
            assert agent.task_stats.abandoned == 1
            assert gauge() == 0
        assert runs.most == 1
    finally:
        runs.release.set()
