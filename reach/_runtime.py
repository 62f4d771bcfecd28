"""Running a coroutine at a program's edge, on uvloop when it is installed, and being
told to stop by SIGTERM or SIGINT.

A program that drains on stop hears the first signal as "stop": it says on stderr how long
the drain may take and starts it. A second Ctrl-C (SIGINT) while it drains is "stop now":
one line, whatever must not outlive the process is ended (child processes), and the
process exits with status 130 at once, with no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

__all__ = ["Stopping", "exit_now", "loop_factory", "on_stop_signals", "run_async", "stop_now"]

#: The exit status of a process stopped at once by a second Ctrl-C (128 + SIGINT).
STOPPED_NOW = 130


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


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr closed: nothing to tell
        print(text, file=sys.stderr, flush=True)


def stop_now(abandon: Callable[[], None] | None = None) -> NoReturn:
    """End the process at once (status 130): ``abandon()`` first (e.g. kill children)."""
    _say("stopping now: in-flight work is abandoned")
    try:
        if abandon is not None:
            abandon()
    finally:
        exit_now(STOPPED_NOW)


def exit_now(code: int) -> NoReturn:
    """End the process at once with ``code``, its output flushed: past a thread that no
    cancellation reaches (it would hold the interpreter's exit)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


class Stopping:
    """What SIGTERM and SIGINT do to a program that drains on stop.

    The first signal calls ``stop(signal)`` and, when ``draining`` says what the drain does
    and for how long ("draining in-flight work for up to 30s"), says so on stderr. Later
    SIGTERMs change nothing (the drain is under way); a SIGINT (Ctrl-C again) calls
    ``stop_now(abandon)``.
    """

    def __init__(
        self,
        stop: Callable[[signal.Signals], None],
        *,
        draining: str | None = None,
        abandon: Callable[[], None] | None = None,
    ) -> None:
        self._stop = stop
        self.draining = draining
        self.abandon = abandon
        self.stopping = False

    def __call__(self, sig: signal.Signals) -> None:
        if not self.stopping:
            self.stopping = True
            if self.draining is not None:
                hint = "; press Ctrl-C again to stop now" if sig == signal.SIGINT else ""
                _say(f"stopping: {self.draining}{hint}")
            self._stop(sig)
        elif sig == signal.SIGINT:
            stop_now(self.abandon)


@contextlib.contextmanager
def on_stop_signals(
    callback: Callable[[signal.Signals], None],
    *,
    draining: str | None = None,
    abandon: Callable[[], None] | None = None,
) -> Iterator[Stopping]:
    """While the block runs, SIGTERM and SIGINT go to a ``Stopping(callback, ...)`` on the
    running loop instead of ending the process (where the loop can take signal handlers:
    not off the main thread, nor on Windows). The block should hold the drain too, so
    that a second Ctrl-C during it is heard."""
    loop = asyncio.get_running_loop()
    stopping = Stopping(callback, draining=draining, abandon=abandon)
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stopping, sig)
            installed.append(sig)
    try:
        yield stopping
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
