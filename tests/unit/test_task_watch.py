"""A task's KV watch beside its final notice (``reach._tasks.refs._Follow``), with an
async iterator standing in for the watch: which of two event sources comes first is the
whole question, and only a stand-in decides it every time."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from reach._tasks.refs import _NOTICE, _Follow
from reach.errors import NotStarted
from reach.wire.tasks import TaskRecord


class Watch:
    """Entries handed over by the test (``deliver``), in order; ``asked`` is set whenever
    the next one is asked for."""

    def __init__(self) -> None:
        self.entries: asyncio.Queue[Any] = asyncio.Queue()
        self.asked = asyncio.Event()

    def deliver(self, *entries: Any) -> None:
        for entry in entries:
            self.entries.put_nowait(entry)

    async def __anext__(self) -> Any:
        self.asked.set()
        return await self.entries.get()


async def test_what_the_watch_brings_after_the_notice_still_comes_before_the_end() -> None:
    """The notice overtakes the watch (the final record was written first): the entries
    the watch brings after it, the end included, still come, in order."""
    watch = Watch()
    notice: asyncio.Future[TaskRecord] = asyncio.get_running_loop().create_future()
    follow = _Follow(watch, notice)
    async with asyncio.timeout(30):
        watch.deliver("running")
        assert await follow.next() == "running"
        notice.set_result(cast(TaskRecord, "final (the notice)"))
        watch.asked.clear()
        reading = asyncio.create_task(follow.next())
        await watch.asked.wait()  # the notice is there, the next entry is not yet
        watch.deliver("progress 0.5", "final (the watch)")
        assert await reading == "progress 0.5"
        assert await follow.next() == "final (the watch)"


async def test_a_watch_that_brings_nothing_after_the_notice_ends_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nats-py ends no watch when the connection closes: after the notice, the wait for
    the watch is bounded (``_DRAIN``), then the notice stands for the end."""
    monkeypatch.setattr("reach._tasks.refs._DRAIN", 0.01)
    notice: asyncio.Future[TaskRecord] = asyncio.get_running_loop().create_future()
    notice.set_result(cast(TaskRecord, "final"))
    async with asyncio.timeout(30):
        assert await _Follow(Watch(), notice).next() is _NOTICE


async def test_a_client_that_closes_ends_the_watch() -> None:
    notice: asyncio.Future[TaskRecord] = asyncio.get_running_loop().create_future()
    notice.set_exception(NotStarted("client closed"))
    async with asyncio.timeout(30):
        with pytest.raises(NotStarted):
            await _Follow(Watch(), notice).next()
