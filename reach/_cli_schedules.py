"""The schedule commands of ``reach``: ``schedules list|add|rm|pause|resume`` (periodic
schedules on the server's own scheduler) over the ``Client`` API; errors end the command
through ``cli.main``."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from ._cli_common import PAYLOAD_HELP, json_or_text, parse_duration, read_payload, table
from ._client import Client
from ._tasks import ScheduleInfo
from .settings import ReachSettings
from .wire import Priority

__all__ = ["add_schedule_commands"]

_NAME = "reach-cli"


def _stamp(ms: int | None) -> str:
    if not ms:
        return "-"
    return datetime.datetime.fromtimestamp(ms / 1000).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def _json(info: ScheduleInfo) -> dict[str, Any]:
    spec: dict[str, Any] = msgspec.to_builtins(info.spec)
    spec["payload"] = json_or_text(info.spec.payload)
    return {**spec, "stored_ms": info.stored_ms, "next_ms": info.next_ms, "last_ms": info.last_ms}


def _print(infos: list[ScheduleInfo], as_json: bool) -> None:
    if as_json:
        print(json.dumps([_json(i) for i in infos], indent=2, ensure_ascii=False))
        return
    if not infos:
        print("no schedules", file=sys.stderr)
        return
    rows = [
        [
            i.name,
            i.capability,
            i.when,
            str(i.spec.priority),
            i.spec.overlap,
            "paused" if i.paused else _stamp(i.next_ms),
            _stamp(i.last_ms),
        ]
        for i in infos
    ]
    print(table(rows, ["NAME", "CAPABILITY", "WHEN", "PRIO", "OVERLAP", "NEXT", "LAST PERIOD"]))


async def _schedules(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name=_NAME) as client:
        what = args.schedule_command
        if what == "list":
            _print(await client.schedules(), args.json)
        elif what == "add":
            every = args.every.total_seconds() if args.every is not None else None
            info = await client.schedule(
                args.name,
                args.capability,
                read_payload(args.payload),
                every=every,
                cron=args.cron,
                tz=args.tz,
                priority=args.priority,
                overlap=args.overlap,
                timeout=args.timeout,
            )
            _print([info], args.json)
        elif what == "rm":
            if not await client.unschedule(args.name):
                print(f"error: bad_request: no schedule is called {args.name!r}", file=sys.stderr)
                return 1
            print(f"schedule {args.name} removed")
        else:
            pause = what == "pause"
            info = await (client.pause_schedule if pause else client.resume_schedule)(args.name)
            _print([info], args.json)
    return 0


def add_schedule_commands(
    sub: Any, with_url: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Add ``schedules`` (list, add, rm, pause, resume) to the ``reach`` parser."""
    p = sub.add_parser("schedules", help="periodic schedules: list, add, rm, pause, resume")
    cmds = p.add_subparsers(dest="schedule_command", required=True)
    p = with_url(cmds.add_parser("list", help="every schedule with its next firing"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_schedules, is_async=True)
    p = with_url(cmds.add_parser("add", help="add (or replace: a name is its identity) a schedule"))
    p.add_argument("name", help="letters, digits, - and _")
    p.add_argument("capability")
    p.add_argument("payload", nargs="?", default="null", help=PAYLOAD_HELP)
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--every", type=parse_duration, metavar="DURATION", help="e.g. 30s, 1h")
    when.add_argument("--cron", help="six fields, seconds first: '0 0 2 * * *', or @daily")
    p.add_argument("--tz", default=None, help="the cron line's time zone (e.g. Europe/Berlin)")
    p.add_argument(
        "--priority", default="normal", type=str.lower, choices=[x.value for x in Priority]
    )
    p.add_argument(
        "--overlap",
        default="allow",
        choices=["allow", "skip"],
        help="skip: no period starts while the previous one is not final",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per attempt")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_schedules, is_async=True)
    for name, text in (
        ("rm", "remove a schedule (tasks it made already run)"),
        ("pause", "stop firing a schedule until resumed"),
        ("resume", "fire a paused schedule again, from its next period"),
    ):
        p = with_url(cmds.add_parser(name, help=text))
        p.add_argument("name")
        p.add_argument("--json", action="store_true")
        p.set_defaults(run=_schedules, is_async=True)
