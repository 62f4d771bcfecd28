"""Broadcast: publish to a topic, and subscriptions that yield ``TopicMessage``s."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
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
from ..errors import RequestTimeout
from ..wire import Header

__all__ = ["TopicMessage", "TopicSubscription", "publish", "subscribe"]

log = logging.getLogger("reach.client")


@dataclass(frozen=True, slots=True)
class TopicMessage:
    """One broadcast notification."""

    topic: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self, type_: Any = Any) -> Any:
        """Decode the body (as ``type_`` when given); raises msgspec.DecodeError if invalid."""
        return decoder_for(type_)(self.data)


async def publish(
    nc: NatsConnection, subjects: Subjects, caller: str, url: str, topic: str, payload: Any
) -> None:
    validate_topic(topic)
    headers = {Header.CALLER: caller} if caller else None
    subject = subjects.topic(topic)
    permissions = permissions_of(nc)
    if permissions is not None and permissions.publish_refused(subject):
        # refused before: say so now (the first refusal only shows at the next flush)
        raise permissions.error(Violation("publish", subject.lower()))
    data = encode_payload(payload)
    with translate(url):
        try:
            await nc.publish(subject, data, headers=headers)
        except TOO_LARGE:
            raise too_large(nc, len(data), f"topic {topic!r}") from None


async def subscribe(
    nc: NatsConnection, subjects: Subjects, url: str, topic: str
) -> TopicSubscription:
    """Subscribe and flush; Unauthorized when the server refused the subscription."""
    validate_topic(topic, wildcards=True)
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
    return TopicSubscription(subjects, sub)


class TopicSubscription:
    """An async iterator of :class:`TopicMessage`; ``async with`` unsubscribes on exit."""

    def __init__(self, subjects: Subjects, sub: Subscription) -> None:
        self._subjects = subjects
        self._sub = sub
        self._messages: AsyncIterator[Msg] = sub.messages

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> TopicMessage:
        msg = await self._messages.__anext__()
        return TopicMessage(self._subjects.topic_of(msg.subject), msg.data, msg.headers or {})

    async def next(self, timeout: float | None = None) -> TopicMessage:
        """The next message, or RequestTimeout after ``timeout`` seconds."""
        try:
            msg = await self._sub.next_msg(timeout=timeout if timeout is not None else 0)
        except TimeoutError:  # nats-py's TimeoutError is one
            raise RequestTimeout(f"no message within {timeout}s") from None
        return TopicMessage(self._subjects.topic_of(msg.subject), msg.data, msg.headers or {})

    async def unsubscribe(self) -> None:
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
