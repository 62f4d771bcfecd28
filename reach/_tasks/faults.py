"""Faults of JetStream as the durable-task API meets them: translated or waited out.

``task_errors`` is the one place where the task API turns what nats-py, the OS and msgspec
raise into ``ReachError``s. Every public task method (``TaskRef``, ``Batch``, the client's task
methods) runs inside it; a ``ReachError`` raised below passes unchanged. ``patiently`` tries
an operation again while JetStream cannot answer yet."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import msgspec
import nats.js.errors

from .._nats import TRANSIENT, NatsConnection, check_refused, jetstream_unready, refusals
from ..errors import ConfigurationError, ConnectionFailed, ReachError

__all__ = ["patiently", "task_errors"]

log = logging.getLogger("reach.tasks")
T = TypeVar("T")
_FIRST_PAUSE, _LONGEST_PAUSE = 0.2, 2.0


@contextmanager
def task_errors(what: str, *, store: str = "task store") -> Iterator[None]:
    """Translate for ``what`` (e.g. "task abc", "list tasks"): the server out of reach
    (or slow, or the connection closed) is ``ConnectionFailed``, a request it refused
    (400) ``ConfigurationError`` with its reason, a stored record or dead
    letter that does not decode is a ``ReachError`` saying so."""
    try:
        yield
    except ReachError:
        raise  # ConnectionFailed is an OSError and RequestTimeout a TimeoutError: ours
    except nats.js.errors.BadRequestError as exc:
        # the server answered and refused it: waiting or reconnecting would not help
        raise ConfigurationError(f"{what}: the server refused it: {exc.description}") from exc
    except TRANSIENT as exc:
        raise ConnectionFailed(
            f"{what}: the {store} is out of reach ({type(exc).__name__}: {exc})"
        ) from exc
    except msgspec.DecodeError as exc:
        raise ReachError(f"{what}: stored data does not decode ({exc})") from exc


async def patiently(
    nc: NatsConnection,
    what: str,
    op: Callable[[], Awaitable[T]],
    *,
    until: float,
    advice: str = "",
    stopped: Callable[[], bool] = lambda: False,
) -> T:
    """``op()``, tried again while JetStream cannot answer yet (a stream or the meta group
    between leaders, a server restarting), with jittered backoff, until the monotonic
    time ``until``; then ``ConnectionFailed``. An answer that refused it, a refusal by
    permissions (``Unauthorized``), a ``ReachError``, a closed connection or ``stopped()``
    end it at once: waiting would not change them."""
    pause, tries = _FIRST_PAUSE, 0
    while True:
        mark = refusals(nc)
        try:
            return await op()
        except ReachError:
            raise
        except TRANSIENT as exc:
            check_refused(nc, what, exc, since=mark)
            if not jetstream_unready(exc) or nc.is_closed:
                raise
            tries += 1
            left = until - time.monotonic()
            if left <= 0 or stopped():
                raise ConnectionFailed(
                    f"{what}: JetStream did not answer"
                    + (" (stopped while waiting)" if stopped() else "")
                    + f", {tries} tries ({type(exc).__name__}: {exc}){advice}"
                ) from exc
            (log.warning if tries == 1 else log.debug)(
                "%s: JetStream not answering (%s), trying again", what, exc
            )
            await asyncio.sleep(min(random.uniform(0, pause), left))  # full-jitter backoff
            pause = min(pause * 2, _LONGEST_PAUSE)
