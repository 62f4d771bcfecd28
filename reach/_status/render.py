"""The summary as a screen of text (colours optional, fitted to a terminal when its size is
given) and as JSON."""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec

from .._cli_common import table, tint
from ..wire import Status
from .model import CapabilityStatus, Summary, Traffic

__all__ = ["clip", "frame", "to_json"]

_ANSI = re.compile(r"\033\[[0-9;]*m")
_SHORT = {"UP": "UP", "DEGRADED": "DEG", "PAUSED": "PAUSED", "UNKNOWN": "UNK", "DOWN": "DOWN"}
_HEADER = ["CAPABILITY", "KIND", *_SHORT.values(), "REQ/S", "ERR/S", "MS", "INFL", "QUEUE"]


def to_json(summary: Summary) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(summary)
    return out


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.0f}" if x >= 1000 else f"{x:.1f}"


def _traffic(t: Traffic) -> str:
    if t.requests_per_s is None:
        return "rates unknown"
    return f"{_rate(t.requests_per_s)} req/s  {_rate(t.errors_per_s)} err/s  {_ms(t.latency_ms)} ms"


def _count(status: str, n: int, colour: bool) -> str:
    return tint(str(n), status, colour) if n else "0"


def _row(c: CapabilityStatus, colour: bool) -> list[str]:
    name = tint(f"! {c.name}", "DOWN", colour) if c.no_live else c.name
    kind = "+".join("req" if k == "request" else k for k in c.kinds) or "-"
    t = c.traffic
    cells = [name, kind]
    cells += [_count(s, c.instances.get(s, 0), colour) for s in _SHORT]
    cells += [_rate(t.requests_per_s), _rate(t.errors_per_s), _ms(t.latency_ms)]
    cells += [str(c.inflight), str(c.queue)]
    if c.tasks is not None:
        cells.append(f"{c.tasks.waiting}/{c.tasks.running}/{c.tasks.dead}")
    else:
        cells.append("-")
    return cells


def frame(
    summary: Summary,
    *,
    title: str = "reach status",
    colour: bool = False,
    width: int | None = None,
    height: int | None = None,
) -> list[str]:
    """The screen: fleet line, alerts, one row per capability (those with no live
    instance first), tasks, notes. With ``height``, rows that do not fit are counted in a
    last line; with ``width``, lines are cut to it."""
    fleet = summary.fleet
    stamp = time.strftime("%H:%M:%S", time.localtime(summary.wall_ms / 1000))
    over = f"over {summary.interval:.1f} s" if summary.interval is not None else "no rates yet"
    by_status = "  ".join(
        f"{tint(s, s, colour)} {fleet.instances.get(s, 0)}" for s in (x.value for x in Status)
    )
    head = [
        f"{title}  {stamp}  {over}",
        f"agents {fleet.agents}: {by_status}",
        f"traffic {_traffic(fleet.traffic)}  inflight {fleet.inflight}  queue {fleet.queue}",
    ]
    dark = [c.name for c in summary.capabilities if c.no_live]
    if dark:
        alert = f"NO LIVE INSTANCE: {', '.join(dark)}"
        head.append(tint(alert, "DOWN", colour))
    tail = _tasks(summary)
    if fleet.unmeasured:
        tail.append(
            f"# {fleet.unmeasured} live agent(s) did not answer $SRV.STATS twice:"
            " their traffic is not in the rates"
        )
    tail += [f"# {n}" for n in summary.notes]
    rows = [_row(c, colour) for c in summary.capabilities]
    more = 0
    if height is not None:
        room = max(1, height - len(head) - len(tail) - 2)  # a blank line, the header
        if len(rows) > room:
            keep = max(1, room - 1)  # and a line that counts the rest
            more, rows = len(rows) - keep, rows[:keep]
    body = table(rows, [*_HEADER, "TASKS W/R/DEAD"]).split("\n") if summary.capabilities else []
    if more:
        body.append(f"... {more} more capabilities")
    lines = [*head, "", *(body or ["no capabilities known (is a registry running?)"]), *tail]
    return [clip(line, width) for line in lines] if width is not None else lines


def _tasks(summary: Summary) -> list[str]:
    t = summary.tasks
    if t is None:
        return []
    line = f"tasks: {t.queued} queued"
    if t.unassigned:
        line += f" ({t.unassigned} for capabilities no agent has taken tasks of)"
    if t.scheduled:
        line += f", {t.scheduled} scheduled"
    if t.schedules:
        line += f", {t.schedules} periodic schedules"
    line += f", {t.dead} dead letters"
    states = "  ".join(f"{k} {v}" for k, v in sorted(t.states.items())) or "none"
    records = f"records: {states}"
    if t.capped:
        records += f"  (counted the {t.scanned} oldest of {t.keys} keys)"
    return ["", line, records]


def clip(line: str, width: int) -> str:
    """``line`` cut to ``width`` visible characters, its colour codes kept whole."""
    out: list[str] = []
    shown = pos = 0
    for m in _ANSI.finditer(line):
        text = line[pos : m.start()]
        take = text[: max(0, width - shown)]
        out.append(take)
        shown += len(take)
        out.append(m.group())
        pos = m.end()
    out.append(line[pos:][: max(0, width - shown)])
    return "".join(out)
