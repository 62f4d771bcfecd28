"""``reach status`` (one screen, from two samples ``--interval`` apart) and ``reach top``
(the same screen, redrawn until Ctrl-C).

Plain text and ANSI codes, no terminal library: the table helper and status colours of the
other commands already exist, and a redraw that moves the cursor home and overwrites each
line (on the terminal's alternate screen) does not flicker. ``rich`` would add three
packages to every agent's install for this one command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any, TextIO

from ._client import Client
from ._status import frame, summarize, take, to_json
from .settings import ReachSettings

__all__ = ["add_status_commands"]

_NAME = "reach-status"


def _colour(out: TextIO) -> bool:
    return out.isatty() and not os.environ.get("NO_COLOR")


async def _status(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name=_NAME) as client:
        first = None
        if args.interval > 0:  # rates need a first sample; the task census does not
            first = await take(client, timeout=args.timeout, task_scan=0)
            print(f"# sampling for {args.interval:g} s", file=sys.stderr, flush=True)
            await asyncio.sleep(args.interval)
        second = await take(client, timeout=args.timeout, task_scan=args.task_scan)
    summary = summarize(first, second)
    if args.json:
        print(json.dumps(to_json(summary), indent=2))
        return 0
    out = sys.stdout
    width = shutil.get_terminal_size().columns if out.isatty() else None
    title = f"reach status  prefix {settings.subject_prefix}"
    print("\n".join(frame(summary, title=title, colour=_colour(out), width=width)))
    return 0


class _Screen:
    """Where ``top`` draws: on a terminal, the alternate screen, each frame over the last;
    elsewhere (a pipe, a file), frames one after the other, a blank line between."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.opened = False

    def size(self) -> tuple[int | None, int | None]:
        if not self.tty:
            return None, None
        cols, lines = shutil.get_terminal_size()
        return cols, lines - 1

    def show(self, lines: list[str]) -> None:
        if not self.tty:
            self.out.write("\n".join(lines) + "\n\n")
        else:
            if not self.opened:
                self.out.write("\033[?1049h\033[?25l")  # alternate screen, cursor hidden
                self.opened = True
            self.out.write("\033[H" + "".join(line + "\033[K\n" for line in lines) + "\033[J")
        self.out.flush()

    def close(self) -> None:
        if self.opened:
            self.out.write("\033[?25h\033[?1049l")
            self.out.flush()
            self.opened = False


async def _top(args: argparse.Namespace, settings: ReachSettings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    screen = _Screen(sys.stdout)
    seen: set[str] = set()  # a capability that vanishes stays listed, with no live instance
    title = f"reach top  prefix {settings.subject_prefix}  (Ctrl-C quits)"
    try:
        async with Client(settings=settings, name=_NAME) as client:
            before = None
            shown = 0
            while not stop.is_set():
                sample = await take(client, timeout=args.timeout, task_scan=args.task_scan)
                summary = summarize(before, sample, seen)
                seen.update(c.name for c in summary.capabilities)
                width, height = screen.size()
                screen.show(
                    frame(
                        summary,
                        title=title,
                        colour=_colour(screen.out),
                        width=width,
                        height=height,
                    )
                )
                before, shown = sample, shown + 1
                if args.frames and shown >= args.frames:
                    break
                with contextlib.suppress(TimeoutError):  # time for the next frame
                    await asyncio.wait_for(stop.wait(), args.interval)
    finally:
        screen.close()
        for sig in signals:
            loop.remove_signal_handler(sig)
    return 0


def add_status_commands(
    sub: Any, with_url: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Add ``status`` and ``top`` to the ``reach`` parser's subcommands."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--task-scan",
            type=int,
            default=10_000,
            help="count task records by state among at most this many (0: no task counts)",
        )
        p.add_argument(
            "--timeout", type=float, default=1.0, help="seconds to wait for each agent's stats"
        )

    p = with_url(sub.add_parser("status", help="one screen: the fleet, its traffic, its tasks"))
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between the two samples (0: no rates)"
    )
    p.add_argument("--json", action="store_true")
    common(p)
    p.set_defaults(run=_status, is_async=True)

    p = with_url(sub.add_parser("top", help="the status screen, refreshed until Ctrl-C"))
    p.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    p.add_argument("--frames", type=int, default=0, help="exit after this many frames")
    common(p)
    p.set_defaults(run=_top, is_async=True)
