"""Bounds on event streams: how many are open at once (each holds a KV watch), and how
much one keeps for a reader that falls behind.

One ``StreamSlots`` is shared by the task event streams and the A2A streams of a gateway
(``REACH_GATEWAY_MAX_STREAMS``). A route checks ``full()`` before it answers, so a refusal
is an HTTP 503 with ``Retry-After``; the stream takes its slot only once it runs (a stream
the server never starts never gives one back otherwise).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from ..errors import ReachError
from .errors import EdgeError

__all__ = ["Latest", "StreamSlots"]

T = TypeVar("T")


class StreamSlots:
    """At most ``limit`` streams at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        #: streams refused because ``limit`` were open
        self.refused = 0

    def full(self) -> bool:
        return self.open >= self.limit

    def refusal(self) -> EdgeError:
        """The 503 a stream refused now gets (counted)."""
        self.refused += 1
        err = EdgeError(
            503,
            "resource_exhausted",
            f"too many event streams ({self.open} open); try again shortly",
            headers={"Retry-After": "1"},
        )
        err.retryable = True
        return err

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a slot while the stream runs; ``refusal()`` raised when none is free."""
        if self.full():
            raise self.refusal()
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


class Latest(Generic[T]):
    """The newest item of a watch, then how the watch ended. A task record is the task's
    whole state, so a reader that falls behind needs only the newest: memory stays one
    record however slow the reader. The watch ends after the final record, so that one is
    never replaced before it is read."""

    def __init__(self) -> None:
        self._item: T | None = None
        self._ended = False
        self._error: ReachError | None = None
        self._ready = asyncio.Event()
        #: items replaced before they were read
        self.skipped = 0

    def put(self, item: T) -> None:
        if self._item is not None:
            self.skipped += 1
        self._item = item
        self._ready.set()

    def end(self, error: ReachError | None = None) -> None:
        self._ended, self._error = True, error
        self._ready.set()

    async def take(self) -> T | ReachError | None:
        """The newest item not yet taken; once the watch ended and it is taken, the error
        that ended it, or None. Safe to cancel (a timeout) and call again."""
        while True:
            item = self._item
            if item is not None:
                self._item = None
                return item
            if self._ended:
                return self._error
            self._ready.clear()
            await self._ready.wait()
