"""Waiting for a condition that has no event of its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until ``condition()`` holds (checked on every loop turn); TimeoutError if never.

    For state that has no event to await (a counter inside an agent), without guessing
    a sleep long enough for it.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.001)
