"""Streaming replies, the caller's side (``Client.stream``; the wire is PROTOCOL.md 3.3).

A stream is a request whose answer comes as frames on the caller's reply subject: chunks
numbered from 1, then an end frame (or an error frame) saying how many chunks were sent.
Until its first frame it is a request like any other: ``Requester.call`` routes it, fails
it over and counts it (the inbox hands the first frame to the stream instead of decoding
it). From then on the inbox passes every frame of that token to the stream's ``Flow``.

Flow control: the request grants ``window`` chunks; each chunk the reader takes is owed
back to the agent, and once half a window is owed the caller grants it (a ``credit``
message to the agent's stream subject, the frames' reply-to). So the agent sends at most
``window`` chunks the reader has not taken, and its handler's ``yield`` waits meanwhile:
a reader that stops reading costs the agent one suspended generator and the caller at
most ``window`` frames. A caller that says nothing for ``KEEPALIVE`` seconds sends what it
owes, maybe 0 (a keepalive), from one loop per client (``Streams``), so an agent knows its
caller is alive even while the reader dwells on a chunk, and cancels the handler of a
caller that has gone silent (``PATIENCE`` in ``reach._agent.streaming``).

Ending: the end frame ends the iteration; an error frame raises its error, after the
chunks before it; anything that cuts a started stream short (no frame within the idle
``timeout``, a chunk missing, the connection lost, the agent stopping) raises
``StreamBroken``, never a silent failover. A reader that leaves early (an exception,
``aclose()``, the end of ``async with``, cancellation) sends ``cancel``, so the agent stops
the handler at once; a stream object dropped unclosed (a ``break`` out of a bare ``async
for``) sends it when it is collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self, TypedDict

import msgspec
from nats.aio.msg import Msg

from .._background import Background
from .._codec import decoder_for, error_from_reply
from .._delivery import publish, publish_by_nats
from .._inbox import Inbox
from .._nats import TRANSIENT
from .._routing import Policy
from ..errors import (
    ConfigurationError,
    ConnectionFailed,
    InvalidReply,
    NotStarted,
    ReachError,
    RequestTimeout,
    StreamBroken,
)
from ..wire import Header, Priority, StreamCancel, StreamCredit
from .attempts import Requester

__all__ = ["KEEPALIVE", "MAX_PATIENCE", "MAX_WINDOW", "MIN_PATIENCE", "WINDOW", "Stream", "Streams"]

log = logging.getLogger("reach.client")

#: chunks a stream may have on their way or unread, unless the caller says otherwise
WINDOW = 16
#: the most a caller may grant at once (an agent refuses more with ``bad_request``)
MAX_WINDOW = 1024
#: seconds: a caller that has sent nothing to the agent for this long sends its credit
#: (0 when it owes none): the keepalive an agent counts on (PROTOCOL.md 3.3)
KEEPALIVE = 0.2
#: seconds: the bounds of the silence a caller may ask its agent to bear
#: (``Reach-Stream-Patience``; the agent's default is ``reach._agent.streaming.PATIENCE``)
MIN_PATIENCE, MAX_PATIENCE = 0.5, 600.0

_encode = msgspec.json.Encoder().encode
_CANCEL = _encode(StreamCancel())


class Flow:
    """One stream's frames, as the inbox hands them over, and the credit owed back.

    Frames wait in ``frames`` until the reader takes them; the agent sends no more than
    it was granted, so there are at most ``window`` chunks and the last frame (``limit``
    counts a frame more for slack): more is an agent that ignores its credit, and ends
    the stream."""

    __slots__ = (
        "attempts",
        "control",
        "ended",
        "epoch",
        "error",
        "frames",
        "ignored",
        "limit",
        "owed",
        "sent_at",
        "threshold",
        "token",
        "waiter",
        "window",
    )

    def __init__(self, window: int) -> None:
        self.window = window
        self.threshold = max(1, window // 2)  # grant back once this many are owed
        self.limit = window + 2
        self.frames: deque[Msg] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.token = ""
        #: the agent's stream subject (the first frame's reply-to): credit and cancel go
        #: there, and a later frame naming another is not this stream's (dropped, counted)
        self.control = ""
        #: the stream's last frame (its end, an error) has come: the agent is done with it
        self.ended = False
        self.owed = 0
        self.sent_at = 0.0  # loop time of the last message to the agent
        self.ignored = 0
        #: the stream subjects of the attempts that opened (their handler ran): those
        #: not answered are told to stop when the call ends
        self.attempts: list[str] = []
        self.epoch = 0

    # -- the inbox's side (``StreamSink``), in nats-py's reading task -----------------

    def started(self, token: str, frame: Msg) -> None:
        if frame.reply:
            self.token = token
            self.control = frame.reply  # keepalives and a cancel go there from now on
            self.sent_at = 0.0  # the next turn of the keepalive loop speaks
            self.attempts.append(frame.reply)

    def opened(self, token: str, first: Msg) -> None:
        frames = self.frames
        if frames:  # frames of an earlier attempt's token, come before it ended
            kept = [m for m in frames if m.subject.rpartition(".")[2] == token]
            frames.clear()
            frames.extend(kept)
        frames.appendleft(first)
        self.token = token
        hdrs = first.headers
        if hdrs and (Header.CHUNK in hdrs or Header.END in hdrs):
            self.control = first.reply  # (a whole answer's names its direct subject)
        else:
            self.control = ""
        self.ended = not hdrs or Header.CHUNK not in hdrs

    def deliver(self, msg: Msg) -> None:
        if self.control and msg.reply != self.control:
            self.ignored += 1  # not from the instance that streams to us
            return
        hdrs = msg.headers
        if not hdrs or Header.CHUNK not in hdrs:
            self.ended = True  # nothing to grant or keep alive any more
        frames = self.frames
        frames.append(msg)
        if len(frames) > self.limit and self.error is None:
            self.error = _Overrun()
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the reader's side ---------------------------------------------------------------

    async def next_frame(self, wait: float) -> Msg:
        """The next frame, waiting at most ``wait`` seconds (TimeoutError); the reason
        nothing more can come, raised, once the frames before it are read."""
        frames = self.frames
        if not frames and self.error is None:
            waiter = asyncio.get_running_loop().create_future()
            self.waiter = waiter
            try:
                async with asyncio.timeout(wait):
                    await waiter
            finally:
                self.waiter = None
        if self.error is not None and (isinstance(self.error, _Overrun) or not frames):
            raise self.error
        return frames.popleft()


class _Overrun(Exception):
    """The agent sent more frames than it was granted."""


class Streams:
    """The open streams of one client, and the one loop that keeps them alive: it sends
    the credit owed (a keepalive when none) for every stream that has sent the agent
    nothing for ``KEEPALIVE`` seconds, and the cancel of a stream dropped unclosed."""

    def __init__(self, inbox: Inbox, requests: Requester) -> None:
        self.inbox = inbox
        self.requests = requests
        self.open: set[Flow] = set()
        self._dropped: deque[Flow] = deque()
        self._wake = asyncio.Event()
        self._owner = Background("client streams")
        self._keeper: asyncio.Task[Any] | None = None

    def reopen(self) -> None:
        self._owner.reopen()

    def track(self, flow: Flow) -> None:
        """A stream opens: kept alive from now on. ``NotStarted`` (as for a request) when
        the client is not connected, or closing; nothing is left behind then."""
        nc = self.inbox.nc
        if nc is None or nc.is_closed or self._owner.closed:
            raise NotStarted("client is not connected; use 'async with Client(...)' first")
        if self._keeper is None or self._keeper.done():
            self._keeper = self._owner.keep(self._keep, "keepalive")
        self.open.add(flow)

    def dropped(self, flow: Flow) -> None:
        """A stream object went away unclosed (called on the loop, soon after its
        ``__del__``, where nothing may wait): the keepalive loop cancels it."""
        if flow in self.open:
            self._dropped.append(flow)
            self._wake.set()

    def forget(self, flow: Flow) -> None:
        """The stream is over: no more frames for its token, no keepalives."""
        self.open.discard(flow)
        if flow.token:
            sink = self.inbox.streams.get(flow.token)
            if sink is flow:
                del self.inbox.streams[flow.token]

    async def send(self, flow: Flow, body: bytes, *, now: bool = True) -> None:
        """To the agent's stream subject: written at once (``now``), or with what else
        goes out on this turn of the loop."""
        nc = self.inbox.nc
        if nc is None or not flow.control or flow.ended:
            return
        flow.sent_at = asyncio.get_running_loop().time()
        try:
            if not publish(nc, flow.control, body, alone=now):
                await publish_by_nats(nc, flow.control, body, "", None, alone=now)
        except TRANSIENT as exc:  # the agent's patience ends the stream, or its frames do
            log.debug("stream %s: message to the agent lost: %s", flow.token, exc)

    async def grant(self, flow: Flow) -> None:
        """Give back the credit owed. Half a window at a time, the agent still has the
        other half: the credit joins what this turn of the loop writes. Only a caller
        that owes the whole window (a window of 1) has an agent waiting for it now."""
        owed, flow.owed = flow.owed, 0
        await self.send(flow, _encode(StreamCredit(credit=owed)), now=owed >= flow.window)

    async def cancel(self, flow: Flow) -> None:
        self.forget(flow)
        await self.send(flow, _CANCEL)

    async def cancel_others(self, flow: Flow, keep: str) -> None:
        """The call ended: every attempt that opened, but ``keep`` (the stream's own; ""
        when the call failed), is told to stop: timed out, or left for another."""
        left = [s for s in flow.attempts if s != keep]
        flow.attempts.clear()
        nc = self.inbox.nc
        if nc is None:
            return
        for subject in left:
            try:
                if not publish(nc, subject, _CANCEL, alone=True):
                    await publish_by_nats(nc, subject, _CANCEL, "", None, alone=True)
            except TRANSIENT as exc:  # its agent's patience stops it
                log.debug("stream %s: cancel lost: %s", subject, exc)

    async def _keep(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        while True:
            while self._dropped:
                await self.cancel(self._dropped.popleft())
            now = loop.time()
            for flow in list(self.open):
                if now - flow.sent_at >= KEEPALIVE and flow in self.open:
                    await self.grant(flow)
            if self._dropped:
                continue
            wake.clear()
            if not self.open:
                await wake.wait()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KEEPALIVE / 2):
                    await wake.wait()

    async def close(self, timeout: float) -> None:
        """The client closes: every open stream ends for its reader now (``StreamBroken``,
        "client closed") and is cancelled at its agent (best effort); the loop ends, or
        is logged by name and left behind after ``timeout`` seconds."""
        closed = ConnectionFailed("client closed", url=self.inbox.url)
        for flow in list(self.open):
            flow.fail(closed)  # before forget: the inbox can tell its reader no more
            await self.cancel(flow)
        self._dropped.clear()
        self._keeper = None
        await self._owner.close(timeout)


class Stream:
    """An answer that comes in chunks: ``async for chunk in client.stream(...)``.

    The request goes out when the first chunk is asked for (or at ``async with``).
    ``agent_id`` and ``request_id`` name who streams, ``latency_ms`` is the time to the
    first frame and ``chunks`` counts the chunks received so far. Leaving early
    (``aclose()``, the end of an ``async with``, an exception or cancellation in
    ``anext()``) cancels the handler at once; a ``break`` out of a bare ``async for``
    does not close the iterator (Python never does), so the handler is cancelled only
    when the stream object is dropped: read with ``async with client.stream(...) as s``
    to leave early. One reader at a time: an ``anext()`` while another waits raises
    ``RuntimeError``."""

    def __init__(
        self,
        streams: Streams,
        capability: str,
        payload: Any,
        *,
        timeout: float | None,
        total_timeout: float | None,
        window: int,
        response_type: Any,
        options: Routed,
        patience: float | None = None,
    ) -> None:
        """``options``: the rest of ``Requester.call``'s arguments (routing, priority...)."""
        self._flow: Flow | None = None  # (first: __del__ reads it, even after a refusal)
        self._loop: asyncio.AbstractEventLoop | None = None  # its own, once it opens
        self._over = False
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
            raise ConfigurationError(f"window must be 1..{MAX_WINDOW} chunks, got {window!r}")
        wait = streams.requests.wait_of(timeout)
        if total_timeout is not None and total_timeout <= 0:
            raise ConfigurationError(f"total_timeout must be positive, got {total_timeout}")
        if patience is not None and not MIN_PATIENCE <= patience <= MAX_PATIENCE:
            raise ConfigurationError(
                f"patience must be {MIN_PATIENCE:g}..{MAX_PATIENCE:g} seconds, got {patience}"
            )
        self._patience = patience
        self.capability = capability
        self.agent_id = options["agent_id"] or ""
        self.request_id = options["request_id"] or ""
        self.latency_ms = 0.0
        self.chunks = 0
        self._streams = streams
        self._payload = payload
        self._idle = wait
        self._window = window
        self._total = total_timeout
        self._options = options
        self._decode = decoder_for(Any if response_type is None else response_type)
        self._response_type = response_type
        self._deadline: float | None = None
        self._unary: bool | None = None  # the first frame was a whole (non-streamed) answer
        #: the request on its way (``_opened``): ``async with`` and a first ``anext()``
        #: from another task share it instead of sending a second one
        self._opening: asyncio.Future[Flow] | None = None
        self._reading = False  # an ``anext()`` is under way: a stream has one reader

    # -- iteration -------------------------------------------------------------------

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        if self._reading:
            raise RuntimeError(
                f"{self.capability!r}: this stream is being read already (anext() called"
                " while another anext() waits): a stream has one reader"
            )
        if self._over:
            raise StopAsyncIteration
        self._reading = True
        try:
            flow = self._flow if self._flow is not None else await self._opened()
            try:
                return await self._next(flow)
            except StopAsyncIteration:
                self._end(flow)
                raise
            except BaseException as exc:
                # Ended by its last frame (an error frame): nothing to tell the agent.
                # Anything else (a broken stream, a chunk that does not decode, our own
                # cancellation): the agent stops.
                await self._leave(flow, told=isinstance(exc, _Told))
                if isinstance(exc, _Told):
                    raise exc.error from exc.error.__cause__
                raise
        finally:
            self._reading = False

    async def _opened(self) -> Flow:
        """The stream open, the request sent once: whoever comes while it is on its way
        (``async with`` and ``anext()`` in two tasks) waits for the same first frame and
        gets the same flow, or the same error."""
        opening = self._opening
        if opening is not None:
            return await asyncio.shield(opening)  # (cancelling a waiter cancels not the call)
        opening = self._opening = asyncio.get_running_loop().create_future()
        try:
            flow = await self._open()
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                opening.cancel()
            else:
                opening.set_exception(exc)
                opening.exception()  # (retrieved: its waiters, if any, raise it)
            raise
        opening.set_result(flow)
        return flow

    async def _open(self) -> Flow:
        requests = self._streams.requests
        loop = self._loop = asyncio.get_running_loop()
        began = loop.time()
        if self._total is not None:
            self._deadline = began + self._total
        flow = Flow(self._window)
        streams = self._streams
        streams.track(flow)  # its keepalives go from an attempt's opened frame on
        try:
            reply = await requests.call(
                self.capability,
                self._payload,
                timeout=self._idle if self._total is None else min(self._idle, self._total),
                response_type=None,
                hedge=False,
                stream=flow,
                window=flow.window,
                total=self._total,
                patience=self._patience,
                **self._options,
            )
        except BaseException:
            # no chunk within the timeout (or a refusal, our own cancellation): a handler
            # that runs all the same is told to stop
            self._over = True
            streams.forget(flow)
            if flow.attempts:
                await asyncio.shield(streams.cancel_others(flow, ""))
            raise
        self.agent_id = reply.agent_id
        self.request_id = reply.request_id
        self.latency_ms = reply.latency_ms
        self._flow = flow
        if len(flow.attempts) > (1 if flow.control in flow.attempts else 0):
            await streams.cancel_others(flow, flow.control)  # failed over after opening
        flow.attempts.clear()
        return flow

    async def _next(self, flow: Flow) -> Any:
        if self._unary:
            raise StopAsyncIteration  # a whole answer, given already
        frames = flow.frames
        if frames and flow.error is None:
            msg = frames.popleft()  # here already: no wait, no timer
        else:
            msg = await self._wait(flow)
        hdrs = msg.headers
        if hdrs:
            number = hdrs.get(Header.CHUNK)
            if number is not None:
                value = self._chunk(flow, msg, number)
                if flow.owed >= flow.threshold:
                    await self._streams.grant(flow)
                return value
            if Header.SERVICE_ERROR_CODE in hdrs:
                self._check_count(hdrs.get(Header.END))
                raise _Told(self._error(msg, hdrs))
            end = hdrs.get(Header.END)
            if end is not None:
                self._check_count(end)
                raise StopAsyncIteration
        if self._unary is None and self.chunks == 0:
            # No stream headers on the first frame: the capability does not stream (or an
            # older agent answered); its answer is the one chunk.
            self._unary = True
            self.chunks = 1
            return self._value(msg)
        raise self._broken("lost", "a frame that is neither a chunk nor the end came")

    async def _wait(self, flow: Flow) -> Msg:
        """The next frame, within the idle timeout and the total one; what ended the
        stream otherwise."""
        loop = asyncio.get_running_loop()
        wait = self._idle
        if self._deadline is not None:
            wait = min(wait, self._deadline - loop.time())
        try:
            return await flow.next_frame(max(wait, 0.0))
        except TimeoutError:
            if self._deadline is not None and loop.time() >= self._deadline:
                raise RequestTimeout(
                    f"{self.capability!r}: the stream did not end within its total timeout"
                    f" of {self._total:g}s ({self._received()})",
                    **self._names(),
                ) from None
            raise self._broken(
                "timeout", f"no chunk within {self._idle:g}s after the last one"
            ) from None
        except _Overrun:
            raise self._broken(
                "overrun", f"the agent sent more than the {flow.window} chunks granted"
            ) from None
        except ReachError as exc:  # the connection went (the inbox said so)
            raise self._broken("connection_lost", exc.message) from exc

    def _chunk(self, flow: Flow, msg: Msg, number: str) -> Any:
        self._unary = False
        expected = self.chunks + 1
        if number != str(expected):
            raise self._broken("lost", f"chunk {expected} never came (chunk {number} did)")
        self.chunks = expected
        flow.owed += 1
        return self._value(msg)

    def _value(self, msg: Msg) -> Any:
        try:
            return self._decode(msg.data)
        except msgspec.DecodeError as exc:
            raise InvalidReply(
                f"{self.capability}: chunk {self.chunks} does not match"
                f" {self._response_type!r}: {exc}",
                **self._names(),
            ) from exc

    def _check_count(self, end: str | None) -> None:
        """The last frame says how many chunks were sent: fewer arrived means lost ones."""
        if end is not None and end != str(self.chunks):
            raise self._broken("lost", f"the agent sent {end} chunks")

    def _error(self, msg: Msg, hdrs: dict[str, str]) -> ReachError:
        """An error frame: the handler's error as it is, unless the agent stopped under a
        started stream (``agent_unavailable``): that breaks it."""
        err = error_from_reply(
            msg.data, hdrs, capability=self.capability, request_id=self.request_id
        )
        if err.code == "agent_unavailable" and self.chunks:
            broken = self._broken("agent_unavailable", err.message)
            broken.__cause__ = err
            return broken
        if err.code == "cancelled":
            # the agent heard nothing from us for its patience (our loop blocked, or cut
            # off from NATS): the stream broke, nobody cancelled it on purpose
            broken = self._broken("silent", err.message)
            broken.__cause__ = err
            return broken
        if self.chunks:
            err.message = f"{err.message} (after {self._received()})"
            err.args = (err.message,)
        return err

    def _received(self) -> str:
        return f"{self.chunks} chunk{'' if self.chunks == 1 else 's'} received"

    def _broken(self, reason: str, why: str) -> StreamBroken:
        return StreamBroken(
            f"{self.capability!r}: the stream from {self.agent_id or 'its agent'} broke after"
            f" {self._received()}: {why}",
            chunks=self.chunks,
            reason=reason,
            **self._names(),
        )

    def _names(self) -> _Names:
        """Who an error is about."""
        return {
            "capability": self.capability,
            "agent_id": self.agent_id,
            "request_id": self.request_id,
        }

    # -- ending ------------------------------------------------------------------------

    def _end(self, flow: Flow) -> None:
        """Ended by the agent (its end frame): nothing to tell it."""
        self._over = True
        self._streams.forget(flow)

    async def _leave(self, flow: Flow, *, told: bool) -> None:
        self._over = True
        if told:
            self._streams.forget(flow)
        else:
            await asyncio.shield(self._streams.cancel(flow))

    async def aclose(self) -> None:
        """Stop reading: the agent is told to stop the handler (unless it has ended)."""
        flow = self._flow
        if flow is not None and not self._over:
            await self._leave(flow, told=False)
        self._over = True

    async def __aenter__(self) -> Self:
        if self._flow is None:
            await self._opened()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        """The garbage collector may run in any thread: the cancel is handed to the
        stream's own loop."""
        flow, loop = self._flow, self._loop
        if flow is not None and loop is not None and not self._over:
            self._over = True
            with contextlib.suppress(RuntimeError):  # (its loop closed: nothing to tell)
                loop.call_soon_threadsafe(self._streams.dropped, flow)


class Routed(TypedDict):
    """What a stream passes on to ``Requester.call`` as it is: who may answer, and how it
    is routed (``Client.stream``'s arguments of the same names)."""

    priority: Priority | str
    agent_id: str | None
    request_id: str | None
    version: str | None
    required_tags: Sequence[str]
    routing: Policy | str | None
    affinity_key: str | None
    max_attempts: int | None
    idempotent: bool


class _Names(TypedDict):
    capability: str
    agent_id: str
    request_id: str


class _Told(Exception):
    """An error frame's error, on its way out of ``_next``."""

    def __init__(self, error: ReachError) -> None:
        self.error = error
        super().__init__(error.message)
