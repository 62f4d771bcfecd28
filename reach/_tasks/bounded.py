"""A handler run kept to its deadline even when the handler ignores its cancellation: the
one mechanism the task runner and the durable topic runner share.

The handler runs as a task of the runner's owner (``Background``), not inline, so the
runner can stop waiting for it: at its deadline it is cancelled and given ``GRACE``
seconds to end. One that still runs is *abandoned*: its outcome is settled as the
timeout (or whatever stopped it) at once, so its message is not held for ever, but the
handler keeps its slot, since the runner waits for it (``outlive``) before it takes other
work. So a stuck handler never runs beside another one in its place, and is counted
(``stuck``: now; ``abandoned``: in all) and reported until it really returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

from .._background import Background

__all__ = ["GRACE", "BoundedRun", "StuckCounts"]

log = logging.getLogger("reach.tasks")

GRACE = 1.0  # seconds a cancelled handler gets to end before it is abandoned
T = TypeVar("T")


class StuckCounts(Protocol):
    """Where a runner counts its handlers that ignored their cancellation."""

    abandoned: int  # in all
    stuck: int  # still running now


class BoundedRun(Generic[T]):
    """One handler call, run as task ``name`` of ``owner``; ``counts`` and ``changed()``
    hear of it when it is abandoned and when it has returned after all."""

    def __init__(
        self,
        owner: Background,
        call: Coroutine[Any, Any, T],
        name: str,
        what: str,
        counts: StuckCounts,
        changed: Callable[[], None],
    ) -> None:
        self.what = what  # for the logs: "agent a-1: task 7f3 (op, attempt 2)"
        self.task: asyncio.Task[T] = owner.spawn(call, name)
        self.abandoned = False
        self._counts = counts
        self._changed = changed

    async def finished(self, within: float) -> bool:
        """Wait up to ``within`` seconds for the handler to end; whether it did."""
        done, _ = await asyncio.wait({self.task}, timeout=max(0.0, within))
        return bool(done)

    async def stop(self, why: str, keeps: str = "slot stays") -> bool:
        """Cancel the handler and give it ``GRACE`` seconds to end; whether it did. One
        that runs on is abandoned: counted, logged (``keeps``: what it holds meanwhile)
        and reported, until ``outlive`` has seen it return."""
        self.task.cancel()
        if await self.finished(GRACE) or self.abandoned:
            return self.task.done()
        self.abandoned = True
        self._counts.abandoned += 1
        self._counts.stuck += 1
        log.error(
            "%s ignores its cancellation (%s); its %s taken until it returns (%d stuck)",
            self.what,
            why,
            keeps,
            self._counts.stuck,
        )
        self._changed()
        return False

    async def outlive(self) -> float:
        """Wait for an abandoned handler to return (the caller's slot stays taken
        meanwhile); the seconds it took, 0.0 when it was not abandoned. What it returns
        is dropped. A stop of the runner cancels the wait: the handler is then left to
        the owner's close."""
        if not self.abandoned:
            return 0.0
        since = time.monotonic()
        try:
            await asyncio.wait({self.task})
        finally:
            self.unstick()
        took = time.monotonic() - since
        log.warning(
            "%s: the handler that ignored its cancellation returned %.1fs later; what it"
            " returned is dropped",
            self.what,
            took,
        )
        return took

    def unstick(self) -> None:
        """No longer counted as stuck (it returned, or the runner stops waiting for it)."""
        if self.abandoned:
            self.abandoned = False
            self._counts.stuck -= 1
            self._changed()
