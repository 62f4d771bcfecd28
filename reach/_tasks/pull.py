"""Pulling from one durable consumer by hand, so the agent asks for exactly what it can run.

nats-py's ``fetch`` cannot be asked "whatever is there, now, at most n" without also
lingering, and a cancelled fetch leaves its pull request on the server. Here each puller
keeps at most one pull request open: a ``probe`` (``no_wait``: what is there now, up to n)
or a ``linger`` (one message, waiting up to ``expires``). Messages land in a buffer that
the runner takes from in priority order.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .._nats import TRANSIENT, NatsConnection

__all__ = ["Puller"]

log = logging.getLogger("reach.tasks")

_PROBE_TIMEOUT = 2.0  # a probe the server never answered (a reconnect) is given up
_encode = msgspec.json.Encoder().encode


class Puller:
    """One consumer's pull requests and the messages they brought."""

    def __init__(
        self, nc: NatsConnection, stream: str, consumer: str, inbox: str, wake: Callable[[], None]
    ) -> None:
        self.nc = nc
        self.consumer = consumer
        self.api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.inbox = inbox
        self.buffer: deque[Msg] = deque()
        self.outstanding = 0  # messages the open request may still bring; 0: none open
        self.statuses = 0  # status replies seen (404/408/409): requests that ended short
        self._wake = wake
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
        """No request is open (or the open one is long overdue: the server lost it)."""
        if self.outstanding and self._opened_at:
            loop = asyncio.get_running_loop()
            if loop.time() - self._opened_at > self._overdue:
                self._end()
        return self.outstanding == 0

    async def _on_msg(self, msg: Msg) -> None:
        if msg.reply and msg.reply.startswith("$JS.ACK."):
            self.buffer.append(msg)
            self._empty_at = 0.0
            self.outstanding = max(0, self.outstanding - 1)
            if self.outstanding == 0:
                self._end()
            self._wake()
            return
        status = (msg.headers or {}).get("Status", "")
        if status == "100":
            return  # an idle heartbeat
        self.statuses += 1
        if status not in ("404", "408"):
            log.debug("pull %s: status %s %s", self.consumer, status, msg.headers)
        self._end()
        self._wake()

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
        if len(got) >= n or not self.idle:
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
        if not self.idle:
            return
        self._open(batch, expires + _PROBE_TIMEOUT)
        body = {"batch": batch, "expires": int(expires * 1e9)}
        await self.nc.publish(self.api, _encode(body), reply=self.inbox)

    def take(self, n: int) -> list[Msg]:
        got: list[Msg] = []
        while self.buffer and len(got) < n:
            got.append(self.buffer.popleft())
        return got
