"""The muxed request inbox of one connection: one wildcard subscription for every reply,
a counter for the tokens, and one timer for every deadline.

Two kinds of request wait here. ``send`` is one attempt of a client's request (the hot
path; keep it free of per-request extras): its answer is checked for who sent it, decoded,
and its failures become ``ReachError``s. ``request`` is ``nc.request`` on this inbox, for
the JetStream API calls of durable tasks: the raw reply, or nats-py's own errors. Both
share the timer and the one check of a refused publish (``_recheck``).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import nats.errors
from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.nuid import NUID

from ._codec import decoder_for, error_from_reply
from ._delivery import publish, publish_by_nats, subscribe_direct
from ._nats import (
    CONNECTION_LOST,
    HEADROOM,
    TOO_LARGE,
    TRANSIENT,
    fits,
    permissions_of,
    too_large,
)
from ._permissions import Permissions, Recheck, Violation, rearm, unauthorized
from ._routing import LOST
from .errors import (
    AgentUnavailable,
    CapabilityNotFound,
    ConnectionFailed,
    InvalidReply,
    NotStarted,
    ReachError,
    RemoteError,
    RequestTimeout,
    Unauthorized,
)
from .wire import Header

__all__ = ["Asked", "Inbox", "Reply", "StreamSink"]

log = logging.getLogger("reach.client")


@dataclass(frozen=True, slots=True)
class Reply:
    """A successful answer: the decoded value plus who answered and how fast."""

    value: Any
    data: bytes
    agent_id: str
    request_id: str
    latency_ms: float
    duration_ms: float | None = None


class StreamSink(Protocol):
    """Where the frames of a streaming reply go (``reach._client.stream``): a stream's
    token stays in the inbox after its first frame, and every later message on it is
    handed over, in order, in nats-py's reading task."""

    #: the connection's reconnect count when its first chunk came (set by the inbox): a
    #: reconnect reported later (nats-py calls back late) breaks only what opened before
    epoch: int

    def started(self, token: str, frame: Msg) -> None:
        """The opened frame (``Reach-Chunk: 0``) of the attempt ``token``: its agent runs
        the handler, and hears the caller on the frame's reply-to. The attempt still
        waits for its first chunk (or an error, which fails over as a request's)."""

    def opened(self, token: str, first: Msg) -> None:
        """The first frame, an answer (not an error): the stream is this token's."""

    def deliver(self, msg: Msg) -> None:
        """A frame after the first (it must not block nor raise)."""

    def fail(self, error: BaseException) -> None:
        """Nothing more can come: the connection was closed or lost and restored."""


class Asked(Protocol):
    """What ``send`` reads of a request (the client's ``Call``)."""

    capability: str
    data: bytes
    request_id: str | None
    response_type: Any


#: One timer for the inbox times out pending requests, set for the soonest deadline (a
#: timer per request cost ~5% of a request's CPU), and never less than this ahead when
#: set: a timeout is reported up to this late, and the timer wakes at most 200 times a
#: second however many requests time out.
_SWEEP = 0.005
_NEVER = float("inf")


class Inbox:
    """Replies for one connection. The reply subject, less ``_INBOX.``, is the request id,
    so a request needs no Reach-Request-Id header (each header costs a parse on both sides);
    the inbox is unique per connection, so a counter makes it unique per request.
    Deadlines wait in a heap for one timer, set for the soonest. ``url`` is named in
    ``ConnectionFailed``; ``agent_prefix`` starts the agents' direct subjects (``send``
    reads who answered from them)."""

    def __init__(self, url: str = "", agent_prefix: str = "") -> None:
        self.url = url
        self.nc: NatsConnection | None = None
        self.pending: dict[str, asyncio.Future[Msg]] = {}
        #: (the loop time an attempt gives up, its token), soonest first; an attempt that
        #: ended stays until it comes due or the heap is compacted
        self._deadlines: list[tuple[float, str]] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._agent_subjects = agent_prefix
        self._prefix = ""
        self._seq = 0
        self._sub: Subscription | None = None
        self._nuid = NUID()
        self._permissions: Permissions | None = None
        #: token -> the instance a direct attempt went to: only its answer is taken
        self.expect: dict[str, str] = {}
        #: replies dropped because they named another instance than the one asked
        self.ignored = 0
        #: tokens of attempts whose work may run twice: ended at once by a reconnect
        self.lossy: set[str] = set()
        #: tokens of open streams: their frames after the first go to their sink
        self.streams: dict[str, StreamSink] = {}

    async def open(self, nc: NatsConnection) -> None:
        """Subscribe on ``nc`` (its owner flushes: the server has our interest before any
        reply, as a publish on the same connection comes after the subscription)."""
        # Requests still waiting on a previous connection (closed under the client) can
        # never be answered on this new inbox; and a timer set on another loop never fires.
        self._fail_pending("the connection closed while waiting for the answer")
        self.nc = nc
        self._prefix = f"_INBOX.{self._nuid.next().decode()}."
        self._permissions = permissions = permissions_of(nc)
        if permissions is not None:
            permissions.listen(self._on_violation)
        self._sub = await subscribe_direct(nc, self._prefix + "*", self._on_reply)

    @property
    def deadlines(self) -> int:
        """Deadlines kept, of pending attempts and of ended ones not yet dropped."""
        return len(self._deadlines)

    def _on_violation(self, violation: Violation) -> None:
        """The server refused a publish: every pending call checks whether it was its own
        (the error path only; a request carries nothing extra for it)."""
        rearm(self.pending, violation)

    def gone(self, agent_id: str) -> None:
        """The registry declared ``agent_id`` DOWN because nobody listens on its subjects
        (its connection is gone, so its work is not running): attempts waiting on it end
        now, as ``agent_unavailable``, and fail over within the deadline instead of
        waiting it out. Rare: a scan is fine."""
        if not self.expect:
            return
        infix = f"{self._agent_subjects}{agent_id}."
        for token, subject in list(self.expect.items()):
            fut = self.pending.get(token)
            if subject.startswith(infix) and fut is not None and not fut.done():
                fut.set_exception(
                    AgentUnavailable(
                        f"agent {agent_id!r} went DOWN while this request waited (its"
                        " connection is gone: nobody answered the registry's probe)",
                        agent_id=agent_id,
                    )
                )

    def reconnected(self) -> None:
        """The connection was lost and is back: an answer sent meanwhile is lost for good.
        Attempts whose work may run twice (``lossy``) end now, as ``connection_lost``, and
        fail over at once; the others wait on, as their answer may still come."""
        for token in list(self.lossy):
            fut = self.pending.get(token)
            if fut is not None and not fut.done():
                lost = RequestTimeout(
                    "the connection to NATS was lost and restored while this request waited;"
                    " its answer may be lost"
                )
                lost.outcome = LOST
                fut.set_exception(lost)
        # Only streams past their first chunk: one still waiting for it is an attempt,
        # which the lines above and the attempt logic look after (it lost nothing yet).
        broken = ConnectionFailed("the connection to NATS was lost and restored")
        pending = self.pending
        now = self.nc.stats["reconnects"] if self.nc is not None else 0
        for token, sink in list(self.streams.items()):
            if token not in pending and sink.epoch < now:
                del self.streams[token]
                sink.fail(broken)

    def _on_reply(self, msg: Msg) -> None:
        """In nats-py's reading task (``subscribe_direct``): settle the future, no more."""
        token = msg.subject[len(self._prefix) :]
        fut = self.pending.get(token)
        if fut is None or fut.done():
            sink = self.streams.get(token)  # a stream's frames after its first
            if sink is not None:
                sink.deliver(msg)
            return
        asked = self.expect.get(token)
        if asked is not None and msg.reply != asked and self._impostor(msg, asked):
            # another instance answering for the one chosen (a forged or misrouted reply):
            # keep waiting for the real answer
            self.ignored += 1
            log.debug("reply on %s ignored: it names another instance than %s", token, asked)
            return
        if self.streams:
            sink = self.streams.get(token)
            hdrs = msg.headers
            if sink is not None and hdrs and hdrs.get(Header.CHUNK) == "0":
                sink.started(token, msg)  # the opened frame: the attempt waits on
                return
        fut.set_result(msg)

    def _impostor(self, msg: Msg, asked: str) -> bool:
        """Whether a reply to a request sent to the direct subject ``asked`` names another
        instance, by its reply-to subject or its Reach-Agent header (a reply naming none,
        as the server's no-responders status, is taken)."""
        prefix = self._agent_subjects
        agent_id = asked[len(prefix) :].partition(".")[0]
        via = msg.reply
        if via and via.startswith(prefix) and via[len(prefix) :].partition(".")[0] != agent_id:
            return True
        named = msg.headers.get(Header.AGENT) if msg.headers else None
        return bool(named) and named != agent_id

    def _sender(self, msg: Msg) -> str:
        """The instance a reply names (the Reach-Agent header, else its direct subject as
        reply-to); "" when it names none."""
        hdrs = msg.headers
        if hdrs:
            named = hdrs.get(Header.AGENT)
            if named:
                return named
        via = msg.reply
        if via and via.startswith(self._agent_subjects):
            return via[len(self._agent_subjects) :].partition(".")[0]
        return ""

    def _enter(self, wait: float) -> tuple[str, asyncio.Future[Msg]]:
        """A new token and its pending future, due in ``wait`` seconds: its deadline joins
        the heap, and the timer comes forward when it is the soonest."""
        self._seq += 1
        token = str(self._seq)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        pending = self.pending
        pending[token] = fut
        now = loop.time()
        due = now + wait
        deadlines = self._deadlines
        heapq.heappush(deadlines, (due, token))
        if len(deadlines) > 2 * len(pending) + 64:  # mostly ended attempts: drop them
            self._deadlines = deadlines = [d for d in deadlines if d[1] in pending]
            heapq.heapify(deadlines)
        sweeper = self._sweeper
        set_for = _NEVER if sweeper is None else sweeper.when()
        if due < set_for:  # sooner than any other: the timer comes forward
            at = max(due, now + _SWEEP)
            if at < set_for:
                self._arm(loop, at)
        return token, fut

    def _sweep(self) -> None:
        """Time out what is due, and set the timer for the soonest deadline left."""
        self._sweeper = None
        pending, deadlines = self.pending, self._deadlines
        if not pending:
            deadlines.clear()  # all ended: nothing to wake up for
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        while deadlines and deadlines[0][0] <= now:
            fut = pending.get(heapq.heappop(deadlines)[1])
            if fut is not None and not fut.done():
                fut.set_exception(TimeoutError())
        if deadlines:
            self._arm(loop, max(deadlines[0][0], now + _SWEEP))

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._sweeper = loop.call_at(at, self._sweep)

    def _fail_pending(self, why: str) -> None:
        """End every pending request with ConnectionFailed; no timer, no deadlines left."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._deadlines.clear()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ConnectionFailed(why, url=self.url))
        self._fail_streams(ConnectionFailed(why, url=self.url))

    def _fail_streams(self, error: ReachError) -> None:
        """Frames sent meanwhile may be lost: every open stream ends now."""
        sinks = list(self.streams.values())
        self.streams.clear()
        for sink in sinks:
            sink.fail(error)

    async def close(self, *, unsubscribe: bool) -> None:
        """Fail every pending request; drop the subscription on a connection we keep."""
        self._fail_pending("client closed")
        sub, self._sub, self.nc = self._sub, None, None
        if self._permissions is not None:
            self._permissions.unlisten(self._on_violation)
            self._permissions = None
        if unsubscribe and sub is not None:
            try:
                await sub.unsubscribe()
            except TRANSIENT as exc:
                log.debug("inbox unsubscribe: %s", exc)

    async def send(
        self,
        call: Asked,
        subject: str,
        headers: dict[str, str],
        wait: float,
        agent_id: str | None,
        *,
        measure: bool = False,
        lossy: bool = False,
        stream: StreamSink | None = None,
    ) -> Reply:
        """``measure``: the headers may be large (a trace's baggage), so the size check
        counts them whatever the payload's size; the client's own headers are bounded.
        ``stream``: a streaming call; its frames after the first go to the sink, and the
        first, when it is not an error, is handed to it rather than decoded."""
        nc = self.nc
        if nc is None or nc.is_closed:
            raise NotStarted("client is not connected; use 'async with Client(...)' first")
        capability, request_id, response_type = call.capability, call.request_id, call.response_type
        if (measure or len(call.data) > nc.max_payload - HEADROOM) and not fits(
            nc, call.data, headers
        ):
            raise too_large(nc, len(call.data), f"{capability!r} (with its headers)")
        token, fut = self._enter(wait)
        reply_to = self._prefix + token
        rid = request_id or reply_to[7:]
        if agent_id is not None:
            self.expect[token] = subject
        if lossy:
            self.lossy.add(token)
        if stream is not None:
            self.streams[token] = stream
        started = time.perf_counter()
        reconnects = nc.stats["reconnects"]
        try:
            # alone: nothing to send with it, so out now, not on nats-py's next turn
            alone = len(self.pending) == 1
            if not publish(nc, subject, call.data, reply_to, headers, alone=alone):
                await publish_by_nats(nc, subject, call.data, reply_to, headers, alone=alone)
            msg = await fut
        except RemoteError as exc:  # set by gone() or reconnected(): this call's now
            exc.capability, exc.request_id = capability, rid
            raise
        except TimeoutError:
            if not nc.is_connected:
                # the server is out of reach: the instance is not at fault (no breaker)
                raise ConnectionFailed(
                    f"{capability!r} got no answer within {wait:.3g}s: the connection to NATS"
                    " is down (reconnecting)",
                    url=self.url,
                ) from None
            if nc.stats["reconnects"] != reconnects:
                lost = _no_answer(
                    capability,
                    wait,
                    agent_id,
                    rid,
                    ": the connection to NATS was lost and restored meanwhile",
                )
                lost.outcome = LOST  # fail over at once; the instance learns nothing
                raise lost from None
            raise _no_answer(capability, wait, agent_id, rid) from None
        except CONNECTION_LOST as exc:
            raise ConnectionFailed(f"not connected to NATS: {exc}", url=self.url) from exc
        except TOO_LARGE:
            raise too_large(nc, len(call.data), repr(capability)) from None
        except Recheck as exc:
            try:
                msg = await self._recheck(exc, subject, capability)
            except Unauthorized as err:
                err.agent_id, err.request_id = agent_id or "", rid
                raise
            except TimeoutError:
                raise _no_answer(capability, wait, agent_id, rid) from None
        finally:
            del self.pending[token]
            if agent_id is not None:
                del self.expect[token]
            if lossy:
                self.lossy.discard(token)
            if stream is not None:
                # back below if the first frame is an answer (no await between: no frame
                # can come meanwhile); any other way, the stream is over for this token
                self.streams.pop(token, None)
        latency_ms = round((time.perf_counter() - started) * 1000, 3)  # not 340.42958999
        hdrs = msg.headers
        if hdrs and not msg.data and hdrs.get("Status") == "503":
            raise _no_responders(capability, agent_id, rid)
        if hdrs and Header.SERVICE_ERROR_CODE in hdrs:
            raise error_from_reply(msg.data, hdrs, capability=capability, request_id=rid)
        if stream is not None:
            value = None
            self.streams[token] = stream
            stream.epoch = nc.stats["reconnects"]
            stream.opened(token, msg)
        else:
            try:
                value = decoder_for(Any if response_type is None else response_type)(msg.data)
            except msgspec.DecodeError as exc:
                raise InvalidReply(
                    f"{capability}: reply does not match {response_type!r}: {exc}",
                    capability=capability,
                    request_id=rid,
                ) from exc
        served_by = agent_id if agent_id is not None and msg.reply == subject else ""
        served_by, duration = served_by or self._sender(msg), None
        if hdrs:
            raw = hdrs.get(Header.DURATION_MS)
            if raw:
                try:
                    duration = float(raw)
                except ValueError:
                    duration = None
        return Reply(value, msg.data, served_by, rid, latency_ms, duration)

    async def request(
        self,
        subject: str,
        payload: bytes,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        """``nc.request`` on this inbox: the reply, or what ``nc.request`` raises (nats-py's
        ``TimeoutError``, ``NoRespondersError``, ``ConnectionClosedError`` once the inbox
        is closed, and whatever its publish raises); ``Unauthorized`` when the server
        refused this very publish. For the JetStream API (``_jsapi``), whose callers
        catch nats-py's errors and tell a refused call from a slow server."""
        nc = self.nc
        if nc is None:
            raise nats.errors.ConnectionClosedError
        token, fut = self._enter(timeout)
        reply_to = self._prefix + token
        try:
            alone = len(self.pending) == 1
            if not publish(nc, subject, payload, reply_to, headers, alone=alone):
                await publish_by_nats(nc, subject, payload, reply_to, headers, alone=alone)
            try:
                msg = await fut
            except Recheck as exc:
                msg = await self._recheck(exc, subject)
        except TimeoutError:  # the sweep's
            raise nats.errors.TimeoutError from None
        except ConnectionFailed:  # the inbox closed (or opened again) under the request
            raise nats.errors.ConnectionClosedError from None
        finally:
            del self.pending[token]
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            raise nats.errors.NoRespondersError
        return msg

    async def _recheck(self, exc: Recheck, subject: str, capability: str = "") -> Msg:
        """A publish was refused while this call waited: Unauthorized if it was this
        call's, else wait on for the reply in the time left (the deadline stays in the heap:
        other refusals never extend a call; when it comes, TimeoutError)."""
        own = subject.lower()
        while True:
            if exc.violation.subject == own:
                conn = self._permissions.name if self._permissions is not None else ""
                raise unauthorized(exc.violation, conn, capability=capability) from None
            fut = exc.fresh  # pending in its place: the sweep times it out when due
            try:
                result: Msg = await fut
                return result
            except Recheck as again:
                exc = again


def _no_answer(
    capability: str, wait: float, agent_id: str | None, rid: str, why: str = ""
) -> RequestTimeout:
    return RequestTimeout(
        f"{capability!r} got no answer within {wait:.3g}s{why}",
        capability=capability,
        agent_id=agent_id or "",
        request_id=rid,
    )


def _no_responders(capability: str, agent_id: str | None, rid: str) -> RemoteError:
    err: RemoteError
    if agent_id is not None:
        err = AgentUnavailable(
            f"agent {agent_id!r} is not serving {capability!r}",
            capability=capability,
            agent_id=agent_id,
            request_id=rid,
        )
    else:
        err = CapabilityNotFound(
            f"no live agent offers {capability!r}", capability=capability, request_id=rid
        )
    err.outcome = "no_responders"
    return err
