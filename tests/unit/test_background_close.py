"""Background.close with a timeout: a task that swallows its cancellation cannot hold it."""

import asyncio
import contextlib

from reach._background import Background


async def test_close_gives_up_on_a_task_that_ignores_cancellation():
    owner = Background("test")
    release = asyncio.Event()
    running = asyncio.Event()
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        running.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancels += 1

    async def polite() -> None:
        await asyncio.Event().wait()

    owner.spawn(stubborn(), "stubborn")
    polite_task = owner.spawn(polite(), "polite")
    await running.wait()
    assert await owner.close(timeout=0.05) == 1
    assert polite_task.cancelled()
    assert cancels >= 1
    assert owner.closed
    release.set()
    assert await owner.close() == 0
    assert len(owner) == 0


async def test_close_without_timeout_waits_for_cleanup():
    owner = Background("test")
    running = asyncio.Event()
    finished = asyncio.Event()

    async def cleans_up() -> None:
        running.set()
        try:
            await asyncio.Event().wait()
        finally:
            # cleanup that itself awaits (a flush, a reply): close() must wait for it
            flushed = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(flushed.set_result, None)
            with contextlib.suppress(asyncio.CancelledError):
                await flushed
            finished.set()

    owner.spawn(cleans_up(), "cleans-up")
    await running.wait()
    assert await owner.close() == 0
    assert finished.is_set()


async def test_a_loop_raising_cancelled_error_itself_is_restarted():
    """A CancelledError nobody asked for (cancelling() == 0) is a crash, not a stop."""
    owner = Background("t", backoff=0.001)
    ran = 0
    finished = asyncio.Event()

    async def loop() -> None:
        nonlocal ran
        ran += 1
        if ran == 1:
            raise asyncio.CancelledError
        finished.set()

    task = owner.keep(loop, "loop")
    async with asyncio.timeout(10):  # before the fix, the loop was never restarted
        await finished.wait()
    await task
    assert (ran, owner.restarts, owner.failures) == (2, 1, 1)
    await owner.close()


async def test_close_with_a_bound_logs_the_names_of_the_tasks_that_did_not_end(caplog):
    """Closing waits at most its bound, then says which tasks run on (by name), so a leak
    is found in the log instead of a hang."""
    owner = Background("test-owner")
    release = asyncio.Event()
    running = asyncio.Event()

    async def stubborn() -> None:
        running.set()
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    owner.spawn(stubborn(), "stubborn loop")
    owner.spawn(asyncio.Event().wait(), "polite")
    await running.wait()
    try:
        with caplog.at_level("ERROR", logger="reach.background"):
            async with asyncio.timeout(30):  # the bound is 0.05 s: far within this
                assert await owner.close(timeout=0.05) == 1
        said = [r.getMessage() for r in caplog.records if r.name == "reach.background"]
        assert any("test-owner:stubborn loop" in m and "did not end" in m for m in said), said
        assert not any("polite" in m for m in said)
    finally:
        release.set()  # (or it would hold the test's loop at its end)
    assert await owner.close() == 0


async def test_close_with_a_bound_cancels_again_a_task_that_swallowed_one_cancel():
    """nats-py on Python 3.11 can swallow a cancel (asyncio.wait_for returns the reply that
    came at the same moment): the loop then runs on. A second cancel ends it."""
    owner = Background("test")
    running = asyncio.Event()
    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        running.set()
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # as a cancel lost inside a library call

    task = owner.spawn(loop(), "loop")
    await running.wait()
    async with asyncio.timeout(30):
        assert await owner.close(timeout=2) == 0  # the second cancel comes at 1 s
    assert task.cancelled()
    assert swallowed == 1
