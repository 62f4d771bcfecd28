"""The JetStream API on the muxed request inbox (``reach._inbox.Inbox.request``): publishes,
reads of a subject's last message, direct gets and purges, for the durable-task and topic
stores and the registry's leases.

nats-py's ``js.publish`` and ``js.get_msg`` go through ``nc.request``: a fresh future and
``asyncio.wait_for`` per call and the ack parsed by ``json``. A task costs several of these
on its path, and a registry one per heartbeat it writes, so they go through reach's request
inbox instead (one wildcard subscription, a counter per request, one timer for every
deadline), and the answer is read with msgspec: 1.4 to 2 times the acked publishes per
second of ``js.publish`` on one connection (into a memory KV bucket, on loopback, 64 and
256 in flight). Errors leave as nats-py's own exceptions (``TRANSIENT`` covers them), so
callers need not care; a publish the server refused raises ``Unauthorized``. The inbox's
subscription is the connection's: nats-py renews it on a reconnect, so one ``JsApi``
serves a connection for its life.
"""

from __future__ import annotations

import contextlib

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from ._delivery import read_headers
from ._inbox import Inbox
from ._nats import NatsConnection, check_refused, refusals

__all__ = ["JsApi", "direct_batch", "js_publish"]


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


class _Purged(msgspec.Struct):
    purged: int = 0
    error: _ApiError | None = None


class _Stored(msgspec.Struct):
    subject: str = ""
    seq: int = 0
    hdrs: bytes | None = None  # base64 in the JSON: msgspec decodes it
    data: bytes | None = None


class _Got(msgspec.Struct):
    message: _Stored | None = None
    error: _ApiError | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)
_purged_decoder = msgspec.json.Decoder(_Purged)
_got_decoder = msgspec.json.Decoder(_Got)


def _refused(e: _ApiError) -> nats.js.errors.APIError:
    """The refusal as nats-py types it (400 ``BadRequestError``, 404 ``NotFoundError``...)."""
    try:
        nats.js.errors.APIError.from_error(
            {"code": e.code, "err_code": e.err_code, "description": e.description}
        )
    except nats.js.errors.APIError as typed:
        return typed
    return nats.js.errors.APIError(code=e.code, err_code=e.err_code, description=e.description)


class JsApi:
    """Requests to JetStream on one connection, each given ``timeout`` seconds; ``open``
    once, ``close`` when done."""

    def __init__(self, nc: NatsConnection, timeout: float = 5.0) -> None:
        self.nc = nc
        self.timeout = timeout
        self._inbox = Inbox()

    async def open(self) -> None:
        if self._inbox.nc is None:
            await self._inbox.open(self.nc)

    async def close(self) -> None:
        """Requests still waiting fail with nats-py's ``ConnectionClosedError``."""
        await self._inbox.close(unsubscribe=not self.nc.is_closed)

    async def request(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> Msg:
        return await self._inbox.request(subject, data, self.timeout, headers)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
        """A JetStream publish; the stream sequence, or nats-py's APIError on refusal."""
        msg = await self.request(subject, data, headers)
        ack = _ack_decoder.decode(msg.data)
        if ack.error is not None:
            raise _refused(ack.error)
        return ack.seq

    async def purge(self, stream: str, subject: str, upto: int = 0) -> int:
        """Purge the messages of ``stream`` on ``subject`` (below sequence ``upto`` if
        given); how many the server removed (nats-py's ``purge_stream`` does not say)."""
        request: dict[str, object] = {"filter": subject}
        if upto:
            request["seq"] = upto
        msg = await self.request(f"$JS.API.STREAM.PURGE.{stream}", msgspec.json.encode(request))
        answer = _purged_decoder.decode(msg.data)
        if answer.error is not None:
            raise _refused(answer.error)
        return answer.purged

    async def last_msg(self, stream: str, subject: str) -> RawStreamMsg | None:
        """The newest message on ``subject`` in ``stream`` as the stream's leader holds it,
        or None (nats-py's ``get_msg(stream, subject=...)``). Not a direct get: a replica
        may answer one from behind the leader, and the stream must allow it."""
        request = msgspec.json.encode({"last_by_subj": subject})
        msg = await self.request(f"$JS.API.STREAM.MSG.GET.{stream}", request)
        got = _got_decoder.decode(msg.data)
        if got.error is not None:
            if got.error.code == 404:  # no such message (or stream): get_msg's NotFoundError
                return None
            raise _refused(got.error)
        stored = got.message
        if stored is None:
            return None
        headers = read_headers(stored.hdrs) if stored.hdrs else None
        return RawStreamMsg(
            subject=stored.subject, seq=stored.seq, data=stored.data or b"", headers=headers
        )

    async def direct_get(self, stream: str, subject: str) -> Msg | None:
        """The last message on ``subject`` (wildcards allowed), or None."""
        msg = await self.request(f"$JS.API.DIRECT.GET.{stream}.{subject}", b"")
        if not msg.data and msg.headers and msg.headers.get("Status") in ("404", "408"):
            return None
        return msg


async def direct_batch(
    nc: NatsConnection,
    stream: str,
    subject: str,
    *,
    seq: int = 0,
    batch: int = 1,
    timeout: float = 5.0,
) -> tuple[list[Msg], int]:
    """Up to ``batch`` messages of ``stream`` on ``subject`` (wildcards allowed) from
    sequence ``seq`` on, oldest first, in one batched direct get; and how many more match
    after them (the server's ``Nats-Num-Pending``, counted from its subject index). So a
    count crosses the wire as one message, however many match, and needs no consumer (a
    work-queue stream takes none that does not ack). nats-py's ``get_msg`` asks for one
    message and drops the count; the replies come on an inbox of their own, ended by
    the server's ``204 EOB`` (``404``: none matches)."""
    request: dict[str, object] = {"next_by_subj": subject, "batch": batch}
    if seq:
        request["seq"] = seq
    mark = refusals(nc)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    got: list[Msg] = []
    try:
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", msgspec.json.encode(request), inbox)
        while True:
            try:
                msg = await sub.next_msg(timeout)
            except Exception as exc:  # a timeout may be a refused publish: say so
                check_refused(nc, f"a batched direct get of {stream}", exc, since=mark)
                raise
            headers = msg.headers or {}
            status = headers.get("Status", "")
            if not status:
                got.append(msg)
            elif status == "204":  # the end of the batch
                return got, int(headers.get("Nats-Num-Pending", 0))
            elif status == "404":
                return got, 0
            else:
                nats.js.errors.APIError.from_msg(msg)  # raises it, typed
    finally:
        with contextlib.suppress(nats.errors.Error):  # closed: the subscription is gone
            await sub.unsubscribe()


async def js_publish(
    js: JetStreamContext,
    api: JsApi | None,
    subject: str,
    data: bytes,
    headers: dict[str, str] | None,
) -> int:
    """A JetStream publish through ``api`` (the request inbox) when there is one, else
    through nats-py's ``js.publish``; the stream sequence. The one publish of the task and
    topic stores."""
    if api is not None:
        return await api.publish(subject, data, headers)
    ack = await js.publish(subject, data, headers=headers)
    return int(ack.seq)
