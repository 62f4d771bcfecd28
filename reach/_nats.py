"""The one place that talks to nats-py about connections: connect, flush, and the
translation of nats-py's exceptions into ``ReachError``s.

Everything above this module catches ``ReachError`` subclasses (or the ``TRANSIENT`` tuple
for best-effort sends); nats-py's own exception classes are named here and nowhere else
on the request, agent and registry paths.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsConnection
from nats.aio.subscription import Subscription

from ._delivery import shortcuts_allowed
from ._permissions import Permissions, auth_refused
from ._urls import check_servers, redact
from .errors import ConnectionFailed, PayloadTooLarge, Unauthorized
from .settings import ReachSettings

__all__ = [
    "CONNECTION_LOST",
    "HEADROOM",
    "TOO_LARGE",
    "TRANSIENT",
    "NatsConnection",
    "ReachConnection",
    "check_refused",
    "connect_nats",
    "credentials",
    "fits",
    "flush_nats",
    "is_no_responders",
    "jetstream_unready",
    "leave",
    "message_size",
    "permissions_of",
    "redact",
    "refusals",
    "too_large",
    "translate",
    "unreachable",
]

log = logging.getLogger("reach.nats")

#: nats-py refuses to send a message over the server's max_payload (nothing is sent)
TOO_LARGE = nats.errors.MaxPayloadError


#: headers are far smaller: only a payload this close to max_payload is measured with them
HEADROOM = 4096


def message_size(data: bytes, headers: Mapping[str, str] | None) -> int:
    """What the server counts against max_payload: the payload and its headers block (an
    upper bound: ``NATS/1.0``, each ``key: value`` line, the blank line)."""
    if not headers:
        return len(data)
    return len(data) + sum(len(k) + len(v.encode()) + 4 for k, v in headers.items()) + 16


def fits(nc: NatsConnection, data: bytes, headers: dict[str, str]) -> bool:
    """nats-py checks a payload alone against max_payload; the server counts the headers
    too, and closes the connection (losing everything in flight on it) when the sum is
    over."""
    return message_size(data, headers) <= nc.max_payload


def too_large(nc: NatsConnection, size: int, what: str) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"{what}: payload of {size} bytes is over the server's max_payload of"
        f" {nc.max_payload} bytes; pass a reference to the data (an object store key,"
        " a URL) instead",
        size=size,
        limit=nc.max_payload,
    )


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


async def connect_nats(
    settings: ReachSettings,
    url: str,
    name: str,
    reconnected: Callable[[], Awaitable[None]] | None = None,
    closed: Callable[[], Awaitable[None]] | None = None,
) -> NatsConnection:
    """Open a NATS connection that reconnects forever, with the settings' credentials.

    ``url`` is checked first (nats-py spins on an empty one and raises its own errors on a
    bad one). The first connect keeps trying for ``connect_timeout`` seconds per server in
    ``url``, then raises ``ConnectionFailed`` saying why and what to do; ``Unauthorized``
    at once when the server refuses the credentials (none given, or wrong). The server's
    permission violations on the connection go to its ``Permissions``
    (``permissions_of(nc)``), which logs and counts them.

    nats-py reconnects after a lost link, but gives the connection up for good when the
    server closes it for an error it names (a message over max_payload, a protocol
    violation, an authorization violation): that is logged once, and ``closed`` is called
    (never for a close of ours, ``close_nats``).
    """
    try:
        servers = check_servers(url)  # a cluster: nats://a:4222,nats://b:4222
    except ValueError as exc:
        raise ConnectionFailed(str(exc), url=redact(url)) from None
    perms = Permissions(name)
    nc = ReachConnection(perms, shortcuts=settings.nats_shortcuts)
    link = _Link(name, redact(url), perms, nc)

    async def on_error(exc: Exception) -> None:
        link.error(exc)

    async def on_disconnect() -> None:
        link.lost()

    async def on_reconnect() -> None:
        link.back()
        perms.forget()  # the server may have been reloaded with other permissions
        if reconnected is not None:
            await reconnected()

    async def on_closed() -> None:
        if link.given_up() and closed is not None:
            await closed()

    # nats-py types these seconds as int; it uses them as float (as nats.connect passes them)
    options: dict[str, Any] = {
        "connect_timeout": settings.connect_timeout,
        "reconnect_time_wait": 0.25,
        **credentials(settings, url),
    }
    budget = settings.connect_timeout * len(servers)
    try:
        # nats-py retries the first connect forever when reconnects are unlimited; bound it.
        async with asyncio.timeout(budget):
            await nc.connect(
                servers,
                name=name,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                closed_cb=on_closed,
                **options,
            )
    except _Refused as exc:
        await _abandon(nc)
        who = _user(settings, url)
        raise Unauthorized(
            f"NATS at {redact(url)} refused the credentials {who}({exc}); set "
            "REACH_NATS_USER and REACH_NATS_PASSWORD (or REACH_NATS_TOKEN, REACH_NATS_CREDS, "
            "or user:password in REACH_NATS_URL) to a user of its nats-server.conf"
        ) from None
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        await _abandon(nc)
        reason, fix = unreachable(link.last or exc)
        raise ConnectionFailed(
            f"cannot reach NATS at {redact(url)} within {budget:g}s: {reason}; {fix}",
            url=redact(url),
        ) from None
    link.connected()
    return nc


def unreachable(exc: BaseException) -> tuple[str, str]:
    """What a failed connect attempt means, and what to do about it, in a few words each."""
    where = "REACH_NATS_URL (or --url)"
    if isinstance(exc, ConnectionRefusedError):
        return (
            "connection refused (no server listens on that port)",
            f"start one with `reach up`, or point {where} at a running nats-server",
        )
    if isinstance(exc, socket.gaierror):
        return f"host not found ({exc.strerror})", f"check the host name in {where}"
    if isinstance(exc, ssl.SSLError):
        why = getattr(exc, "reason", None) or exc  # an SSLError made by hand has no reason
        return f"TLS failed ({why})", "check the certificates, or use nats://"
    if isinstance(exc, TimeoutError):
        return (
            "no answer",
            f"check the host and port in {where} and any firewall, or raise REACH_CONNECT_TIMEOUT",
        )
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__, f"check {where}"
    text = str(exc).removeprefix("nats: ") or type(exc).__name__
    return text, f"check that {where} names a nats-server's client port"


class _Link:
    """What the callbacks of one connection know: the last failure of the first connect
    (for the error that ends it) and whether a reconnect episode is under way. nats-py
    reports every failed attempt (four a second); an episode is logged once when the
    connection is lost and once when it is back."""

    def __init__(self, name: str, url: str, perms: Permissions, nc: NatsConnection) -> None:
        self.name, self.url, self.perms, self.nc = name, url, perms, nc
        self.connecting = True
        self.last: BaseException | None = None
        self.down_since: float | None = None
        self.failed = 0  # attempts that failed in this episode
        self.auth_warned = False

    def connected(self) -> None:
        self.connecting, self.last = False, None

    def error(self, exc: Exception) -> None:
        if self.perms.record(exc):
            return
        if auth_refused(exc):
            if self.connecting:
                # Raised inside nats-py's first-connect loop, it ends it: retrying the same
                # credentials forever would only turn a clear refusal into a timeout.
                raise _Refused(str(exc))
            if not self.auth_warned:
                self.auth_warned = True
                log.warning(
                    "nats connection %s: credentials refused on reconnect: %s", self.name, exc
                )
            return
        if self.connecting or self.down_since is not None:
            self.last = exc
            self.failed += 1
            log.debug("nats connection %s: %s", self.name, exc)
        elif isinstance(exc, _LINK_ERRORS):
            self.lost(exc)
        else:
            log.warning("nats connection %s: %s", self.name, exc)

    def lost(self, exc: BaseException | None = None) -> None:
        """The connection went (an error said so, or nats-py began to reconnect)."""
        if self.connecting or self.down_since is not None:
            return
        if exc is None and not self.nc.is_reconnecting:
            return  # closed on purpose
        if closing(self.nc):
            # our own close: a drain that timed out, a socket it shut; nothing reconnects
            log.debug("nats connection %s: closing: %s", self.name, exc)
            return
        self.down_since, self.failed = time.monotonic(), 0
        why = f" ({str(exc) or type(exc).__name__})" if exc is not None else ""
        log.warning(
            "nats connection %s: lost %s%s; reconnecting (logged again when it is back)",
            self.name,
            self.url,
            why,
        )

    def given_up(self) -> bool:
        """nats-py closed the connection: True (logged) when it gave it up for good, False
        for a close of ours or of a first connect that failed."""
        if self.connecting or getattr(self.nc, "reach_closing", False):
            return False
        cause = self.nc.last_error
        why = str(cause).removeprefix("nats: ") if cause is not None else "no error given"
        log.warning(
            "nats connection %s: closed by %s for good (%s); nats-py will not reconnect it",
            self.name,
            self.url,
            why,
        )
        return True

    def back(self) -> None:
        self.auth_warned = False
        if self.down_since is not None:
            log.info(
                "nats connection %s: reconnected to %s after %.1fs (%d failed attempts)",
                self.name,
                self.url,
                time.monotonic() - self.down_since,
                self.failed,
            )
        self.down_since, self.last = None, None


#: what an established connection reports when it goes (then nats-py reconnects)
_LINK_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    nats.errors.UnexpectedEOF,
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionClosedError,
)


class ReachConnection(NatsConnection):
    """A nats-py connection that carries what the server refused on it, and whether the
    request path may take its shortcuts through nats-py's internals (``_delivery``)."""

    def __init__(self, permissions: Permissions, *, shortcuts: bool = False) -> None:
        super().__init__()
        self.permissions = permissions
        #: read by ``_delivery`` on every publish and subscription; only connections made
        #: by ``connect_nats`` ever have it on (never a connection a user hands us)
        self.reach_shortcuts = shortcuts and shortcuts_allowed(self)
        #: set by every close of its user's (``close``, ``drain``, ``close_nats``...): what
        #: goes wrong from then on is the close, not a loss, and a closed connection was
        #: not given up by nats-py
        self.reach_closing = False

    async def close(self) -> None:
        self.reach_closing = True
        await super().close()

    async def drain(self) -> None:
        self.reach_closing = True
        await super().drain()

    async def __aexit__(self, *exc_info: object) -> None:
        self.reach_closing = True
        await super().__aexit__(*exc_info)


def closing(nc: NatsConnection) -> bool:
    """Whether ``nc`` is being closed or drained on purpose (by us or nats-py)."""
    return bool(getattr(nc, "reach_closing", False)) or nc.is_draining or nc.is_closed


def permissions_of(nc: NatsConnection) -> Permissions | None:
    """The refusals of a connection made by ``connect_nats`` (None for any other)."""
    return nc.permissions if isinstance(nc, ReachConnection) else None


def check_refused(
    nc: NatsConnection | None, what: str, failure: BaseException | None = None, since: int = 0
) -> None:
    """Raise Unauthorized naming what the server refused on ``nc`` after its ``count`` was
    ``since`` (nothing if it refused nothing). A refused SUB or PUB is answered before the
    PONG of a later flush, so after ``flush_nats`` this tells all about what was sent
    before it. With ``failure`` (what ``what`` failed with), only an ordinary error is
    explained so (a timeout of a refused JetStream call, say), never a cancellation."""
    if failure is not None and (
        not isinstance(failure, Exception) or isinstance(failure, Unauthorized)
    ):
        return
    permissions = permissions_of(nc) if nc is not None else None
    if permissions is not None:
        permissions.check(since, what)


def refusals(nc: NatsConnection) -> int:
    """How many refusals ``nc`` has had so far: a mark for ``check_refused``."""
    permissions = permissions_of(nc)
    return permissions.count if permissions is not None else 0


class _Refused(Exception):
    """The server refused the credentials during the first connect."""


async def _abandon(nc: NatsConnection) -> None:
    """Close a connection whose first connect failed (its socket may still be open)."""
    try:
        await nc.close()
    except TRANSIENT as exc:
        log.debug("closing a failed connection: %s", exc)


def _has_userinfo(url: str) -> bool:
    return any("@" in urlsplit(u.strip()).netloc for u in url.split(","))


def credentials(settings: ReachSettings, url: str) -> dict[str, Any]:
    """nats-py's connect arguments for the settings' credentials. A ``user:password@`` in
    the URL wins over ``nats_user``/``nats_password``/``nats_token`` (it is the more
    specific); a ``nats_creds`` file is always used when set."""
    kwargs: dict[str, Any] = {}
    if settings.nats_creds:
        kwargs["user_credentials"] = settings.nats_creds
    if _has_userinfo(url):
        return kwargs
    if settings.nats_user:
        kwargs["user"] = settings.nats_user
        kwargs["password"] = settings.nats_password.get_secret_value()
    elif settings.nats_token:
        kwargs["token"] = settings.nats_token.get_secret_value()
    return kwargs


def _user(settings: ReachSettings, url: str) -> str:
    for u in url.split(","):
        user = urlsplit(u.strip()).username
        if user:
            return f"of user {user!r} "
    if settings.nats_user:
        return f"of user {settings.nats_user!r} "
    if settings.nats_token:
        return "(a token) "
    if settings.nats_creds:
        return f"in {settings.nats_creds} "
    return "(none were given) "


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


def jetstream_unready(exc: BaseException) -> bool:
    """Whether a JetStream call failed because nobody could answer it yet (a stream or
    the meta group between leaders, a server restarting, the connection reconnecting),
    so the same call may succeed later; an answer that refused it (a bad config, a
    limit) or a closed connection will not change by waiting."""
    if isinstance(exc, nats.errors.ConnectionClosedError):
        return False
    if isinstance(exc, nats.js.errors.APIError):
        # 10008: JetStream temporarily unavailable; 10158: an earlier publish with the same
        # Nats-Msg-Id is still being stored (its ack was lost): the next try is answered
        return isinstance(exc, nats.js.errors.ServiceUnavailableError) or exc.err_code in (
            10008,
            10158,
        )
    return isinstance(
        exc,
        (
            TimeoutError,
            nats.errors.NoRespondersError,
            nats.js.errors.NoStreamResponseError,
            *CONNECTION_LOST,
        ),
    )


#: what closing a connection whose server is gone may raise (uvloop's RuntimeError too)
_CLOSE_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT, RuntimeError)


async def close_nats(nc: NatsConnection, *, drain: bool = True) -> None:
    """Drain (or close) a connection we own, whatever state it is in. Draining needs a
    live connection; a reconnecting one is closed instead. nats-py's close can end in a
    ``CancelledError`` of its own (it waits on a socket whose close it cancelled, when the
    connection was lost): that is not our task being cancelled, so it is not passed on.
    Nor are nats-py's errors, or uvloop's RuntimeError, of a connection whose server is gone:
    expected while stopping, they are logged at debug, without a traceback."""
    if nc.is_closed:
        return
    if isinstance(nc, ReachConnection):
        nc.reach_closing = True
    try:
        if drain and nc.is_connected:
            try:
                await nc.drain()
                return
            except TRANSIENT as exc:
                log.debug("drain failed, closing instead: %s", exc)
        await nc.close()
    except _CLOSE_ERRORS as exc:
        # RuntimeError: uvloop's "unable to perform operation on <TCPTransport closed=True>;
        # the handler is closed", from nats-py writing to the socket of a server gone
        log.debug("close after a lost connection: %s", exc)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.debug("nats-py's close was cancelled inside nats-py; the connection is closed")
