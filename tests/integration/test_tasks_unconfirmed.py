"""An attempt whose RUNNING write the server did not answer goes on unconfirmed
(execute.confirm); the lease loop still reads its record, adopts our RUNNING if it landed
(or writes it), and sees a cancel that only the record carries. (It skipped every record
check while unconfirmed: for the whole run, up to the task timeout, a cancel or a newer
attempt's fence went unseen.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.msg import Msg

import reach
from reach import Agent, Client, ReachSettings, TaskState
from reach._tasks import runner
from reach.testing import eventually

from .task_helpers import fail_write_once

S = TaskState


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_ack_wait": 1.5, "task_retry_base": 0.05})


@pytest.mark.parametrize("fail_running", [False, True], ids=["confirmed", "ack-of-running-lost"])
async def test_a_cancel_in_the_record_stops_even_an_unconfirmed_attempt(
    settings: ReachSettings, monkeypatch: pytest.MonkeyPatch, fail_running: bool
):
    async def missed(self: Any, msg: Msg) -> None:  # the cancel broadcast never arrives
        return None

    monkeypatch.setattr(runner.TaskRunner, "_on_cancel", missed)
    started = asyncio.Event()
    stopped: list[str] = []
    agent = Agent("runner", settings=settings)

    @agent.task("hang.op", timeout=120)
    async def op(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        started.set()
        try:
            await asyncio.Event().wait()  # runs until cancelled
        except asyncio.CancelledError:
            stopped.append(ctx.task_id)
            raise
        return {}

    async with agent, Client(settings=settings) as client:
        failed = fail_write_once(monkeypatch, agent, S.RUNNING, stored=True) if fail_running else []
        ref = await client.submit("hang.op", {})
        await asyncio.wait_for(started.wait(), 30)
        await eventually(lambda: (not fail_running) or bool(failed), timeout=30)
        await eventually(lambda: _is_running(ref), timeout=30)
        await ref.cancel()
        # the lease loop reads the record every ack_wait/3 (0.5 s): well within 15 s
        await eventually(lambda: bool(stopped), timeout=15)


async def _is_running(ref: Any) -> bool:
    rec = await ref.status()
    return rec.state is S.RUNNING
