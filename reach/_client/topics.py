"""Broadcast: publish to a topic, and subscriptions that yield ``TopicMessage``s; durable
publishes and ``since`` history go through ``reach._topics.DurableTopics``."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .._codec import decoder_for, encode_payload
from .._nats import TOO_LARGE, TRANSIENT, flush_nats, permissions_of, too_large, translate
from .._permissions import Violation
from .._subjects import Subjects, validate_topic
from .._topics import DurableTopics, Since
from .._topics.publisher import start_time
from ..errors import ConfigurationError, RequestTimeout
from ..wire import Header

__all__ = ["TopicMessage", "TopicSubscription", "publish", "subscribe"]

log = logging.getLogger("reach.client")


@dataclass(frozen=True, slots=True)
class TopicMessage:
    """One broadcast notification."""

    topic: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
    #: read from the topics stream (a ``since`` subscription): its sequence there and when
    #: it was stored; 0 and None for a live broadcast
    seq: int = 0
    time: datetime.datetime | None = None

    def json(self, type_: Any = Any) -> Any:
        """Decode the body (as ``type_`` when given); raises msgspec.DecodeError if invalid."""
        return decoder_for(type_)(self.data)


async def publish(
    nc: NatsConnection,
    subjects: Subjects,
    caller: str,
    url: str,
    topic: str,
    payload: Any,
    durable: DurableTopics | None = None,
) -> int:
    """Broadcast; with ``durable``, store it and return its sequence in the topics stream
    (0 for a plain broadcast)."""
    validate_topic(topic)
    headers = {Header.CALLER: caller} if caller else None
    subject = subjects.topic(topic)
    permissions = permissions_of(nc)
    if permissions is not None and permissions.publish_refused(subject):
        # refused before: say so now (the first refusal only shows at the next flush)
        raise permissions.error(Violation("publish", subject.lower()))
    data = encode_payload(payload)
    if durable is not None:
        if len(data) > nc.max_payload:
            raise too_large(nc, len(data), f"topic {topic!r}")
        return await durable.publish(nc, topic, data, headers)
    with translate(url):
        try:
            await nc.publish(subject, data, headers=headers)
        except TOO_LARGE:
            raise too_large(nc, len(data), f"topic {topic!r}") from None
    return 0


def _check_since(since: Since) -> None:
    if isinstance(since, bool) or not isinstance(
        since, (int, datetime.datetime, datetime.timedelta)
    ):
        raise ConfigurationError(
            f"since={since!r}: give a datetime, a timedelta (how long ago) or a stream"
            " sequence (int >= 1)"
        )
    if isinstance(since, int) and since < 1:
        raise ConfigurationError(f"since={since}: a stream sequence starts at 1")
    if isinstance(since, datetime.timedelta) and since < datetime.timedelta(0):
        raise ConfigurationError(f"since={since}: a time before now is a positive timedelta")


async def subscribe(
    nc: NatsConnection,
    subjects: Subjects,
    url: str,
    topic: str,
    since: Since | None = None,
    durable: DurableTopics | None = None,
    on_unsubscribe: Callable[[TopicSubscription], None] | None = None,
) -> TopicSubscription:
    """Subscribe and flush; Unauthorized when the server refused the subscription. With
    ``since`` (and ``durable``), the stored history from there, then live messages.
    ``on_unsubscribe`` is called with the subscription when it is unsubscribed (once)."""
    validate_topic(topic, wildcards=True)
    if since is not None and durable is not None:
        _check_since(since)
        if isinstance(since, datetime.timedelta):
            since = start_time(since)  # once: the server and the guard below start alike
        with translate(url):
            jsub = await durable.history(nc, topic, since)
        return TopicSubscription(subjects, jsub, since=since, on_unsubscribe=on_unsubscribe)
    subject = subjects.topic(topic)
    permissions = permissions_of(nc)
    mark = permissions.count if permissions is not None else 0
    with translate(url):
        sub = await nc.subscribe(subject)
        await flush_nats(nc)
    if permissions is not None:
        refused = Violation("subscribe", subject.lower())
        if refused in permissions.since(mark):
            await TopicSubscription(subjects, sub).unsubscribe()
            raise permissions.error(refused)
    return TopicSubscription(subjects, sub, on_unsubscribe=on_unsubscribe)


class TopicSubscription:
    """An async iterator of :class:`TopicMessage`; ``async with`` unsubscribes on exit."""

    def __init__(
        self,
        subjects: Subjects,
        sub: Subscription,
        since: Since | None = None,
        on_unsubscribe: Callable[[TopicSubscription], None] | None = None,
    ) -> None:
        self._subjects = subjects
        self._sub = sub
        self._on_unsubscribe = on_unsubscribe
        self._messages: AsyncIterator[Msg] = sub.messages
        #: a ``since`` subscription: the first sequence or time it shows, and the last
        #: sequence shown (nats-py's ordered consumer, rebuilt after a lost connection,
        #: starts again from the last sequence it *received*, or from 1 if none)
        self._history = since is not None
        self._min_seq = since if isinstance(since, int) else 0
        self._min_time = None if since is None or isinstance(since, int) else start_time(since)
        self._last_seq = 0

    def __aiter__(self) -> Self:
        return self

    def _wrap(self, msg: Msg) -> TopicMessage | None:
        """The message as shown, or None for one a ``since`` subscription skips (before
        its start, or shown already)."""
        topic = self._subjects.topic_of(msg.subject)
        if not self._history:
            return TopicMessage(topic, msg.data, msg.headers or {})
        md = msg.metadata
        seq = md.sequence.stream
        if seq <= self._last_seq or seq < self._min_seq:
            return None
        if self._min_time is not None and md.timestamp < self._min_time:
            return None
        self._last_seq = seq
        return TopicMessage(topic, msg.data, msg.headers or {}, seq, md.timestamp)

    async def __anext__(self) -> TopicMessage:
        while True:
            shown = self._wrap(await self._messages.__anext__())
            if shown is not None:
                return shown

    async def next(self, timeout: float | None = None) -> TopicMessage:
        """The next message, or RequestTimeout after ``timeout`` seconds (one deadline
        for the call, however many messages a ``since`` subscription skips meanwhile);
        without ``timeout``, waits until one comes."""
        try:
            async with asyncio.timeout(timeout):  # one deadline, however many are skipped
                while True:
                    shown = self._wrap(await self._sub.next_msg(timeout=None))
                    if shown is not None:
                        return shown
        except TimeoutError:
            raise RequestTimeout(f"no message within {timeout}s") from None

    async def unsubscribe(self) -> None:
        """Stop the subscription (unread messages are dropped); again is harmless."""
        done, self._on_unsubscribe = self._on_unsubscribe, None
        if done is not None:
            done(self)
        try:
            await self._sub.unsubscribe()
        except TRANSIENT as exc:
            log.debug("unsubscribe: %s", exc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.unsubscribe()
