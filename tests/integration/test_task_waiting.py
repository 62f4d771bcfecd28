"""A submitter waiting for its own task, on a real nats-server: its final notice is the
usual path, a look at the record makes up for a lost one, and a look soon after the submit
reads the record alone (a task queued behind many others costs one read per look)."""

from __future__ import annotations

from typing import Any

import pytest

from reach import Agent, Client, ReachSettings, RequestTimeout
from reach._tasks.store import TaskStore

CAP = "waiting.op"


def reads(monkeypatch: pytest.MonkeyPatch, store: TaskStore) -> list[str]:
    """The streams the client's store reads from, one entry per read."""
    real = store._direct_get
    seen: list[str] = []

    async def direct_get(stream: str, subject: str) -> Any:
        seen.append(stream)
        return await real(stream, subject)

    monkeypatch.setattr(store, "_direct_get", direct_get)
    return seen


async def test_a_lost_final_notice_is_made_up_for_by_a_look(
    reach_settings: ReachSettings, monkeypatch: pytest.MonkeyPatch
):
    agent = Agent("waiting", settings=reach_settings)

    @agent.task(CAP)
    async def op(payload: dict[str, Any]) -> dict[str, Any]:
        return {"n": payload["n"] * 2}

    async with agent, Client(settings=reach_settings) as client:
        tasks = client._tasks

        async def lost(msg: Any) -> None:
            return None  # the notice never arrives, as on a connection that dropped

        ref = await client.submit(CAP, {"n": 1})  # opens the notify subscription
        monkeypatch.setattr(tasks._sub, "_cb", lost)
        second = await client.submit(CAP, {"n": 2})
        assert await second.result(timeout=10) == {"n": 4}
        assert await ref.result(timeout=10) == {"n": 2}


async def test_a_quick_look_at_a_pending_task_reads_its_record_alone(
    reach_settings: ReachSettings, monkeypatch: pytest.MonkeyPatch
):
    """No agent serves it: the looks of the first second or so read the record (none yet)
    and never look for the task's message."""
    async with Client(settings=reach_settings) as client:
        ref = await client.submit(CAP, {"n": 1})
        store = client._tasks.store
        seen = reads(monkeypatch, store)
        with pytest.raises(RequestTimeout):
            await ref.result(timeout=1.5)
    assert seen, "it looked"
    assert set(seen) == {f"KV_{store.bucket}"}, seen
