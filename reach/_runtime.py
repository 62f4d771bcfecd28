"""Running a coroutine at a program's edge, on uvloop when it is installed, and being
told to stop by SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)


@contextlib.contextmanager
def on_stop_signals(callback: Callable[[signal.Signals], None]) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT call ``callback(signal)`` on the running
    loop instead of ending the process (where the loop can take signal handlers: not off
    the main thread, nor on Windows)."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, callback, sig)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
