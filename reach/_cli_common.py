"""What the ``reach`` commands share: reading JSON arguments, printing values and tables."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from .errors import ConfigurationError

__all__ = ["json_or_text", "parse_json", "plain", "print_value", "status", "table", "tint"]

_COLOURS = {"UP": "32", "DEGRADED": "33", "PAUSED": "36", "UNKNOWN": "35", "DOWN": "31"}


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"payload is not valid JSON: {exc}") from None


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
