"""Handles on submitted tasks: ``TaskRef`` (one task) and ``Batch`` (many).

Their methods raise only ``ReachError``s (``faults.task_errors``). A waiting ref that
hears of its task's end on its client's own subject (``own``) re-reads the record only in
case that notice was lost, at most every 30 s (a look sooner than ``FULL_LOOK`` reads the
record alone: a task queued behind many others costs one read per look, not three); any
other ref follows the record's KV watch, and polls every 5 s at most only while it cannot.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from .._codec import decoder_for, now_ms
from .._nats import TRANSIENT
from ..errors import (
    Attempt,
    ConnectionFailed,
    InvalidReply,
    ReachError,
    RemoteError,
    RequestTimeout,
    TaskNotFound,
)
from ..errors import error_for_code as _error_for_code
from ..wire import ErrorBody
from ..wire.tasks import TaskRecord, TaskState
from .faults import task_errors
from .states import advance
from .store import Conflict, Stored, TaskStore, decode_record

__all__ = [
    "FULL_LOOK",
    "NOTICED_POLL_CAP",
    "UNNOTICED_POLL_CAP",
    "Batch",
    "BatchProgress",
    "TaskRef",
    "cancel_record",
    "poll_delays",
    "read_record",
    "remove_messages",
    "task_error",
    "value_of",
]

log = logging.getLogger("reach.client")

S = TaskState
#: seconds between looks at most, for a ref told of the end on its own subject
NOTICED_POLL_CAP = 30.0
#: ... and for one that is not, while it cannot follow the record's KV watch
UNNOTICED_POLL_CAP = 5.0
_FIRST_POLL = 0.2
#: seconds apart at least for a waiter's look at its own task to find out whether the task
#: still exists (its message, for a PENDING one); a quicker look reads the record alone
FULL_LOOK = 5.0


def _jitter() -> float:
    return random.uniform(0.5, 1.0)


def poll_delays(*, noticed: bool, jitter: Callable[[], float] = _jitter) -> Iterator[float]:
    """Seconds between looks at a waited-for record: doubling from 0.2 s to the cap, each
    scaled by ``jitter()`` (0.5..1) so the waiters of a batch do not look all at once."""
    cap = NOTICED_POLL_CAP if noticed else UNNOTICED_POLL_CAP
    delay = _FIRST_POLL
    while True:
        yield delay * jitter()
        delay = min(delay * 2, cap)


def task_error(rec: TaskRecord) -> RemoteError:
    """The error a FAILED or CANCELLED task raises, with its attempts."""
    default = "cancelled" if rec.state is S.CANCELLED else "failed"
    err = rec.error or ErrorBody(code=default, message=str(rec.state).lower())
    attempts = [
        Attempt(a.agent_id, a.outcome, float(max(0, a.ended_ms - a.started_ms)))
        for a in rec.attempts
    ]
    return _error_for_code(err.code)(
        f"task {rec.task_id} {str(rec.state).lower()}: {err.message}",
        capability=rec.capability,
        agent_id=rec.agent_id,
        request_id=rec.task_id,
        attempts=attempts,
        code=err.code,
        retryable=False,
    )


def value_of(rec: TaskRecord, response_type: Any = Any) -> Any:
    """A final record's result decoded as ``response_type``, or its error raised."""
    if rec.state is not S.SUCCEEDED:
        raise task_error(rec)
    try:
        return decoder_for(response_type)(rec.result or b"")
    except (msgspec.DecodeError, ValueError) as exc:
        raise InvalidReply(
            f"task {rec.task_id}: result does not decode: {exc}",
            capability=rec.capability,
            agent_id=rec.agent_id,
            request_id=rec.task_id,
        ) from None


async def read_record(store: TaskStore, task_id: str) -> Stored | None:
    """``store.lookup`` for callers: a server out of reach is ``ConnectionFailed``."""
    with task_errors(f"task {task_id}"):
        return await store.lookup(task_id)


async def cancel_record(store: TaskStore, task_id: str) -> TaskRecord:
    """Cancel ``task_id`` in its record: CANCELLED before it runs, else a request its
    agent acts on. A SCHEDULED task's schedule is deleted first: once it is gone nothing
    can fire, so CANCELLED is safe to write; if it is gone already it fired (an agent
    may be running it without a record yet), and the cancel looks again and follows the
    PENDING/RUNNING path like any other task's."""
    for _ in range(16):
        st = await store.lookup(task_id)
        if st is None:
            raise TaskNotFound(task_id)
        rec = st.record
        if rec.final or rec.cancel_requested:
            return rec
        if rec.state is S.SCHEDULED and rec.seq and not await store.delete_message(rec.seq):
            continue  # it fired between the look and the delete
        if rec.state in (S.SCHEDULED, S.PENDING, S.RETRYING):
            new = advance(
                rec,
                [S.CANCELLED],
                now_ms(),
                "cancelled",
                error=ErrorBody(code="cancelled", message="cancelled before it ran"),
                callback_state="pending" if rec.callback else "",
            )
        else:
            new = msgspec.structs.replace(rec, cancel_requested=True, updated_ms=now_ms())
        try:
            await store.write(new, st.revision)
            return new
        except Conflict:
            continue
    raise ReachError(f"task {task_id}: could not cancel, its record kept changing")


#: messages of one task deleted at most per call (its own, one republished by a sweep,
#: one put back as a new message: a handful at the very most)
_MAX_MESSAGES = 8


async def remove_messages(store: TaskStore, task_id: str) -> int:
    """Delete every message of ``task_id`` from the work queue (found by subject, newest
    first); how many. A message an agent holds goes too: its ack is then a no-op, and its
    record (final, or asking for a cancel) tells the agent what to do."""
    removed = 0
    for _ in range(_MAX_MESSAGES):
        seq = await store.message_of(task_id)
        if not seq:
            break
        if await store.delete_message(seq):
            removed += 1
    return removed


class Following(Protocol):
    """What a handle needs of the client's task side (``submit.Tasks``): its store, its
    final notices, and the cancel."""

    @property
    def store(self) -> TaskStore: ...
    @property
    def notify(self) -> str: ...
    def waiter(self, task_id: str) -> asyncio.Future[TaskRecord]: ...
    def unwait(self, task_id: str, fut: asyncio.Future[TaskRecord]) -> None: ...
    async def cancel(self, task_id: str) -> TaskRecord: ...


class TaskRef:
    """A submitted task, from any process: its status, result, cancel and changes."""

    __slots__ = ("_own", "_tasks", "capability", "task_id")

    def __init__(
        self, tasks: Following, task_id: str, capability: str = "", *, own: bool = False
    ) -> None:
        self._tasks = tasks
        self.task_id = task_id
        self.capability = capability
        self._own = own  # submitted by this client: its final record is sent to us

    def __repr__(self) -> str:
        return f"TaskRef({self.task_id!r}, {self.capability!r})"

    async def status(self) -> TaskRecord:
        """The task's record now; ``TaskNotFound`` if there is none."""
        st = await read_record(self._tasks.store, self.task_id)
        if st is None:
            raise TaskNotFound(self.task_id)
        return st.record

    async def result(self, timeout: float | None = None, response_type: Any = Any) -> Any:
        """Wait for the end; the result, or the task's error raised (with its attempts)."""
        return value_of(await self.wait(timeout), response_type)

    async def wait(self, timeout: float | None = None) -> TaskRecord:
        """Wait for the final record (a failure is returned, not raised)."""
        tasks = self._tasks
        tasks.store  # noqa: B018  NotStarted once the client closed
        fut = tasks.waiter(self.task_id)
        try:
            async with asyncio.timeout(timeout):
                with task_errors(f"task {self.task_id}"):
                    return await self._follow(fut)
        except TimeoutError:
            raise RequestTimeout(
                f"task {self.task_id} did not finish within {timeout}s (it goes on)",
                capability=self.capability,
                request_id=self.task_id,
            ) from None
        finally:
            tasks.unwait(self.task_id, fut)

    async def _follow(self, fut: asyncio.Future[TaskRecord]) -> TaskRecord:
        tasks = self._tasks
        noticed = self._own
        delays = poll_delays(noticed=noticed)
        look = not noticed  # ours: the notice usually comes before a look
        delay = 0.0
        while True:
            if look:
                try:
                    # ours, looked at soon: only a lost notice matters, and the record
                    # alone tells (one read; finding a PENDING task's message is two more)
                    quick = noticed and delay < FULL_LOOK
                    rec: TaskRecord | None = await (self._record() if quick else self.status())
                except ConnectionFailed:
                    rec = None  # the server restarts: wait on, within the timeout
                if rec is not None and rec.final:
                    return rec
                if rec is not None and (not tasks.notify or rec.notify != tasks.notify):
                    try:
                        return await self._watch_final()
                    except ConnectionFailed:
                        pass  # the watch broke: look again in a while, then watch again
                elif rec is not None and not noticed:  # ours after all (client.task)
                    noticed, delays = True, poll_delays(noticed=True)
            look = True
            delay = next(delays)
            done, _ = await asyncio.wait({fut}, timeout=delay)
            if done:
                return fut.result()

    async def _record(self) -> TaskRecord | None:
        """The record alone; None while there is none (the task is PENDING, or gone: only
        ``status`` tells which)."""
        with task_errors(f"task {self.task_id}"):
            st = await self._tasks.store.get(self.task_id)
        return st.record if st else None

    async def _watch_final(self) -> TaskRecord:
        async for rec in self.watch():
            if rec.final:
                return rec
        raise TaskNotFound(self.task_id)  # the record went away while we watched

    async def cancel(self) -> TaskRecord:
        """Cancel the task (harmless when it already ended); the record as written."""
        return await self._tasks.cancel(self.task_id)

    async def watch(self) -> AsyncIterator[TaskRecord]:
        """Every change of the record as it is written (a KV watch), until it is final.
        Ends with ``NotStarted`` when the client closes."""
        tasks = self._tasks
        store = tasks.store
        with task_errors(f"watch of task {self.task_id}"):
            first = await store.lookup(self.task_id)
            if first is None:
                raise TaskNotFound(self.task_id)
            kv = await store.js.key_value(store.bucket)
            watcher = await kv.watch(self.task_id)
            fut = tasks.waiter(self.task_id)  # the final notice, or the client closing
            follow = _Follow(watcher, fut)
            try:
                if first.revision == 0:
                    yield first.record  # PENDING: still a message no agent has taken
                while True:
                    entry = await follow.next()
                    if entry is _NOTICE:
                        yield fut.result()  # the watch did not bring the end in time
                        return
                    if entry is None:
                        continue  # the end of the initial values
                    if entry.operation is not None or not entry.value:
                        return  # deleted or expired
                    rec = decode_record(entry.value, self.task_id, entry.revision or 0)
                    yield rec
                    if rec.final:
                        return
            finally:
                tasks.unwait(self.task_id, fut)
                try:
                    await watcher.stop()  # type: ignore[no-untyped-call]
                except TRANSIENT as exc:  # the connection closed: the watch is gone anyway
                    log.debug("task %s: stopping its watch: %s", self.task_id, exc)


_NOTICE = object()
#: seconds a watch that heard the final notice reads on for what was written before it
_DRAIN = 1.0


class _Follow:
    """A task's KV watch beside its final notice (``notice``): the watch's entries until
    the notice comes, then those it still brings within ``_DRAIN`` seconds, and then
    ``_NOTICE``. The final record was written before its notice was sent, but the notice
    can overtake the watch: what was written before the end (the last progress, say) still
    comes, in order, the end included. nats-py ends no watch when the connection closes:
    the notice (or ``NotStarted``, raised) ends the wait."""

    def __init__(self, watcher: Any, notice: asyncio.Future[TaskRecord]) -> None:
        self.watcher = watcher
        self.notice = notice
        self._until: float | None = None  # the notice came: read on until then

    async def next(self) -> Any:
        """The next entry (None: the end of the initial values), or ``_NOTICE``."""
        if self._until is None:
            entry = await _next_or(self.watcher, self.notice)
            if entry is not _NOTICE:
                return entry
            self.notice.result()  # NotStarted: the client closed
            self._until = asyncio.get_running_loop().time() + _DRAIN
        return await _next_before(self.watcher, self._until)


async def _next_or(watcher: Any, fut: asyncio.Future[TaskRecord]) -> Any:
    """The KV watch's next entry (None: the end of its initial values), or ``_NOTICE``
    when ``fut`` is done first: nats-py ends no watch when the connection closes."""

    async def step() -> Any:
        return await watcher.__anext__()

    nxt = asyncio.ensure_future(step())
    try:
        await asyncio.wait({nxt, fut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not nxt.done():
            nxt.cancel()
            await asyncio.wait({nxt})
    if not nxt.cancelled():
        return nxt.result()
    return _NOTICE


async def _next_before(watcher: Any, deadline: float) -> Any:
    """The KV watch's next entry, or ``_NOTICE`` once ``deadline`` passes."""
    try:
        async with asyncio.timeout_at(deadline):
            return await watcher.__anext__()
    except TimeoutError:
        return _NOTICE


@dataclass(frozen=True, slots=True)
class BatchProgress:
    done: int
    failed: int
    total: int

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed


class Batch:
    """Tasks submitted together. An item that could not be submitted holds its error."""

    def __init__(self, items: list[TaskRef | BaseException]) -> None:
        self.items = items
        self.refs = [i for i in items if isinstance(i, TaskRef)]
        self._ended: dict[int, bool] = {
            i: False for i, item in enumerate(items) if not isinstance(item, TaskRef)
        }

    def __len__(self) -> int:
        return len(self.items)

    @property
    def progress(self) -> BatchProgress:
        """Finished (succeeded), failed (any other end, or not submitted), and total, as
        far as this batch has seen (``results()`` or ``as_completed()`` look)."""
        ok = sum(1 for v in self._ended.values() if v)
        return BatchProgress(done=ok, failed=len(self._ended) - ok, total=len(self.items))

    async def _one(self, i: int, timeout: float | None) -> TaskRecord | BaseException:
        item = self.items[i]
        if not isinstance(item, TaskRef):
            return item
        try:
            rec = await item.wait(timeout)
        except ReachError as exc:
            return exc
        self._ended[i] = rec.state is S.SUCCEEDED
        return rec

    async def results(self, timeout: float | None = None, response_type: Any = Any) -> list[Any]:
        """One entry per item, in order: its result, or its error (a ``ReachError``
        instance, not raised)."""
        outs = await asyncio.gather(*(self._one(i, timeout) for i in range(len(self.items))))
        values: list[Any] = []
        for out in outs:
            if isinstance(out, BaseException):
                values.append(out)
                continue
            try:
                values.append(value_of(out, response_type))
            except ReachError as exc:
                values.append(exc)
        return values

    async def as_completed(self, timeout: float | None = None) -> AsyncIterator[TaskRef]:
        """Each submitted task as it ends (any final state)."""
        waits = {
            asyncio.ensure_future(self._one(i, timeout)): item
            for i, item in enumerate(self.items)
            if isinstance(item, TaskRef)
        }
        try:
            pending = set(waits)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    yield waits[fut]
        finally:
            for fut in waits:
                fut.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
