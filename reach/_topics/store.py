"""Where durable topics live: stream ``<PREFIX>_TOPICS`` and one durable consumer per agent
name and topic pattern.

The stream captures **every** topic subject (``reach.topic.>``), plain publishes included:
a durable subscriber then gets every message however it was published (a sensor that
publishes the plain way needs no change), ``since`` replays work on any topic, and a plain
subscriber still sees durable publishes (one subject space; ``durable`` is a property of a
publish, waiting for the server's acknowledgement, and of a subscription, not of a topic).
The price: once the stream exists the server writes every topic message to disk, bounded
by age and bytes (``topic_retention``, ``topic_max_bytes``). An operator who wants only
some topics kept creates the stream at deploy time with narrower subjects (an existing
stream is left as it is).

The stream also captures ``reach.topicredo.<consumer>.<topic>``: a dead letter replayed to
the one consumer that gave up on it, so the other agent names, which handled it, do not get
it twice.

A consumer is named after its agent name and pattern (readable, plus a hash of both, so two
patterns never share one). It starts at the messages published after its creation
(``DeliverPolicy.NEW``) and then misses nothing while it exists; JetStream removes it
after ``topic_retention`` without a pull (by then every message it could have read has
aged out of the stream). ``max_deliver`` is unlimited on the server: the agents count
deliveries themselves (each message's ``num_delivered``) and dead-letter a message on its
delivery past ``topic_max_deliver``, so a message whose instances all died holding it is
dead-lettered by the next instance, instead of being given up on silently by the server
(which, on a limits stream, leaves it unacknowledged with only an advisory to say so).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from .._jsapi import JsApi, js_publish
from .._kv import JsErrorCode
from .._nats import TRANSIENT
from .._subjects import Subjects
from .._tasks.store import add_dlq_stream, add_stream
from ..errors import NotStored
from ..settings import ReachSettings

__all__ = ["TopicStore", "covers", "stream_name", "topic_consumer_name"]

_READABLE = str.maketrans({".": "_", "*": "any", ">": "all"})


def stream_name(subjects: Subjects) -> str:
    return subjects.stream("TOPICS")


def covers(wide: str, narrow: str) -> bool:
    """Whether every subject ``narrow`` matches is matched by ``wide`` (both may hold
    ``*`` and ``>``)."""
    w, n = wide.split("."), narrow.split(".")
    for i, token in enumerate(w):
        if token == ">":
            return len(n) > i
        if i >= len(n) or n[i] == ">" or (token != "*" and token != n[i]):
            return False
    return len(w) == len(n)


def topic_consumer_name(group: str, pattern: str) -> str:
    """The durable consumer shared by every instance of agent ``group`` subscribed to
    ``pattern``: readable, and one-to-one by a hash of both."""
    digest = hashlib.blake2b(f"{group}\n{pattern}".encode(), digest_size=6).hexdigest()
    return f"{group[:64]}-{pattern.translate(_READABLE)[:48]}-{digest}"


class TopicStore:
    """Names and setup of durable topics for one subject prefix; cheap, per connection."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        settings: ReachSettings,
        api: JsApi | None = None,
    ) -> None:
        self.js = js
        self.subjects = subjects
        self.settings = settings
        #: the fast path for publishes (nats-py's js.publish otherwise)
        self.api = api
        self.stream = stream_name(subjects)
        self.dlq_stream = subjects.stream("DLQ")
        self.ready = False
        #: the stream's subjects as it is (made here, or by hand), once ``ensure`` ran
        self.stored: list[str] = []

    def keeps(self, pattern: str) -> bool:
        """Whether the stream stores every topic ``pattern`` matches."""
        subject = self.subjects.topic(pattern)
        return any(covers(s, subject) for s in self.stored)

    async def ensure(self) -> None:
        """Create the topics stream and the DLQ stream when missing (idempotent).
        ``NotStored`` (``overlap``) when another stream already captures their subjects."""
        if self.ready:
            return
        s, p = self.settings, self.subjects.prefix
        topics = [f"{p}.topic.>", f"{p}.topicredo.>"]
        await self._made(
            self.stream,
            topics,
            add_stream(
                self.js,
                StreamConfig(
                    name=self.stream,
                    subjects=topics,
                    retention=RetentionPolicy.LIMITS,
                    storage=StorageType.FILE,
                    discard=DiscardPolicy.OLD,
                    max_age=s.topic_retention,
                    max_bytes=s.topic_max_bytes,
                    num_replicas=s.stream_replicas,
                    allow_direct=True,
                    description="Agent-Reach topics, kept for durable subscribers and replay",
                ),
            ),
        )
        await self._made(self.dlq_stream, [f"{p}.dlq.>"], add_dlq_stream(self.js, self.subjects, s))
        info = await self.js.stream_info(self.stream)
        self.stored = list(info.config.subjects or [])
        self.ready = True

    async def _made(self, name: str, subjects: list[str], make: Awaitable[object]) -> None:
        """Await ``make`` (stream ``name`` made when missing), translating the one refusal
        a deployment causes: a stream of the account that captures ``subjects`` already
        (a subject belongs to one stream per account: an audit stream on ``reach.>``)."""
        try:
            await make
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != JsErrorCode.STREAM_SUBJECT_OVERLAP:
                raise
            other = await self._capturing(subjects)
            raise NotStored(
                f"stream {name} cannot be made: {other or 'another stream'} already"
                f" captures {' or '.join(subjects)} (a subject belongs to one stream per"
                f" account); take those subjects out of {other or 'it'} (it can source"
                f" {name} instead), or give Reach another REACH_SUBJECT_PREFIX",
                reason="overlap",
            ) from exc

    async def _capturing(self, subjects: list[str]) -> str:
        """``stream X``, X a stream that captures one of ``subjects``; "" when the
        server does not say (a user not allowed to list streams)."""
        for subject in subjects:
            try:
                return f"stream {await self.js.find_stream_name_by_subject(subject)}"
            except TRANSIENT:  # NotFoundError: none for this one; or not allowed to ask
                continue
        return ""

    async def ensure_consumer(self, group: str, pattern: str, *, ordered: bool) -> str:
        """Create (or update) the consumer of agent ``group`` on ``pattern``; its name.
        ``ordered``: one message in flight for the whole consumer (``max_ack_pending``
        1), so each subject's messages are handled one after the other, in order."""
        name = topic_consumer_name(group, pattern)
        s = self.settings
        config = ConsumerConfig(
            name=name,
            durable_name=name,
            description=f"Agent-Reach durable topic {pattern} of agent {group}",
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=s.topic_ack_wait,
            max_deliver=-1,
            max_ack_pending=1 if ordered else -1,
            filter_subjects=[self.subjects.topic(pattern), self.subjects.topic_redo(name, ">")],
            inactive_threshold=s.topic_retention,
            num_replicas=s.stream_replicas,
        )
        await self.js.add_consumer(self.stream, config)
        return name

    async def lag(self, consumer: str) -> tuple[int, int]:
        """(messages not yet delivered, delivered and not yet acknowledged) of ``consumer``."""
        info = await self.js.consumer_info(self.stream, consumer)
        return int(info.num_pending or 0), int(info.num_ack_pending or 0)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
        """A JetStream publish, on the fast path when there is one; the stream sequence."""
        return await js_publish(self.js, self.api, subject, data, headers)
