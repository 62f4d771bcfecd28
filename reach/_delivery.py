"""Shortcuts through nats-py on the request path: a turn of the event loop less, or
objects per message fewer.

nats-py hands every message to a subscription's own task through an ``asyncio.Queue``,
and every publish to a flusher task that writes on its next turn. For a request that is
two task switches on each side, before any work, on top of the task that does the work.

- ``subscribe_direct``: the message goes to a plain function as nats-py reads it, in its
  reading task. The request inbox (a client's replies, and those of the JetStream API
  calls of durable tasks) and an agent's intake only look at the message and hand it on
  (a future, the workers' queue), which is what a subscription task would do a turn
  later. The function must not block nor raise: what it raises is logged and
  counted in ``failures``, never allowed into nats-py's reading loop. reach reads these
  messages itself (``_read_messages``, ``read_headers``), where nats-py's parser hands
  them over: nats-py takes a coroutine for the headers, and counts each message into and
  out of the subscription's queue.
- ``publish``: nats-py's publish, framed by reach in one step (nats-py's takes four
  coroutines and two regular-expression checks per header). When the caller knows nothing
  else is about to be sent (one request pending, one request accepted and unanswered),
  the message is written to the socket at once, not on the flusher's next turn. Under
  load it joins nats-py's buffer, and nats-py's flusher batches as before.
- ``write_through``: what nats-py already holds (a publish that went through nats-py),
  written now instead of on the flusher's next turn.

They reach into nats-py's internals: the connection's ``_process_msg``, ``_subs``,
``msg_class``, status, ``_pending``, ``_flush_queue``, flusher task, transport and stats;
a subscription's ``_pending_queue``, ``_pending_size``, ``_received`` and ``_max_msgs``.
So they are fenced three ways:

- only on a connection made by ``connect_nats`` with ``nats_shortcuts`` on (the default;
  ``REACH_NATS_SHORTCUTS=false`` turns them off), never on one a user hands us;
- only on a nats-py version in ``TESTED_NATS_PY``: on any other they stay off, with one
  warning per process;
- only where the connection has every attribute they read (``shortcuts_allowed`` checks
  them once per connection; ``publish`` and ``subscribe_direct`` re-check what a reconnect
  replaces).

Off, every function here takes nats-py's public path (``publish`` returns False,
``subscribe_direct`` subscribes with a callback, ``write_through`` does nothing); CI runs
the request-path tests a second time so. The replaced reader is per connection: on a
connection reach made, its other subscriptions (JetStream's watches and pulls, a user's
on ``client.nc``) still go nats-py's way, through one coroutine call more per message.
(``tests/integration/test_delivery.py`` and ``tests/unit/test_read_headers.py`` hold
them to the installed nats-py.)
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .wire import Header

__all__ = [
    "TESTED_NATS_PY",
    "Deliver",
    "DirectQueue",
    "publish",
    "publish_by_nats",
    "read_headers",
    "shortcuts_allowed",
    "subscribe_direct",
    "write_through",
]

log = logging.getLogger("reach.nats")

#: nats-py versions the shortcuts were tested with (the suite runs on each, on and off)
TESTED_NATS_PY = frozenset({"2.16.0"})
#: what ``publish``, ``write_through`` and the reader read of a connection
_CONNECTION_ATTRS = (
    "_status",
    "_max_payload",
    "_pending",
    "_pending_data_size",
    "_max_pending_size",
    "_flush_queue",
    "_flusher_task",
    "_transport",
    "_process_msg",
    "_subs",
    "msg_class",
    "stats",
)
_warned: list[str] = []  # the untested version, once warned about


def _nats_py_version() -> str:
    try:
        return importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def shortcuts_allowed(nc: NatsConnection, version: str | None = None) -> bool:
    """Whether the shortcuts may run on ``nc``: a tested nats-py (else one warning per
    process) whose connection has every attribute they read."""
    version = _nats_py_version() if version is None else version
    if version not in TESTED_NATS_PY:
        if version not in _warned:
            _warned.append(version)
            log.warning(
                "nats-py %s is not among the versions reach's request-path shortcuts were"
                " tested with (%s): they are off (about 20%% fewer requests/s)",
                version,
                ", ".join(sorted(TESTED_NATS_PY)),
            )
        return False
    return all(hasattr(nc, a) for a in _CONNECTION_ATTRS)


def _on(nc: NatsConnection) -> bool:
    return getattr(nc, "reach_shortcuts", False) is True


Deliver = Callable[[Msg], None]

_CONNECTED = NatsConnection.CONNECTED
#: the header names reach frames itself (its own, W3C trace context); any other (baggage,
#: a caller's own) goes through nats-py's publish and its checks
_OWN_HEADERS = frozenset(
    value for name, value in vars(Header).items() if name.isupper() and isinstance(value, str)
)
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})  # in a header value, as nats-py does


class DirectQueue:
    """Stands in for a subscription's pending queue: ``put_nowait`` delivers at once.
    Nothing is ever pending, so draining the subscription waits for nothing more."""

    __slots__ = ("_sub", "deliver", "failures")

    def __init__(self, sub: Subscription, deliver: Deliver) -> None:
        self._sub = sub
        self.deliver = deliver
        self.failures = 0

    def put_nowait(self, msg: Msg) -> None:
        """nats-py's own way in (a message it read itself: ``_read_messages`` passed)."""
        self._sub._pending_size -= len(msg.data)  # counted by nats-py as it queued it
        self.hand(msg)

    def hand(self, msg: Msg) -> None:
        try:
            self.deliver(msg)
        except Exception:
            self.failures += 1
            log.exception("delivery on %s failed", msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        return None

    async def join(self) -> None:
        return None


async def subscribe_direct(
    nc: NatsConnection, subject: str, deliver: Deliver, queue: str = ""
) -> Subscription:
    """``nc.subscribe`` with ``deliver`` called in nats-py's reading task for each message
    (nats-py's own subscription task calling it, if its internals are not as expected)."""
    if not _on(nc):
        return await _subscribe_by_nats(nc, subject, deliver, queue)
    sub = await nc.subscribe(subject, queue=queue)  # no callback: nats-py starts no task
    pending: Any = getattr(sub, "_pending_queue", None)
    if not isinstance(pending, asyncio.Queue) or not hasattr(sub, "_pending_size"):
        await sub.unsubscribe()
        return await _subscribe_by_nats(nc, subject, deliver, queue)
    direct = DirectQueue(sub, deliver)
    sub._pending_queue = direct  # type: ignore[assignment]
    while not pending.empty():  # nothing can have come yet; should it have, it goes first
        direct.put_nowait(pending.get_nowait())
    if _readable(nc, sub) and not getattr(nc._process_msg, "reads_direct", False):
        nc._process_msg = _read_messages(nc)  # type: ignore[method-assign,assignment]
    return sub


async def _subscribe_by_nats(
    nc: NatsConnection, subject: str, deliver: Deliver, queue: str
) -> Subscription:
    """nats-py's own subscription task calls ``deliver`` (the public path)."""

    async def callback(msg: Msg) -> None:
        try:
            deliver(msg)
        except Exception:
            log.exception("delivery on %s failed", msg.subject)

    return await nc.subscribe(subject, queue=queue, cb=callback)


def _readable(nc: NatsConnection, sub: Subscription) -> bool:
    """Whether nats-py has what ``_read_messages`` uses; else nats-py reads on, and hands
    each message to the ``DirectQueue``."""
    return all(hasattr(nc, a) for a in ("_process_msg", "_subs", "msg_class", "stats")) and all(
        hasattr(sub, a) for a in ("_received", "_max_msgs")
    )


_HEADER_LINE = b"NATS/1.0\r\n"  # a header block without a status (a status has a code)


def _read_messages(nc: NatsConnection) -> Callable[..., Awaitable[None]]:
    """Stands in for ``nc._process_msg``, which nats-py's parser calls for each message.
    A message without a status for a direct subscription is built and handed over here,
    in one step; any other goes nats-py's way. Installed once per connection, it stays
    with it: on a connection shared with other code, its other subscriptions pay one
    coroutine call more per message. Headers are read as nats-py's ``_parse_header_lines``
    reads them (with ``fast_mail_parser`` installed, nats-py reads them as email headers
    instead; reach does not)."""
    original = nc._process_msg

    async def process_msg(
        sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        sub = nc._subs.get(sid)
        if sub is not None:
            direct: Any = sub._pending_queue
            if (
                direct.__class__ is DirectQueue
                and not sub._max_msgs
                and (not headers or headers.startswith(_HEADER_LINE))
            ):
                stats = nc.stats
                stats["in_msgs"] += 1
                stats["in_bytes"] += len(data)
                sub._received += 1
                msg = nc.msg_class(
                    subject=subject.decode(),
                    reply=reply.decode(),
                    data=data,
                    headers=read_headers(headers) if headers else None,
                    _client=nc,
                    _sid=sid,
                )
                direct.hand(msg)
                return
        await original(sid, subject, reply, data, headers)  # type: ignore[arg-type]

    process_msg.reads_direct = True  # type: ignore[attr-defined]
    return process_msg


def read_headers(block: bytes) -> dict[str, str] | None:
    """A header block without a status, read as nats-py reads one (its
    ``_parse_header_lines``): a name that is not ASCII or holds whitespace is skipped, a
    value is stripped and decoded with replacement; None when nothing is left."""
    found: dict[str, str] = {}
    for line in block[len(_HEADER_LINE) :].split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if key not in _OWN_HEADERS and key and key.split() != [key]:
            continue  # whitespace inside the name (reach's own names have none)
        found[key] = value.strip().decode("utf-8", "replace")
    return found or None


def write_through(nc: NatsConnection) -> None:
    """Write what nats-py holds for ``nc`` now, if its socket takes it without waiting;
    nats-py's flusher, woken for it already, then finds nothing to write. On any doubt
    (reconnecting, a socket behind or closing, a write that fails) it writes nothing and
    leaves it all to the flusher, which knows how to fail."""
    if not _on(nc):
        return
    queue = getattr(nc, "_flush_queue", None)
    if queue is None or queue.qsize() != 1 or not nc._pending_data_size or not nc.is_connected:
        return  # (reconnecting: nats-py keeps what is pending for the new connection)
    writer = getattr(nc._transport, "_io_writer", None)  # TCP; other transports: the flusher
    if writer is None or not _write(writer.transport, b"".join(nc._pending)):
        return
    nc._pending = []
    nc._pending_data_size = 0
    kicked = queue.get_nowait()
    if not kicked.done():
        kicked.set_result(None)


def publish(
    nc: NatsConnection,
    subject: str,
    payload: bytes,
    reply: str = "",
    headers: dict[str, str] | None = None,
    *,
    alone: bool = False,
) -> bool:
    """Frame a message as nats-py's ``publish`` would, and write it to the socket now
    (``alone``: the caller has nothing to batch it with) or add it to what nats-py's
    flusher writes on its next turn. False when it did neither: the caller awaits nats-py's
    own ``publish``, which checks, waits or raises (closed, draining, reconnecting, a full
    buffer, a subject or header it would refuse)."""
    if (
        not _on(nc)
        or nc._status != _CONNECTED
        or len(payload) > nc._max_payload
        or not subject
        or _unsafe(subject)
        or (reply and _unsafe(reply))
    ):
        return False
    queue = getattr(nc, "_flush_queue", None)
    flusher = getattr(nc, "_flusher_task", None)
    writer = getattr(nc._transport, "_io_writer", None)  # TCP; other transports: nats-py
    if queue is None or flusher is None or flusher.done() or writer is None:
        return False
    if headers:
        lines = ["NATS/1.0\r\n"]
        for key, value in headers.items():
            if key not in _OWN_HEADERS:
                return False
            if "\r" in value or "\n" in value:
                value = value.translate(_NEWLINES)
            lines.append(f"{key}: {value.strip()}\r\n")
        lines.append("\r\n")
        block = "".join(lines).encode()
        size = len(block) + len(payload)
        head = f"HPUB {subject} {reply} {len(block)} {size}\r\n".encode()
        frame = b"".join((head, block, payload, b"\r\n"))
    else:
        frame = b"".join((f"PUB {subject} {reply} {len(payload)}\r\n".encode(), payload, b"\r\n"))
    held = nc._pending_data_size
    if alone and not held and not queue.qsize():
        if _write(writer.transport, frame):
            _count(nc, payload)
            return True
        alone = False  # the socket is behind or closing: the flusher's, not ours
    limit = nc._max_pending_size
    if limit > 0 and held + len(frame) > limit:
        return False  # nats-py flushes and waits first: its back-pressure
    nc._pending.append(frame)
    nc._pending_data_size = held + len(frame)
    _count(nc, payload)
    if queue.empty():  # kick the flusher, as nats-py does
        queue.put_nowait(asyncio.get_running_loop().create_future())
    if alone:
        write_through(nc)
    return True


async def publish_by_nats(
    nc: NatsConnection,
    subject: str,
    payload: bytes,
    reply: str,
    headers: dict[str, str] | None,
    *,
    alone: bool,
) -> None:
    """What a caller does when ``publish`` returns False: nats-py's own publish (which
    checks, waits or raises), then, ``alone``, ``write_through``."""
    await nc.publish(subject, payload, reply=reply, headers=headers)
    if alone:
        write_through(nc)


def _unsafe(subject: str) -> bool:
    """What nats-py refuses in a subject: a space or a line break would inject protocol.
    (Four scans in C cost a third of a regular expression's search.)"""
    return " " in subject or "\n" in subject or "\r" in subject or "\t" in subject


def _write(transport: Any, frame: bytes) -> bool:
    """Whether ``frame`` went to the socket; else it is left to nats-py's flusher, which
    waits for a socket that is behind and fails on one that is closing."""
    if transport.is_closing() or transport.get_write_buffer_size():
        return False
    try:
        transport.write(frame)
    except (OSError, RuntimeError):  # a transport closed under us (uvloop raises)
        return False
    return True


def _count(nc: NatsConnection, payload: bytes) -> None:
    stats = nc.stats
    stats["out_msgs"] += 1
    stats["out_bytes"] += len(payload)
