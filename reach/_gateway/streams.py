"""Bounds on event streams: how many are open at once (each holds a KV watch), and how
much one keeps for a reader that falls behind.

One ``StreamSlots`` is shared by the task event streams and the A2A streams of a gateway
(``REACH_GATEWAY_MAX_STREAMS``). A refusal is an HTTP 503 with ``Retry-After``, as for
the gateway's other limits of its own (429 is an agent's ``resource_exhausted``). A route
checks ``full()`` before it answers and the stream takes its slot once it runs, or, when
the route waits before it answers (the capability stream route waits for the first
chunk), the route ``take()``s the slot first and hands it to the stream: a ``Slot`` given
back however it ends (released once; dropped unreleased, at garbage collection).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, Self, TypeVar

from ..errors import ReachError
from .errors import EdgeError

__all__ = ["Latest", "Slot", "StreamSlots"]

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

    def take(self) -> Slot:
        """A slot, held until it is released; ``refusal()`` raised when none is free."""
        if self.full():
            raise self.refusal()
        self.open += 1
        return Slot(self)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a slot while the stream runs; ``refusal()`` raised when none is free."""
        with self.take():
            yield


class Slot:
    """One held slot of a ``StreamSlots``; ``release()`` gives it back (once)."""

    __slots__ = ("_slots",)

    def __init__(self, slots: StreamSlots) -> None:
        self._slots: StreamSlots | None = slots

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.open -= 1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a response the server never started: given back all the same
        self.release()


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
