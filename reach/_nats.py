"""The one place that talks to nats-py about connections: connect, flush, and the
translation of nats-py's exceptions into ``ReachError``s.

Everything above this module catches ``ReachError`` subclasses (or the ``TRANSIENT`` tuple
for best-effort sends); nats-py's own exception classes are named here and nowhere else
on the request, agent and registry paths.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsConnection
from nats.aio.subscription import Subscription

from .errors import ConnectionFailed
from .settings import ReachSettings

__all__ = [
    "CONNECTION_LOST",
    "TRANSIENT",
    "NatsConnection",
    "connect_nats",
    "flush_nats",
    "is_no_responders",
    "leave",
    "server_list",
    "translate",
]

log = logging.getLogger("reach.nats")

#: What a send, a KV call or a request may raise when the server is away or slow. Best-effort
#: sends (a heartbeat, an error reply, an event) catch exactly these and log them.
TRANSIENT: tuple[type[BaseException], ...] = (
    nats.errors.Error,
    nats.js.errors.Error,
    OSError,
    TimeoutError,
)


def is_no_responders(exc: BaseException) -> bool:
    """Whether a request failed because nobody listens on its subject (not a timeout)."""
    return isinstance(exc, nats.errors.NoRespondersError)


#: nats-py's "the connection is gone" errors: what ``translate`` turns into ConnectionFailed.
#: The request path catches this tuple itself (a context manager per request costs ~1 µs).
CONNECTION_LOST: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionReconnectingError,
)


def server_list(url: str) -> list[str]:
    """The servers in ``url``: one URL, or several comma-separated (the nodes of a cluster;
    nats-py takes a list, and reads a comma-joined string as one broken URL)."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def connect_nats(
    settings: ReachSettings,
    url: str,
    name: str,
    reconnected: Callable[[], Awaitable[None]] | None = None,
) -> NatsConnection:
    """Open a NATS connection that reconnects forever; ConnectionFailed if the first fails."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats connection %s: %s", name, exc)

    try:
        # nats-py retries the first connect forever when reconnects are unlimited; bound it.
        async with asyncio.timeout(settings.connect_timeout * 3):
            return await nats.connect(
                server_list(url),
                name=name,
                connect_timeout=settings.connect_timeout,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                error_cb=on_error,
                reconnected_cb=reconnected,
            )
    except (nats.errors.NoServersError, OSError, TimeoutError) as exc:
        raise ConnectionFailed(f"cannot reach NATS at {url}: {exc}", url=url) from exc


async def flush_nats(nc: NatsConnection) -> None:
    """Return once the server has processed everything sent so far.

    nats-py 2.16 writes the flush PING straight to the socket, ahead of commands still in
    its pending buffer, so one PONG can arrive before earlier SUBs are processed (seen here:
    a no-responders reply 1 time in 200 right after an agent started). By the first PONG the
    buffer has been written, so a second round trip covers it.
    """
    await nc.flush()
    await nc.flush()


@contextmanager
def translate(url: str = "") -> Iterator[None]:
    """Turn a lost or closed connection into ``ConnectionFailed`` (the one boundary)."""
    try:
        yield
    except CONNECTION_LOST as exc:
        raise ConnectionFailed(f"not connected to NATS: {exc}", url=url) from exc


async def leave(nc: NatsConnection, sub: Subscription) -> None:
    """Stop a subscription without losing what the server already sent to it.

    nats-py's ``Subscription.drain()`` queues the UNSUB, then flushes once; its PING can
    overtake the UNSUB (see ``flush_nats``), so the subscription is removed while the server
    still routes to it, and a request that lands in that window is dropped unanswered
    (seen here: a queue-group request timed out right after an agent paused). So: UNSUB
    first, two round trips (the server has stopped routing to us and everything it sent
    is in), then drain what is pending.
    """
    # nats-py has no public "UNSUB only"; if a later release drops these names, its own
    # drain is still correct apart from that window.
    unsubscribe = getattr(nc, "_send_unsubscribe", None)
    sid = getattr(sub, "_id", None)
    if unsubscribe is not None and isinstance(sid, int):
        await unsubscribe(sid)
        await flush_nats(nc)
    await sub.drain()  # type: ignore[no-untyped-call]
