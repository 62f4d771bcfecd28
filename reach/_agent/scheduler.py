"""The agent's three-level priority queue: pure and synchronous, so tests need no loop."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

from ..wire import Priority

T = TypeVar("T")

_ORDER = (Priority.HIGH, Priority.NORMAL, Priority.LOW)


class PriorityQueue(Generic[T]):
    """High before normal before low, FIFO within a level, bounded in total."""

    __slots__ = ("_levels", "_size", "maxlen")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._levels: dict[Priority, deque[T]] = {p: deque() for p in _ORDER}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def lengths(self) -> dict[Priority, int]:
        """Items waiting per priority (for metrics)."""
        return {p: len(q) for p, q in self._levels.items()}

    def push(self, priority: Priority, item: T, *, front: bool = False) -> bool:
        """Queue ``item``; False (and nothing queued) when the queue is full."""
        if self._size >= self.maxlen and not front:
            return False
        if front:
            self._levels[priority].appendleft(item)
        else:
            self._levels[priority].append(item)
        self._size += 1
        return True

    def pop(self) -> T | None:
        if not self._size:
            return None
        for level in _ORDER:
            q = self._levels[level]
            if q:
                self._size -= 1
                return q.popleft()
        return None

    def drain(self) -> Iterator[T]:
        """Remove and yield everything still queued, highest priority first."""
        while (item := self.pop()) is not None:
            yield item


class WorkQueue(Generic[T]):
    """A PriorityQueue that idle workers await; an item goes straight to a waiting worker."""

    def __init__(self, maxlen: int) -> None:
        self._queue: PriorityQueue[T] = PriorityQueue(maxlen)
        self._waiters: deque[asyncio.Future[T]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def lengths(self) -> dict[Priority, int]:
        return self._queue.lengths()

    @property
    def idle(self) -> int:
        """Workers parked in ``get()``, waiting for an item."""
        return sum(1 for w in self._waiters if not w.done())

    def offer(self, priority: Priority, item: T) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(item)
                return True
        return self._queue.push(priority, item)

    async def get(self) -> T:
        item = self._queue.pop()
        if item is not None:
            return item
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Handed an item at the moment we were cancelled: give it back.
                self._queue.push(Priority.HIGH, waiter.result(), front=True)
            raise

    def drain(self) -> Iterator[T]:
        return self._queue.drain()
