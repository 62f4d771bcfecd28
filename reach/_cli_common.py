"""What the ``reach`` commands share: reading JSON arguments, printing values and tables.

A payload argument is JSON text, ``-`` (read standard input) or ``@FILE`` (read the file):
neither is valid JSON, so the three never overlap, and a payload too big for a command line
("Argument list too long") comes from a pipe or a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from .errors import ConfigurationError

__all__ = [
    "PAYLOAD_HELP",
    "duration_of",
    "format_duration",
    "json_or_text",
    "parse_duration",
    "parse_json",
    "plain",
    "print_value",
    "read_payload",
    "status",
    "table",
    "tint",
]

PAYLOAD_HELP = "JSON payload; - reads it from stdin, @FILE from a file (default null)"

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_DURATIONS = re.compile(r"(?:\d+(?:\.\d+)?[smhd])+")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_of(text: str) -> datetime.timedelta | None:
    """``90s``, ``10m``, ``2h``, ``7d`` or several (``1h30m``) as a timedelta; None for
    anything else."""
    text = text.strip()
    if not _DURATIONS.fullmatch(text):
        return None
    try:
        return datetime.timedelta(
            seconds=sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(text))
        )
    except OverflowError:
        return datetime.timedelta.max  # beyond what a timedelta holds: its users refuse it


def parse_duration(text: str) -> datetime.timedelta:
    """argparse type of a duration (``duration_of``): anything else is a usage error."""
    got = duration_of(text)
    if got is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: give a number and a unit, e.g. 90s, 10m, 2h, 7d"
        )
    if got == datetime.timedelta.max:
        raise argparse.ArgumentTypeError(f"{text!r} is too long for a duration")
    return got


def format_duration(span: datetime.timedelta) -> str:
    """A duration as ``duration_of`` reads it: ``7d``, ``1h30m``, ``90s`` is ``1m30s``."""
    seconds = span.total_seconds()
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        whole, seconds = divmod(seconds, size)
        if whole:
            parts.append(f"{int(whole)}{unit}")
    if seconds or not parts:
        parts.append(f"{round(seconds, 3):g}s")
    return "".join(parts)


_COLOURS = {"UP": "32", "DEGRADED": "33", "PAUSED": "36", "UNKNOWN": "35", "DOWN": "31"}


def parse_json(text: str | bytes, where: str = "payload") -> Any:
    try:
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"{where} is not UTF-8 text: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{where} is not valid JSON: {exc}") from None


def read_payload(arg: str) -> Any:
    """A payload argument's value: JSON text, ``-`` for standard input, ``@FILE`` for a
    file. A file that cannot be read, or text that is not JSON, is ConfigurationError."""
    if arg == "-":
        return parse_json(sys.stdin.buffer.read(), "the payload on stdin")
    if arg.startswith("@"):
        name = arg[1:]
        if not name:
            raise ConfigurationError("@ needs a file name: @payload.json (or - for stdin)")
        try:
            data = Path(name).read_bytes()
        except FileNotFoundError:
            raise ConfigurationError(
                f"payload file {name!r} not found: give an existing file after @"
            ) from None
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read payload file {name!r}: {exc.strerror or exc}"
            ) from None
        return parse_json(data, f"payload file {name!r}")
    return parse_json(arg)


def json_or_text(data: bytes | None) -> Any:
    """A body as JSON when it is JSON, else as text (None for none)."""
    if not data:
        return None
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data.decode("utf-8", "replace")


def print_value(data: bytes) -> None:
    if not data:
        print("null")
        return
    try:
        print(json.dumps(msgspec.json.decode(data), indent=2, ensure_ascii=False))
    except msgspec.DecodeError:
        print(data.decode("utf-8", "replace"))


def status(text: str, colour: bool) -> str:
    return tint(text, text, colour)


def tint(text: str, status: str, colour: bool) -> str:
    """``text`` in the colour of ``status`` (an agent status name)."""
    return f"\033[{_COLOURS.get(status, '0')}m{text}\033[0m" if colour else text


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(plain(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [c + " " * (w - len(plain(c))) for c, w in zip(row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def plain(text: str) -> str:
    return re.sub(r"\033\[[0-9;]*m", "", text)
