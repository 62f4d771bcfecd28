"""Fan-out of server-sent events with bounds everywhere.

Each frame is encoded once and shared by every subscriber. A subscriber holds at most
``queue_size`` frames: one that reads slower than frames arrive loses its oldest ones
(counted), so a stalled browser costs a fixed amount of memory, never more. The status
page's frames are full snapshots or single status changes that a later snapshot repeats,
so a reader that lost some is whole again at the next snapshot. At most ``max_streams``
subscribe at once; ``close()`` ends every stream (the server's shutdown waits for them).
"""

from __future__ import annotations

import asyncio
from collections import deque

from ...errors import ResourceExhausted
from ..events import frame

__all__ = ["Hub", "Subscriber", "frame"]


class Subscriber:
    """One stream's bounded queue of frames."""

    __slots__ = ("_frames", "_hub", "_ready", "_size", "closed", "dropped")

    def __init__(self, hub: Hub, size: int) -> None:
        self._hub = hub
        self._size = size
        self._frames: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self.closed = False
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._frames)

    def offer(self, data: bytes) -> None:
        """Queue ``data``; when full, drop the oldest frame first."""
        if self.closed:
            return
        if len(self._frames) >= self._size:
            self._frames.popleft()
            self.dropped += 1
            self._hub.dropped += 1
        self._frames.append(data)
        self._ready.set()

    async def next(self) -> bytes | None:
        """The next frame; None once the stream is closed (frames still queued are left:
        a closing server does not wait for a slow reader)."""
        while not self.closed:
            if self._frames:
                return self._frames.popleft()
            self._ready.clear()
            await self._ready.wait()
        return None

    def close(self) -> None:
        self.closed = True
        self._frames.clear()
        self._ready.set()


class Hub:
    """The subscribers of one feed."""

    def __init__(self, *, max_streams: int = 32, queue_size: int = 64) -> None:
        if max_streams < 1 or queue_size < 1:
            raise ValueError("max_streams and queue_size must be at least 1")
        self.max_streams = max_streams
        self.queue_size = queue_size
        self._subs: set[Subscriber] = set()
        self.closed = False
        #: frames dropped because a subscriber lagged (all subscribers, ever)
        self.dropped = 0
        #: streams refused because ``max_streams`` were open (or the hub was closed)
        self.refused = 0

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    @property
    def backlog(self) -> int:
        """The most frames any one subscriber has queued (at most ``queue_size``)."""
        return max((len(s) for s in self._subs), default=0)

    def full(self) -> bool:
        return self.closed or len(self._subs) >= self.max_streams

    def refusal(self) -> ResourceExhausted:
        """The error a stream refused now gets (counted)."""
        self.refused += 1
        why = "the server is shutting down" if self.closed else "too many status streams"
        return ResourceExhausted(f"{why} ({len(self._subs)} open); try again shortly")

    def subscribe(self) -> Subscriber:
        """A new stream; ``ResourceExhausted`` when ``max_streams`` are open or the hub is
        closed."""
        if self.full():
            raise self.refusal()
        sub = Subscriber(self, self.queue_size)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        sub.close()
        self._subs.discard(sub)

    def publish(self, data: bytes) -> None:
        for sub in self._subs:
            sub.offer(data)

    def close(self) -> None:
        """End every stream and refuse new ones (synchronous: callable from a signal
        handler, before the server waits for its connections)."""
        self.closed = True
        for sub in list(self._subs):
            self.unsubscribe(sub)
