"""Waiting for a condition that has no event of its own."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0
) -> None:
    """Wait until ``condition()`` (sync or async) holds, checked every millisecond or so;
    TimeoutError if it never does.

    For state that has no event to await (a counter inside an agent, a routing table),
    without guessing a sleep long enough for it.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.001)
