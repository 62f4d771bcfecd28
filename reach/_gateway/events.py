"""A task's changes as Server-Sent Events, from ``TaskRef.watch()``.

    id: 1
    event: state          (the state changed; ``progress`` when only progress did)
    data: {...record...}

and, after the final record, ``event: end`` (so an ``EventSource`` can close instead of
reconnecting). An idle stream gets a ``: ping`` comment every ``ping`` seconds, which
keeps proxies from cutting it. The watch runs in a task owned by the stream: it is
cancelled and awaited when the stream ends or the HTTP client goes away. A reader slower
than the changes gets the newest record (``Latest``), never a growing queue; the stream
holds one of the gateway's ``StreamSlots`` while it runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from .._tasks import TaskRecord, TaskRef
from ..errors import ReachError
from .errors import EdgeError, error_body
from .streams import Latest, StreamSlots

__all__ = ["frame", "sse", "task_events"]

log = logging.getLogger("reach.gateway")

_encode = msgspec.json.Encoder()


def frame(event: str, data: Any, event_id: int | None = None) -> bytes:
    """One event in the text/event-stream format (data is one JSON line: msgspec writes
    no newlines)."""
    head = b"id: %d\n" % event_id if event_id is not None else b""
    return head + b"event: " + event.encode() + b"\ndata: " + _encode.encode(data) + b"\n\n"


def sse(event: str, data: Any, event_id: int | None = None) -> str:
    return frame(event, data, event_id).decode()


async def task_events(
    ref: TaskRef,
    ping: float,
    render: Callable[[TaskRecord], dict[str, Any]],
    slots: StreamSlots,
) -> AsyncIterator[str]:
    try:
        with slots.slot():
            async for chunk in _events(ref, ping, render):
                yield chunk
    except EdgeError as exc:  # lost a race for the last slot
        yield sse("error", error_body(exc))


async def _events(
    ref: TaskRef, ping: float, render: Callable[[TaskRecord], dict[str, Any]]
) -> AsyncIterator[str]:
    latest: Latest[TaskRecord] = Latest()

    async def pump() -> None:
        error: ReachError | None = None
        try:
            async for rec in ref.watch():
                latest.put(rec)
                if rec.final:
                    break
        except ReachError as exc:
            error = exc
        except Exception:
            log.exception("events of task %s: the watch failed", ref.task_id)
            error = ReachError(f"the watch of task {ref.task_id} failed")
        finally:
            latest.end(error)

    watcher = asyncio.create_task(pump(), name=f"sse {ref.task_id}")
    try:
        n, state = 0, None
        while True:
            try:
                async with asyncio.timeout(ping):
                    item = await latest.take()
            except TimeoutError:
                yield ": ping\n\n"
                continue
            if isinstance(item, TaskRecord):
                n += 1
                yield sse("state" if item.state != state else "progress", render(item), n)
                state = item.state
                if item.final:
                    yield sse("end", {"task_id": item.task_id, "state": item.state.value})
                    return
            elif isinstance(item, ReachError):
                yield sse("error", error_body(item))
                return
            else:  # the watch ended without a final record: the record went away
                body = {"code": "task_not_found", "message": "the task's record went away"}
                yield sse("error", {**body, "task_id": ref.task_id, "retryable": False})
                return
    finally:
        watcher.cancel()
        await asyncio.wait([watcher])  # without taking a cancel of this stream for its own
