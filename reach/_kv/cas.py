"""The one compare-and-set KV writer: writes that carry a per-message TTL, its one conflict
error (``Conflict``), the server's error codes by name, and the newest-message read.

See NATS-FACTS.md: ``kv.put``/``kv.update`` cannot set a TTL and would make a key permanent,
so every write here is a raw publish to ``$KV.<bucket>.<key>`` with ``Nats-TTL`` and
``Nats-Expected-Last-Subject-Sequence``; expiries reach watchers as markers (nats-py
reports them as PURGE). The registry's leases and the durable tasks' records, claims and
idempotency keys all write through ``write`` and ``delete``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from .._nats import message_size
from ..errors import PayloadTooLarge

__all__ = [
    "CONFLICT_CODES",
    "KV_OP",
    "MARKER_REASON",
    "MARKER_TTL",
    "TTL",
    "Conflict",
    "GetLast",
    "JsErrorCode",
    "Latest",
    "Publish",
    "conflicts",
    "delete",
    "latest",
    "ttl_header",
    "write",
]

KV_OP = "KV-Operation"
MARKER_REASON = "Nats-Marker-Reason"
MARKER_TTL = 60.0
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
TTL = "Nats-TTL"


class JsErrorCode(IntEnum):
    """JetStream API error codes (``err_code``) Reach acts on, named as nats-server names
    them (server/errors.json)."""

    #: JSStreamWrongLastSequenceErrF, "wrong last sequence: {seq}"
    WRONG_LAST_SEQUENCE = 10071
    #: JSStreamWrongLastSequenceConstantErr, "wrong last sequence"
    WRONG_LAST_SEQUENCE_CONSTANT = 10164
    #: JSSequenceNotFoundErrF, "sequence {seq} not found" (a delete of a message gone)
    SEQUENCE_NOT_FOUND = 10043
    #: JSStreamMsgDeleteFailedF, "{err}": "no message found" for a message gone
    MSG_DELETE_FAILED = 10057
    #: JSStreamNotFoundErr, "stream not found"
    STREAM_NOT_FOUND = 10059
    #: JSStreamNameExistErr, "stream name already in use with a different configuration"
    STREAM_NAME_EXIST = 10058
    #: JSStreamSubjectOverlapErr, "subjects overlap with an existing stream"
    STREAM_SUBJECT_OVERLAP = 10065


#: The refusals that mean "someone wrote the key since the revision you named".
CONFLICT_CODES = frozenset(
    {JsErrorCode.WRONG_LAST_SEQUENCE, JsErrorCode.WRONG_LAST_SEQUENCE_CONSTANT}
)


class Conflict(Exception):
    """Another writer changed the key since the revision we read (or it exists, for a
    create): read it again and decide again."""


#: A JetStream publish: (subject, data, headers) -> the stream sequence; nats-py's
#: ``APIError`` when the server refuses it.
Publish = Callable[[str, bytes, dict[str, str]], Awaitable[int]]

#: A read of the newest message on a subject: (stream, subject) -> it, or None when there
#: is none (``reach._jsapi.JsApi.last_msg``).
GetLast = Callable[[str, str], Awaitable[RawStreamMsg | None]]


@dataclass(frozen=True, slots=True)
class Latest:
    """The newest message of a key: its revision, and its value unless it is a marker;
    ``operation`` says which marker ("DEL", "PURGE"; an expiry is a "PURGE")."""

    revision: int
    value: bytes | None
    operation: str | None = None


def ttl_header(ttl: float) -> str:
    return f"{max(1, int(ttl * 1000))}ms"


@contextmanager
def conflicts(what: str) -> Iterator[None]:
    """Within it, the server's wrong-last-sequence refusal is ``Conflict(what)``."""
    try:
        yield
    except nats.js.errors.APIError as exc:
        if exc.err_code in CONFLICT_CODES:
            raise Conflict(what) from exc
        raise


async def write(
    via: JetStreamContext | Publish,
    bucket: str,
    key: str,
    value: bytes,
    *,
    last: int | None,
    ttl: float | None,
    headers: Mapping[str, str] | None = None,
    limit: int | None = None,
) -> int:
    """Publish ``value`` as the newest message of ``key``; its revision.

    ``last``: write iff the key's newest revision is ``last`` (0: the key is absent),
    ``Conflict`` otherwise; None writes whatever is there. ``ttl``: the message (and so
    the key, while it is the newest) expires after ``ttl`` seconds; None: never.
    ``headers`` go along (a ``KV-Operation``, or the caller's own). ``via``: nats-py's
    JetStream context, or a publish of the caller's own (a faster path). ``limit``: the
    connection's max_payload; a message over it with its headers is ``PayloadTooLarge``
    and never sent (the server would close the connection for it)."""
    sent = dict(headers) if headers else {}
    if last is not None:
        sent[EXPECTED_LAST] = str(last)
    if ttl is not None:
        sent[TTL] = ttl_header(ttl)
    subject = f"$KV.{bucket}.{key}"
    if limit is not None and (size := message_size(value, sent)) > limit:
        raise PayloadTooLarge(
            f"{subject}: {size} bytes with its headers, over max_payload ({limit})",
            size=size,
            limit=limit,
        )
    with conflicts(subject):
        if isinstance(via, JetStreamContext):
            ack = await via.publish(subject, value, headers=sent)
            return int(ack.seq)
        return await via(subject, value, sent)


async def delete(
    via: JetStreamContext | Publish,
    bucket: str,
    key: str,
    *,
    last: int | None,
    ttl: float | None = None,
) -> int:
    """Delete marker (history 1 drops the value), compare-and-set when ``last`` is given.
    With ``ttl`` the marker itself expires, so keys that come and go leave nothing behind."""
    return await write(via, bucket, key, b"", last=last, ttl=ttl, headers={KV_OP: "DEL"})


async def latest(via: JetStreamContext | GetLast, bucket: str, key: str) -> Latest:
    """Read the newest message of ``key`` straight from the stream (markers included).
    ``via``: nats-py's JetStream context, or a read of the caller's own (a faster path)."""
    stream, subject = f"KV_{bucket}", f"$KV.{bucket}.{key}"
    if isinstance(via, JetStreamContext):
        try:
            msg: RawStreamMsg | None = await via.get_msg(stream, subject=subject)
        except nats.js.errors.NotFoundError:
            msg = None
    else:
        msg = await via(stream, subject)
    if msg is None:
        return Latest(0, None)
    headers = msg.headers or {}
    revision = int(msg.seq or 0)
    if KV_OP in headers:
        return Latest(revision, None, headers[KV_OP])
    if MARKER_REASON in headers:
        return Latest(revision, None, "PURGE")
    if not msg.data:
        return Latest(revision, None)
    return Latest(revision, bytes(msg.data))
