"""``Call``: what stays the same across the attempts of one request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._inbox import StreamSink
from .._routing import Policy, TableView
from ..wire import Priority
from .metrics import CapCells

__all__ = ["Call"]


@dataclass(slots=True)  # not frozen: a frozen init costs ~1 µs per request
class Call:
    """What stays the same across the attempts of one request (``Inbox.send`` reads the
    first four: ``reach._inbox.Asked``)."""

    capability: str
    data: bytes
    request_id: str | None
    response_type: Any
    affinity_key: str | None
    version: str | None
    tags: tuple[str, ...]
    priority: Priority
    policy: Policy
    table: TableView | None  # None: the queue group
    cells: CapCells | None = None  # metrics; None when they are off
    stream: StreamSink | None = None  # a streaming call's frames go there
