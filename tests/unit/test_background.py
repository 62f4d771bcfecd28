"""Background: nothing it owns dies silently or outlives it; crashing loops back off."""

import asyncio
import inspect
import logging

import pytest

from reach._background import Background
from reach.testing import eventually


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def crash_delays(caplog) -> list[float]:
    """The backoff each crash of a kept loop announced, in order."""
    return [
        r.args[2] for r in caplog.records if r.name == "reach.background" and "crashed" in r.msg
    ]


async def test_a_failed_spawned_task_is_counted_and_logged(caplog):
    owner = Background("owner-1")

    async def boom() -> None:
        raise ValueError("boom")

    task = owner.spawn(boom(), "boom")
    with pytest.raises(ValueError, match="boom"):
        await task
    await eventually(lambda: owner.failures == 1)
    assert len(owner) == 0
    [record] = [r for r in caplog.records if r.name == "reach.background"]
    assert record.levelno == logging.ERROR
    assert "owner-1:boom" in record.getMessage()
    assert isinstance(record.exc_info[1], ValueError)


async def test_keep_restarts_a_crashing_loop_until_it_ends(caplog):
    owner = Background("owner-2", backoff=0.001, backoff_max=0.004)
    runs = 0
    ended = asyncio.Event()

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise RuntimeError(f"crash {runs}")
        ended.set()

    task = owner.keep(loop, "loop")
    await ended.wait()
    await task
    assert (runs, owner.restarts, owner.failures) == (4, 3, 3)
    assert crash_delays(caplog) == pytest.approx([0.001, 0.002, 0.004])
    await eventually(lambda: len(owner) == 0)  # a loop that ended leaves the owner


async def test_keep_resets_its_backoff_after_a_healthy_run(caplog):
    clock = Clock()
    owner = Background("owner-3", backoff=0.001, backoff_max=0.004, clock=clock)
    runs = 0
    ended = asyncio.Event()

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs == 5:
            clock.now += 1.0  # this run served far longer than backoff_max, then crashed
        if runs <= 5:
            raise RuntimeError(f"crash {runs}")
        ended.set()

    owner.keep(loop, "loop")
    await ended.wait()
    # Crashes in a row back off up to the cap; a crash after a healthy run starts over.
    assert crash_delays(caplog) == pytest.approx([0.001, 0.002, 0.004, 0.004, 0.001])
    await owner.close()


async def test_close_cancels_and_awaits_every_task():
    owner = Background("owner-4")
    never = asyncio.Event()
    waiting: list[str] = []
    cancelled: list[str] = []

    async def waits(name: str) -> None:
        waiting.append(name)
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def loop() -> None:
        await waits("loop")

    tasks = [owner.spawn(waits(f"t{i}"), f"t{i}") for i in range(3)]
    tasks.append(owner.keep(loop, "loop"))
    await eventually(lambda: len(waiting) == 4)
    assert len(owner) == 4
    await owner.close()
    assert sorted(cancelled) == ["loop", "t0", "t1", "t2"]
    assert all(t.cancelled() for t in tasks)
    assert (len(owner), owner.failures, owner.closed) == (0, 0, True)


async def test_spawn_after_close_raises_and_closes_the_coroutine():
    owner = Background("owner-5")
    await owner.close()

    async def work() -> None:
        return None

    coro = work()
    with pytest.raises(RuntimeError, match="owner-5 is closed"):
        owner.spawn(coro, "late")
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    owner.reopen()
    await owner.spawn(work(), "again")
    assert not owner.closed


async def test_an_expected_stop_is_one_warning_line_and_no_failure(caplog):
    """A loop stopped by what its owner expects (its server away) restarts as after a
    crash, logged in one line without a traceback, and is not counted as a failure."""
    owner = Background("owner-x", backoff=0.001, backoff_max=0.004)
    runs = 0
    ended = asyncio.Event()

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise TimeoutError("the server is away")
        if runs == 2:
            raise KeyError("a bug")
        ended.set()

    task = owner.keep(loop, "loop", expected=lambda exc: isinstance(exc, TimeoutError))
    await ended.wait()
    await task
    assert (runs, owner.restarts, owner.failures) == (3, 2, 1)
    records = [r for r in caplog.records if r.name == "reach.background"]
    assert [(r.levelno, r.exc_info is not None and r.exc_info[0] is not None) for r in records] == [
        (logging.WARNING, False),
        (logging.ERROR, True),
    ]
    assert "loop stopped (the server is away); restarting in" in records[0].getMessage()
