"""Pulling from one durable consumer by hand, so the agent asks for exactly what it can run.

nats-py's ``fetch`` cannot be asked "whatever is there, now, at most n" without also
lingering, and a cancelled fetch leaves its pull request on the server. Here each puller
keeps at most one pull request open: a ``probe`` (``no_wait``: what is there now, up to n)
or a ``linger`` (one message, waiting up to ``expires``). Messages land in a buffer that
the runner takes from in priority order.

A consumer can go while the agent runs (an operator deletes it; a durable topic's
inactive threshold removes it after a long pause): the server then ends the open request
with ``409 Consumer Deleted`` and answers every later one at once with ``503`` (no
responders), as it does while JetStream is away. Asking again at once would spin (17,291
requests in 2 s, measured) and stay deaf, so the puller then says so once, opens no
request for a while (jittered backoff, doubling up to ``_BACKOFF_MAX``), and makes the
consumer again (the runner's ``remake``) before its next request. Any other status that
ends a request early is backed off the same way, without the remake.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .._jsapi import JsApi
from .._nats import TRANSIENT, NatsConnection

__all__ = ["Puller", "close_pulling", "keep_alive", "settle"]

log = logging.getLogger("reach.tasks")

_PROBE_TIMEOUT = 2.0  # a probe the server never answered (a reconnect) is given up
#: seconds without a request after a request ended in trouble: the first pause (jittered in
#: [d/2, d]), doubled after each further trouble up to the last
_BACKOFF_FIRST, _BACKOFF_MAX = 0.1, 10.0
_encode = msgspec.json.Encoder().encode


class Puller:
    """One consumer's pull requests and the messages they brought."""

    def __init__(
        self,
        nc: NatsConnection,
        stream: str,
        consumer: str,
        inbox: str,
        wake: Callable[[], None],
        remake: Callable[[], Awaitable[object]],
    ) -> None:
        self.nc = nc
        self.consumer = consumer
        self.api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.inbox = inbox
        self.buffer: deque[Msg] = deque()
        self.outstanding = 0  # messages the open request may still bring; 0: none open
        self.statuses = 0  # status replies seen (404/408/409): requests that ended short
        #: the consumer is gone: made again (``remake``) before the next request
        self.gone = False
        self._wake = wake
        self._remake = remake
        self._pause = 0.0  # the backoff after the last trouble; 0: none since it answered
        self._until = 0.0  # loop time before which no request is opened
        self._timer: asyncio.TimerHandle | None = None  # wakes the runner at ``_until``
        self._ended: asyncio.Future[None] | None = None
        self._sub: Subscription | None = None
        self._opened_at = 0.0
        self._overdue = _PROBE_TIMEOUT
        #: loop time its last probe found nothing; 0: a message came since
        self._empty_at = 0.0

    async def open(self) -> None:
        self._sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)

    async def close(self) -> None:
        """Stop listening: the server then skips (and drops) our open pull request, so a
        task put back at a drain is not delivered to us again."""
        sub, self._sub = self._sub, None
        self._end()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except TRANSIENT as exc:
                log.debug("pull %s: unsubscribe: %s", self.consumer, exc)

    def lost(self) -> None:
        """The connection was lost (and is back): so is the open request, whose end
        would never come; the next ``probe`` or ``linger`` opens another at once."""
        self._end()

    @property
    def idle(self) -> bool:
        """No request is open (or the open one is long overdue: the server lost it), and
        none is being backed off from."""
        loop = asyncio.get_running_loop()
        if self._until:
            if loop.time() < self._until:
                return False
            self._until = 0.0
        if self.outstanding and self._opened_at and loop.time() - self._opened_at > self._overdue:
            self._end()
        return self.outstanding == 0

    async def _on_msg(self, msg: Msg) -> None:
        if msg.reply and msg.reply.startswith("$JS.ACK."):
            self.buffer.append(msg)
            self._empty_at = 0.0
            self._pause = 0.0
            self.outstanding = max(0, self.outstanding - 1)
            if self.outstanding == 0:
                self._end()
            self._wake()
            return
        headers = msg.headers or {}
        status = headers.get("Status", "")
        if status == "100":
            return  # an idle heartbeat
        self.statuses += 1
        if status in ("404", "408"):
            self._pause = 0.0  # nothing there, or nothing came: the consumer answers
        else:
            self._trouble(status, headers.get("Description", ""))
        self._end()
        self._wake()

    def _trouble(self, status: str, description: str) -> None:
        """A request ended early for another reason than "no messages": back off; if the
        consumer is gone (deleted, or JetStream not answering), it is made again first."""
        if status == "503" or (status == "409" and "consumer deleted" in description.lower()):
            self.missing(f"{status} {description.strip() or 'no responders'}")
        else:
            log.debug("pull %s: status %s %s", self.consumer, status, description)
        self._back_off()

    def missing(self, why: str) -> None:
        """The consumer is gone (``why``: how that was seen): it is made again before the
        next request. Said once, until it is back."""
        if not self.gone:
            self.gone = True
            log.warning(
                "pull %s: the consumer is gone (%s); making it again, backing off while that fails",
                self.consumer,
                why,
            )

    def _back_off(self) -> None:
        """Open no request for a while; wake the runner when it may open one again."""
        self._pause = min(2 * self._pause, _BACKOFF_MAX) if self._pause else _BACKOFF_FIRST
        delay = random.uniform(self._pause / 2, self._pause)
        loop = asyncio.get_running_loop()
        self._until = loop.time() + delay
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(delay, self._wake)

    async def _ready(self) -> bool:
        """The consumer is there, made again if it was gone; False when that failed (the
        next try waits longer)."""
        if not self.gone:
            return True
        try:
            await self._remake()
        except TRANSIENT as exc:
            log.debug("pull %s: making the consumer again: %s", self.consumer, exc)
            self._back_off()
            return False
        self.gone = False
        log.info("pull %s: the consumer is made again; pulling again", self.consumer)
        return True

    def _end(self) -> None:
        self.outstanding = 0
        self._opened_at = 0.0
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def _open(self, n: int, overdue: float) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        self.outstanding = n
        self._opened_at = loop.time()
        self._overdue = overdue
        self._ended = loop.create_future()
        return self._ended

    async def probe(self, n: int) -> list[Msg]:
        """Whatever the consumer has now, at most ``n`` messages (plus any already held)."""
        got = self.take(n)
        if len(got) >= n or not self.idle or not await self._ready():
            return got
        ended = self._open(n - len(got), _PROBE_TIMEOUT)
        await self.nc.publish(
            self.api, _encode({"batch": n - len(got), "no_wait": True}), reply=self.inbox
        )
        try:
            await asyncio.wait_for(asyncio.shield(ended), _PROBE_TIMEOUT)
        except TimeoutError:
            self._end()
        found = self.take(n - len(got))
        self._empty_at = 0.0 if found else asyncio.get_running_loop().time()
        return got + found

    def found_empty(self, within: float) -> bool:
        """Whether a probe found nothing less than ``within`` seconds ago (and none found
        anything since)."""
        if not self._empty_at:
            return False
        return asyncio.get_running_loop().time() - self._empty_at < within

    async def linger(self, expires: float, batch: int = 1) -> None:
        """Open a request for up to ``batch`` messages, delivered as they come, for up to
        ``expires`` seconds; returns at once (each message, and the end of the request,
        wakes the runner)."""
        if not self.idle or not await self._ready():
            return
        self._open(batch, expires + _PROBE_TIMEOUT)
        body = {"batch": batch, "expires": int(expires * 1e9)}
        await self.nc.publish(self.api, _encode(body), reply=self.inbox)

    def take(self, n: int) -> list[Msg]:
        got: list[Msg] = []
        while self.buffer and len(got) < n:
            got.append(self.buffer.popleft())
        return got


async def settle(op: Awaitable[None], what: str) -> bool:
    """An ack, nak, term or in_progress of a pulled message; False when it could not be
    sent (the message comes back after its ack timer, or was settled already)."""
    try:
        await op
    except TRANSIENT as exc:
        log.debug("%s: %s", what, exc)
        return False
    return True


async def keep_alive(msgs: Iterable[Msg]) -> None:
    """Reset the ack timer of every message held (all at once: one slow call must not let
    another lapse)."""
    await asyncio.gather(*(settle(m.in_progress(), "in_progress") for m in msgs))


async def close_pulling(pullers: Iterable[Puller], api: JsApi | None, what: str) -> None:
    """After the runner's background coroutines are cancelled: stop listening on every
    puller, then close the runner's request inbox (a connection gone already is no
    fault)."""
    for puller in pullers:
        await puller.close()
    if api is not None:
        try:
            await api.close()
        except TRANSIENT as exc:
            log.debug("%s: %s", what, exc)
