"""The one place where the durable-task API turns what nats-py, the OS and msgspec raise
into ``ReachError``s. Every public task method (``TaskRef``, ``Batch``, the client's task
methods) runs inside ``task_errors``; a ``ReachError`` raised below passes unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

from .._nats import TRANSIENT
from ..errors import ConnectionFailed, ReachError

__all__ = ["task_errors"]


@contextmanager
def task_errors(what: str) -> Iterator[None]:
    """Translate for ``what`` (e.g. "task abc", "list tasks"): the server out of reach
    (or slow, or the connection closed) is ``ConnectionFailed``, a stored record or dead
    letter that does not decode is a ``ReachError`` saying so."""
    try:
        yield
    except ReachError:
        raise  # ConnectionFailed is an OSError and RequestTimeout a TimeoutError: ours
    except TRANSIENT as exc:
        raise ConnectionFailed(
            f"{what}: the task store is out of reach ({type(exc).__name__}: {exc})"
        ) from exc
    except msgspec.DecodeError as exc:
        raise ReachError(f"{what}: stored data does not decode ({exc})") from exc
