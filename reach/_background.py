"""Ownership of background work: every coroutine an Agent, Client or Registry runs in the
background lives in a ``Background``.

Closing it cancels and awaits all of them; closing with a bound waits at most that long
and logs, by name, any coroutine that swallowed its cancellation and runs on. A loop that
crashes is logged, counted and restarted with backoff (``keep``; the backoff starts over
once a loop has run longer than ``backoff_max``); a one-off coroutine that fails is logged
and counted (``spawn``). Nothing dies silently, and nothing outlives its owner unsaid.
(A durable task is another thing: see ``reach._tasks``.)
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["Background"]

log = logging.getLogger("reach.background")
_NAMED = 10  # coroutines named in the log line of a close that left some running


class Background:
    """The background coroutines of one owner; like a TaskGroup whose children may fail alone."""

    def __init__(
        self,
        owner: str,
        *,
        backoff: float = 0.1,
        backoff_max: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.owner = owner
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.clock = clock  # how long a loop ran before it crashed; tests pass their own
        self.failures = 0
        self.restarts = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str = "") -> asyncio.Task[Any]:
        """Run ``coro`` in the background; a failure is logged and counted."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.owner} is closed; cannot start {name or 'a coroutine'}")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def keep(
        self,
        factory: Callable[[], Coroutine[Any, Any, None]],
        name: str,
        *,
        expected: Callable[[BaseException], bool] | None = None,
    ) -> asyncio.Task[Any]:
        """Run the loop ``factory()`` for the owner's life, restarting it after a crash.

        ``expected(exc)``: what stops the loop without being a bug (its server away, say):
        one warning line, no traceback, restarted the same way; every other exception is
        a crash, logged with its traceback and counted in ``failures``."""
        return self.spawn(self._supervise(factory, name, expected), name)

    async def _supervise(
        self,
        factory: Callable[[], Coroutine[Any, Any, None]],
        name: str,
        expected: Callable[[BaseException], bool] | None,
    ) -> None:
        delay = self.backoff
        while True:
            started = self.clock()
            try:
                await factory()
                return  # a loop that ends by itself is done
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # a stop: closing the owner, or whoever awaits this loop
                # Raised by the loop itself (a handler's own CancelledError): a crash.
                delay = self._crashed(name, started, delay)
            except Exception as exc:
                if expected is not None and expected(exc):
                    delay = self._stopped(name, started, delay, exc)
                else:
                    delay = self._crashed(name, started, delay)
            await asyncio.sleep(random.uniform(delay / 2, delay))
            delay = min(delay * 2, self.backoff_max)

    def _first_delay(self, started: float, delay: float) -> float:
        if self.clock() - started > self.backoff_max:
            return self.backoff  # it ran well for a while: a new fault, not a crash loop
        return delay

    def _crashed(self, name: str, started: float, delay: float) -> float:
        """Log and count a crash; the delay before the restart."""
        delay = self._first_delay(started, delay)
        self.failures += 1
        self.restarts += 1
        log.exception("%s: %s crashed; restarting in %.2fs", self.owner, name, delay)
        return delay

    def _stopped(self, name: str, started: float, delay: float, exc: BaseException) -> float:
        """Log an expected stop in one line; the delay before the restart."""
        delay = self._first_delay(started, delay)
        self.restarts += 1
        log.warning(
            "%s: %s stopped (%s); restarting in %.2fs",
            self.owner,
            name,
            str(exc) or type(exc).__name__,
            delay,
        )
        return delay

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failures += 1
            log.error("%s: background %s failed", self.owner, task.get_name(), exc_info=exc)

    async def close(self, timeout: float | None = None) -> int:
        """Cancel every coroutine and wait for all of them to finish; how many still run (0
        when all finished).

        With ``timeout``, wait at most that many seconds: a coroutine that swallows its
        cancellation must not hold its owner forever. Halfway, those still running are
        cancelled again (nats-py on Python 3.11 can swallow one cancel: its
        ``asyncio.wait_for`` returns a reply that came at the same moment, gh-86296, and
        the loop runs on; it does not swallow two). Those that still run at the end are
        logged by name and left behind.
        """
        self._closed = True
        if timeout is None:
            while self._tasks:
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                # asyncio.wait, not gather: a cancelled gather waits for every child anyway.
                await asyncio.wait(tasks)
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for until in (deadline - timeout / 2, deadline):
            tasks = list(self._tasks)
            if not tasks:
                return 0
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=max(0.0, until - loop.time()))
        if self._tasks:
            self._left_behind(list(self._tasks), timeout)
        return len(self._tasks)

    def _left_behind(self, tasks: list[asyncio.Task[Any]], timeout: float) -> None:
        names = sorted(t.get_name() for t in tasks)
        shown = ", ".join(names[:_NAMED]) + (
            f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
        )
        log.error(
            "%s: %d background coroutine(s) did not end within %gs of being cancelled (a"
            " cancellation swallowed?); left running: %s",
            self.owner,
            len(names),
            timeout,
            shown,
        )

    async def finish(self, timeout: float) -> int:
        """Let the coroutines end by themselves for up to ``timeout`` seconds, then ``close``
        them, waiting as long again (for short sends that should go out, not be cut: an
        agent's refusals). Returns how many still run (``close`` logged their names)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        return await self.close(timeout)

    def reopen(self) -> None:
        """Allow spawning again after ``close`` (an agent or client started a second time)."""
        self._closed = False
