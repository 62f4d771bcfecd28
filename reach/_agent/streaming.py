"""Streaming replies, the agent's side (PROTOCOL.md 3.3): a capability whose handler is an
async generator sends each item it yields as a chunk frame, within the credit its caller
grants, and hears the caller on a stream subject of its own.

A streaming request is a request (intake, the priority queue, a worker, deadlines, every
way a handler can fail: ``workers``); what differs is what the handler returns. The worker
runs ``Outflow.pump`` in its place, which asks the generator for an item only while the
caller's credit lasts: with the window used, the generator stays suspended at its
``yield`` and the agent holds no chunk that waits to be sent. So a reader that stops
reading costs the agent one suspended generator, whatever the stream's length.

Every frame's reply-to is the stream's subject ``<prefix>.agent.<id>.$stream.<token>``
(one wildcard subscription for all of an agent's streams, read in nats-py's reading
task): the caller sends credit there (0: a keepalive) and ``cancel``. The first frame,
sent before the handler runs, is the header-only opened frame (``Reach-Chunk: 0``), so
the caller can speak from the start. A cancel, or a caller silent for ``PATIENCE`` seconds
once the opened frame is out (its process gone, its connection lost), cancels the handler
at once, as the deadline watch does: the worker
task is cancelled with ``Job.cut`` set, and ``workers`` takes it for what it is, not for a
stop. A handler cancelled while it waits at ``yield`` is closed there (``aclose``: its
``finally`` blocks run); one that ignores the cancel is closed at its next ``yield``, or,
still running 0.5 s later, abandoned as a handler past its deadline is (its worker
replaced): nothing a handler does keeps a worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.nuid import NUID

from .._client.stream import MAX_PATIENCE, MIN_PATIENCE
from .._codec import encode_payload
from .._delivery import publish, publish_by_nats
from .._nats import HEADROOM, NatsConnection, fits, permissions_of
from .._permissions import Violation
from ..wire import Header, StreamCancel, StreamControl, StreamCredit
from .model import AgentStats, Job

__all__ = [
    "CUT_CANCEL",
    "CUT_REFUSED",
    "CUT_SILENT",
    "MAX_PATIENCE",
    "MAX_WINDOW",
    "MIN_PATIENCE",
    "PATIENCE",
    "Outflow",
    "Outflows",
]

log = logging.getLogger("reach.agent")

#: seconds without a word from the caller (credit, keepalive) after which an opened
#: stream is stopped, unless the caller asks for another (``Reach-Stream-Patience``,
#: MIN_PATIENCE..MAX_PATIENCE): its caller sends something every 0.2 s while its event
#: loop runs, so this is the longest a caller's loop may be blocked (a synchronous step
#: of its reader) before its stream is taken for gone
PATIENCE = 5.0
#: the most chunks a caller may grant in its first window (more is ``bad_request``)
MAX_WINDOW = 1024
_SWEEP = 0.1  # seconds between two looks for silent callers, while streams run
#: why a stream's handler was cancelled (``Job.cut``): its caller's cancel, its silence,
#: or the server refusing a frame to the caller's reply subject (a user allowed one answer)
CUT_CANCEL, CUT_SILENT, CUT_REFUSED = "cancel", "silent", "refused"

_controls = msgspec.json.Decoder(StreamControl)
#: the opened frame's headers: chunk 0, no body (PROTOCOL.md 3.3)
_OPENED = {Header.CHUNK: "0"}


class ChunkTooLarge(Exception):
    """A chunk larger than the server's ``max_payload``: the stream fails."""


class Outflow:
    """One stream being sent: the handler's items, out within the caller's credit."""

    __slots__ = (
        "granted",
        "heard",
        "job",
        "nc",
        "owner",
        "patience",
        "subject",
        "task",
        "token",
        "waiter",
    )

    def __init__(
        self, owner: Outflows, token: str, job: Job, task: asyncio.Task[Any], window: int
    ) -> None:
        self.owner = owner
        self.token = token
        self.subject = owner.stem + token
        self.job = job
        self.task = task
        self.nc = owner.nc
        self.granted = window
        self.heard = 0.0  # loop time of the caller's last word (or of the opened frame)
        self.patience = job.patience or PATIENCE
        self.waiter: asyncio.Future[None] | None = None

    def grant(self, credit: int) -> None:
        """In nats-py's reading task."""
        self.granted += credit
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stop(self, why: str) -> None:
        """Cancel the handler (once; not over a deadline's cancellation), and have it
        watched from now on as one past its deadline (``Outflows.cut``): a handler that
        ignores the cancel is abandoned, so it keeps no worker."""
        job = self.job
        if job.cancelled:
            return
        job.cancelled, job.cut = True, why
        self.task.cancel()
        self.owner.cut(self.task, job)

    async def pump(self, fn: Callable[..., AsyncGenerator[Any, None]], *args: Any) -> None:
        """Run the handler ``fn(*args)``: each item as a chunk, while credit lasts."""
        job, nc = self.job, self.nc
        reply, via = job.msg.reply, self.subject
        loop = asyncio.get_running_loop()
        gen = fn(*args)
        try:
            # The opened frame, before the handler runs (written with chunk 1 when the
            # handler yields at once: time to first chunk): from now on the caller knows the
            # stream's subject, so its cancel and keepalives reach us, and its silence is
            # watched (a handler that hangs before its first item is stopped too).
            if not publish(nc, reply, b"", via, _OPENED, alone=False):
                await publish_by_nats(nc, reply, b"", via, _OPENED, alone=False)
            self.heard = loop.time()
            self.owner.watched()
            while True:
                while job.chunks >= self.granted and not job.cut:
                    await self._credit()
                if job.cut:
                    break
                try:
                    item = await anext(gen)
                except StopAsyncIteration:
                    return
                if job.cut:
                    # The handler took the stream's cancel for its own and went on to
                    # yield: nothing more is sent (its caller has left, or cannot be
                    # reached), and no credit is awaited (none will come).
                    break
                body = encode_payload(item)
                n = job.chunks + 1
                headers = {Header.CHUNK: str(n)}
                if len(body) > nc.max_payload - HEADROOM and not fits(nc, body, headers):
                    raise ChunkTooLarge(f"chunk {n} of {len(body)} bytes is too large")
                job.chunks = n
                first = n == 1
                # the first out now (time to first chunk); the others with what follows
                if not publish(nc, reply, body, via, headers, alone=first):
                    await publish_by_nats(nc, reply, body, via, headers, alone=first)
        except BaseException:
            self.owner.close(self)
            await gen.aclose()  # suspended at its yield (one that raised: closed already)
            raise
        finally:
            self.owner.close(self)  # before any other await: nothing cancels it later
        await gen.aclose()  # cut, and it ignored that: closed at its yield

    async def _credit(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self.waiter = waiter
        self.owner.stats.stream_waits += 1
        try:
            await waiter
        finally:
            self.waiter = None


class Outflows:
    """An agent's streams being sent, by token: their callers' words and their silence."""

    def __init__(
        self, stem: str, stats: AgentStats, cut: Callable[[asyncio.Task[Any], Job], None]
    ) -> None:
        """``cut(task, job)``: a stream's handler was cancelled for its caller (the
        workers watch it from then on, as one past its deadline)."""
        #: ``<prefix>.agent.<id>.$stream.``: a stream's subject is this and its token
        self.stem = stem
        self.stats = stats
        self.cut = cut
        self.open: dict[str, Outflow] = {}
        self.nc: NatsConnection
        self._seq = 0
        #: tokens differ from those of an earlier run of this agent id, so a late word
        #: from an old stream's caller reaches no stream of this one
        self._run = NUID().next().decode()[:8]
        self._armed = asyncio.Event()

    def start(self, nc: NatsConnection) -> None:
        self.nc = nc
        perms = permissions_of(nc)
        if perms is not None:
            perms.listen(self.refused)

    def refused(self, violation: Violation) -> None:
        """The server refused a publish on this connection (``reach._permissions``): a
        stream whose caller's reply subject it was stops, since none of its frames can
        reach the caller. Under ``allow_responses: true`` the opened frame is the one
        answer allowed and chunk 1 is refused: the user needs ``allow_responses: {max:
        -1, expires: ...}``."""
        if violation.kind != "publish":
            return
        for flow in list(self.open.values()):
            if flow.job.msg.reply.lower() != violation.subject or flow.job.cut:
                continue
            self.stats.streams_refused += 1
            log.warning(
                "agent: stream %s (request id %s) stopped: NATS refused its frames to the"
                " caller's reply subject %r; a streaming agent's user needs"
                ' allow_responses: {max: -1, expires: "10m"} (allow_responses: true lets'
                " one message through)",
                flow.token,
                flow.job.request_id or "-",
                violation.subject,
            )
            flow.stop(CUT_REFUSED)

    def open_for(self, job: Job, task: asyncio.Task[Any]) -> Outflow:
        self._seq += 1
        token = f"{self._run}{self._seq}"  # unique: the subject names the agent
        flow = Outflow(self, token, job, task, job.window)
        self.open[token] = flow
        job.chunks = 0
        job.via = flow.subject
        self.stats.streams += 1
        return flow

    def close(self, flow: Outflow) -> None:
        self.open.pop(flow.token, None)

    def watched(self) -> None:
        """A stream sent its opened frame: its caller's silence is watched from now on."""
        if not self._armed.is_set():
            self._armed.set()

    def on_control(self, msg: Msg) -> None:
        """A caller's word (``subscribe_direct``: in nats-py's reading task)."""
        flow = self.open.get(msg.subject[len(self.stem) :])
        if flow is None:
            return  # the stream ended meanwhile (a keepalive on its way, a late cancel)
        try:
            control = _controls.decode(msg.data)
        except msgspec.DecodeError:
            self.stats.invalid += 1
            return
        flow.heard = asyncio.get_running_loop().time()
        if isinstance(control, StreamCredit):
            self.stats.stream_credits += 1
            if 0 < control.credit <= MAX_WINDOW:
                flow.grant(control.credit)
        elif isinstance(control, StreamCancel):
            self.stats.streams_cancelled += 1
            flow.stop(CUT_CANCEL)

    async def watch(self) -> None:
        """Stop the streams whose callers went silent. One look every ``_SWEEP`` while a
        stream has sent its first chunk; an agent with none does not wake up."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.open:
                self._armed.clear()
                await self._armed.wait()
            await asyncio.sleep(_SWEEP)
            now = loop.time()
            for flow in list(self.open.values()):
                if flow.heard and now - flow.heard > flow.patience:
                    self.stats.streams_silent += 1
                    log.info(
                        "agent: stream %s (request id %s) stopped: its caller said nothing for %gs",
                        flow.token,
                        flow.job.request_id or "-",
                        flow.patience,
                    )
                    flow.stop(CUT_SILENT)
