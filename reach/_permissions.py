"""What the NATS server refused on one connection: credentials and subject permissions.

nats-server answers a refused publish or subscription with ``-ERR 'Permissions Violation
for Publish to "<subject>"'`` (or ``Subscription to``) and keeps the connection; nats-py
hands that, lowercased, to the connection's error callback and nothing else happens: a
request to a forbidden subject would simply time out. ``Permissions`` is that callback's
other half. It counts the violations, logs each subject once, keeps the refused subjects
(bounded) and tells its listeners, so the parts that wait on the server can turn the
refusal into :class:`reach.Unauthorized` at once:

- the request inbox (``reach._inbox``: a client's requests, durable tasks' JetStream API
  calls) wakes its pending calls with ``Recheck``; the call whose subject was refused
  raises Unauthorized, the others wait on (nothing is added to a request's path: the work
  happens only when a violation arrives);
- an Agent or Registry start fails with Unauthorized when a subscription it made was
  refused (the server's ``-ERR`` arrives before the PONG of the flush that ends a start);
- ``Client.flush()`` raises it for publishes refused since the last flush, and a
  ``Client.publish()`` to a subject refused before raises it without sending.

Subjects are compared lowercased: nats-py lowercases the whole error line.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import Unauthorized

__all__ = [
    "AUTH_REFUSED",
    "Permissions",
    "Recheck",
    "Violation",
    "auth_refused",
    "parse",
    "rearm",
    "unauthorized",
]

log = logging.getLogger("reach.nats")

#: what nats-py's error says when the server refused the credentials (the CONNECT)
AUTH_REFUSED = "authorization violation"
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "(.*?)"')
_MAX_SUBJECTS = 1024  # refused subjects remembered (and logged once each); then debug only
_RECENT = 64  # violations kept for since()


@dataclass(frozen=True, slots=True)
class Violation:
    """One refusal: ``kind`` is "publish" or "subscribe"; ``subject`` is lowercased."""

    kind: str
    subject: str


def auth_refused(exc: BaseException) -> bool:
    """Whether a connection error says the server refused our credentials."""
    return AUTH_REFUSED in str(exc).lower()


def parse(exc: BaseException) -> Violation | None:
    """The violation an error-callback exception reports, or None for other errors."""
    m = _VIOLATION.search(str(exc).lower())
    if m is None:
        return None
    return Violation("publish" if m.group(1) == "publish" else "subscribe", m.group(2))


def unauthorized(violation: Violation, conn: str, *, capability: str = "") -> Unauthorized:
    """The error for one refusal, saying what to change."""
    verb = "publish to" if violation.kind == "publish" else "subscribe to"
    err = Unauthorized(
        f"NATS refused connection {conn!r} permission to {verb} {violation.subject!r}: the "
        f"user's permissions in nats-server.conf do not allow it",
        capability=capability,
    )
    err.subject = violation.subject
    return err


class Recheck(Exception):
    """Set on a pending call's future when a publish was refused: the call compares its
    own subject with ``violation`` and, unless it was the one refused, awaits ``fresh``
    (already in the pending map in its place, so a reply arriving meanwhile is kept)."""

    def __init__(self, violation: Violation, fresh: asyncio.Future[Any]) -> None:
        self.violation = violation
        self.fresh = fresh
        super().__init__(violation.subject)


def rearm(pending: dict[str, asyncio.Future[Any]], violation: Violation) -> None:
    """Wake every pending call of a muxed inbox with ``Recheck`` (publish refusals only)."""
    if violation.kind != "publish" or not pending:
        return
    loop = asyncio.get_running_loop()
    for token, fut in list(pending.items()):
        if fut.done():
            continue
        fresh: asyncio.Future[Any] = loop.create_future()
        pending[token] = fresh
        fut.set_exception(Recheck(violation, fresh))
        fut.exception()  # retrieved: a call that left meanwhile must not warn


Listener = Callable[[Violation], None]


class Permissions:
    """The refusals of one connection (made by ``connect_nats``; read by its users)."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: permission violations the server reported on this connection
        self.count = 0
        self.refused_publish: set[str] = set()
        self.refused_subscribe: set[str] = set()
        self._recent: deque[tuple[int, Violation]] = deque(maxlen=_RECENT)
        self._listeners: list[Listener] = []

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unlisten(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def record(self, exc: BaseException) -> bool:
        """From the error callback: True when ``exc`` was a permission violation (then
        counted, logged once per subject and passed to the listeners)."""
        violation = parse(exc)
        if violation is None:
            return False
        self.count += 1
        self._recent.append((self.count, violation))
        seen = self.refused_publish if violation.kind == "publish" else self.refused_subscribe
        if violation.subject in seen:
            log.debug("nats connection %s: %s refused again", self.name, violation.subject)
        else:
            if len(seen) < _MAX_SUBJECTS:
                seen.add(violation.subject)
            log.warning(
                "nats connection %s: the server refused to let this user %s %r "
                "(a permissions violation; see the user's permissions in nats-server.conf)",
                self.name,
                violation.kind,
                violation.subject,
            )
        for listener in list(self._listeners):
            listener(violation)
        return True

    def forget(self) -> None:
        """Refused subjects are asked again (after a reconnect: permissions may have
        changed); the count and the recent refusals stay for ``since``."""
        self.refused_publish.clear()
        self.refused_subscribe.clear()

    def since(self, mark: int) -> list[Violation]:
        """Violations after the ``count`` was ``mark`` (the newest ``_RECENT`` at most)."""
        return [v for n, v in self._recent if n > mark]

    def publish_refused(self, subject: str) -> bool:
        """Whether the server refused a publish to ``subject`` on this connection before."""
        return bool(self.refused_publish) and subject.lower() in self.refused_publish

    def error(self, violation: Violation, *, capability: str = "") -> Unauthorized:
        return unauthorized(violation, self.name, capability=capability)

    def check(self, mark: int, what: str) -> None:
        """Raise Unauthorized naming every subject refused since ``mark`` (for ``what``:
        "start", "flush", ...); nothing when none was."""
        refused = self.since(mark)
        if not refused:
            return
        first = refused[0]
        names = ", ".join(dict.fromkeys(f"{v.kind} {v.subject!r}" for v in refused))
        err = Unauthorized(
            f"{what}: NATS refused connection {self.name!r} permission to {names}; give "
            f"its user these subjects in nats-server.conf (or connect as another user)"
        )
        err.subject = first.subject
        raise err
