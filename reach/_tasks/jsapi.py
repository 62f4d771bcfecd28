"""JetStream publishes and direct gets over one muxed reply subscription.

nats-py's ``js.publish`` and ``js.get_msg`` go through ``nc.request``: a fresh future and
``asyncio.wait_for`` per call and the ack parsed by ``json``. A task costs several of these
on its path, so they get the technique of the client's request inbox: one wildcard
subscription, a counter per request, one timer handle, and msgspec for the ack. Errors
leave as nats-py's own exceptions (``TRANSIENT`` covers them), so callers need not care.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .._nats import NatsConnection, permissions_of
from .._permissions import Permissions, Recheck, Violation, rearm, unauthorized

__all__ = ["JsApi"]


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)


class JsApi:
    """Requests to JetStream on one connection; ``open`` once, ``close`` when done."""

    def __init__(self, nc: NatsConnection, timeout: float = 5.0) -> None:
        self.nc = nc
        self.timeout = timeout
        self._prefix = ""
        self._seq = 0
        self._pending: dict[str, asyncio.Future[Msg]] = {}
        self._sub: Subscription | None = None
        self._permissions: Permissions | None = None

    async def open(self) -> None:
        if self._sub is None:
            self._prefix = self.nc.new_inbox() + "."
            self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._on_reply)
            self._permissions = permissions_of(self.nc)
            if self._permissions is not None:
                self._permissions.listen(self._on_violation)

    def _on_violation(self, violation: Violation) -> None:
        rearm(self._pending, violation)  # a refused publish: each call checks if it was its

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if self._permissions is not None:
            self._permissions.unlisten(self._on_violation)
            self._permissions = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(nats.errors.ConnectionClosedError())
        self._pending.clear()
        if sub is not None and not self.nc.is_closed:
            await sub.unsubscribe()

    async def _on_reply(self, msg: Msg) -> None:
        fut = self._pending.get(msg.subject[len(self._prefix) :])
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def request(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> Msg:
        if self._sub is None:
            await self.open()
        self._seq += 1
        token = str(self._seq)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = fut
        deadline = loop.time() + self.timeout
        timer = loop.call_later(self.timeout, _expire, fut)
        try:
            await self.nc.publish(subject, data, reply=self._prefix + token, headers=headers)
            msg = await fut
        except Recheck as exc:
            msg = await self._recheck(exc, subject, deadline)
        finally:
            timer.cancel()
            self._pending.pop(token, None)  # close() may have cleared it already
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            raise nats.errors.NoRespondersError
        return msg

    async def _recheck(self, exc: Recheck, subject: str, deadline: float) -> Msg:
        """A publish was refused meanwhile: Unauthorized if it was ours, else wait on for
        the time left (other refusals never extend the call)."""
        loop = asyncio.get_running_loop()
        while True:
            if exc.violation.subject == subject.lower():
                conn = self._permissions.name if self._permissions is not None else ""
                raise unauthorized(exc.violation, conn) from None
            timer = loop.call_later(max(0.0, deadline - loop.time()), _expire, exc.fresh)
            try:
                result: Msg = await exc.fresh
                return result
            except Recheck as again:
                exc = again
            finally:
                timer.cancel()

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
        """A JetStream publish; the stream sequence, or nats-py's APIError on refusal."""
        msg = await self.request(subject, data, headers)
        ack = _ack_decoder.decode(msg.data)
        if ack.error is not None:
            e = ack.error
            raise nats.js.errors.APIError(
                code=e.code, err_code=e.err_code, description=e.description
            )
        return ack.seq

    async def direct_get(self, stream: str, subject: str) -> Msg | None:
        """The last message on ``subject`` (wildcards allowed), or None."""
        msg = await self.request(f"$JS.API.DIRECT.GET.{stream}.{subject}", b"")
        if not msg.data and msg.headers and msg.headers.get("Status") in ("404", "408"):
            return None
        return msg


def _expire(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())
