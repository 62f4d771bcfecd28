"""Two shortcuts through nats-py on the request path, each a turn of the event loop less.

nats-py hands every message to a subscription's own task through an ``asyncio.Queue``,
and every publish to a flusher task that writes on its next turn. For a request that is
two task switches on each side, before any work, on top of the task that does the work.

- ``subscribe_direct``: the message goes to a plain function as nats-py parses it, in its
  reading task. The client's reply inbox and an agent's intake only look at the message
  and hand it on (a future, the workers' queue), which is what a subscription task would
  do a turn later. The function must not block nor raise: what it raises is logged and
  counted in ``failures``, never allowed into nats-py's reading loop.
- ``write_through``: when the caller knows nothing else is about to be sent (one request
  pending, one handler running), what nats-py holds is written now instead of on the
  flusher's next turn. Under load, callers skip it and nats-py batches as before.

Both reach into nats-py's internals (``Subscription._pending_queue``; the connection's
``_pending``, ``_flush_queue`` and transport). Each checks what it relies on and falls
back to nats-py's own path when it finds something else (``tests/integration/
test_delivery.py`` holds them to the installed nats-py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

__all__ = ["Deliver", "DirectQueue", "subscribe_direct", "write_through"]

log = logging.getLogger("reach.nats")

Deliver = Callable[[Msg], None]


class DirectQueue:
    """Stands in for a subscription's pending queue: ``put_nowait`` delivers at once.
    Nothing is ever pending, so draining the subscription waits for nothing more."""

    __slots__ = ("_sub", "deliver", "failures")

    def __init__(self, sub: Subscription, deliver: Deliver) -> None:
        self._sub = sub
        self.deliver = deliver
        self.failures = 0

    def put_nowait(self, msg: Msg) -> None:
        self._sub._pending_size -= len(msg.data)  # counted by nats-py as it queued it
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
    sub = await nc.subscribe(subject, queue=queue)  # no callback: nats-py starts no task
    pending: Any = getattr(sub, "_pending_queue", None)
    if not isinstance(pending, asyncio.Queue) or not hasattr(sub, "_pending_size"):
        await sub.unsubscribe()

        async def callback(msg: Msg) -> None:
            deliver(msg)

        return await nc.subscribe(subject, queue=queue, cb=callback)
    direct = DirectQueue(sub, deliver)
    sub._pending_queue = direct  # type: ignore[assignment]
    while not pending.empty():  # nothing can have come yet; should it have, it goes first
        direct.put_nowait(pending.get_nowait())
    return sub


def write_through(nc: NatsConnection) -> None:
    """Write what nats-py holds for ``nc`` now, if its socket takes it without waiting;
    nats-py's flusher, woken for it already, then finds nothing to write. On any doubt
    (reconnecting, a socket behind or closing, a write that fails) it writes nothing and
    leaves it all to the flusher, which knows how to fail."""
    queue = getattr(nc, "_flush_queue", None)
    if queue is None or queue.qsize() != 1 or not nc._pending_data_size or not nc.is_connected:
        return  # (reconnecting: nats-py keeps what is pending for the new connection)
    writer = getattr(nc._transport, "_io_writer", None)  # TCP; other transports: the flusher
    if writer is None:
        return
    transport = writer.transport
    if transport.is_closing() or transport.get_write_buffer_size():
        return  # closing, or the socket is behind: the flusher waits for it, or fails
    try:
        writer.writelines(nc._pending)
    except (OSError, RuntimeError):  # a transport closed under us (uvloop raises)
        return
    nc._pending = []
    nc._pending_data_size = 0
    kicked = queue.get_nowait()
    if not kicked.done():
        kicked.set_result(None)
