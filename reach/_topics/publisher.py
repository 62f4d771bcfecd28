"""A client's durable-topic side: publishes that return once the server has stored them,
history (``since``) subscriptions, and the replay of a topic's dead letter.

The stream is made on first durable use, as the task streams are (waiting out a JetStream
that cannot answer yet for up to ``task_patience``). Everything nats-py raises on this
side leaves as a ``NotStored`` saying what went wrong and what to do, from one place
(``_stored``).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from contextlib import contextmanager

import nats.errors
import nats.js.errors
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy

from .._nats import CONNECTION_LOST, TRANSIENT, NatsConnection
from .._subjects import Subjects
from .._tasks.admin import DeadLetter
from .._tasks.dlq import DLQ_CONSUMER, DLQ_SEQ, TASK_ID
from .._tasks.faults import patiently
from .._tasks.opening import PerConnection, open_store
from ..errors import ConnectionFailed, NotStored, ReachError
from ..settings import ReachSettings
from .store import TopicStore, covers, stream_name

__all__ = ["REPLAY_OF", "DurableTopics", "Since"]

#: the header of a replayed dead letter: the sequence of the original in the topics stream
REPLAY_OF = "Reach-Replay-Of"
#: where a ``since`` subscription starts: a time, a time before now, or a stream sequence
Since = datetime.datetime | datetime.timedelta | int
_HEARTBEAT = 5.0  # seconds: a history subscription whose consumer is lost is rebuilt in 2x


class DurableTopics:
    """Opened lazily on the client's connection; ``close`` when the client closes."""

    def __init__(self, settings: ReachSettings, subjects: Subjects) -> None:
        self.settings = settings
        self.subjects = subjects
        self.stream = stream_name(subjects)
        self._what = f"durable topics (stream {self.stream})"
        self._stores = PerConnection(self._open)

    async def ready(self, nc: NatsConnection) -> TopicStore:
        """The store on ``nc``, the stream made when missing; once per connection."""
        return await self._stores.get(nc)

    async def _open(self, nc: NatsConnection) -> TopicStore:
        return await open_store(
            nc,
            self._what,
            lambda api: TopicStore(nc.jetstream(), self.subjects, self.settings, api),
            until=time.monotonic() + self.settings.task_patience,
            stopped=lambda: self._stores.closed,
            timeout=self.settings.timeout_ms / 1000,
        )

    async def publish(
        self, nc: NatsConnection, topic: str, data: bytes, headers: dict[str, str] | None
    ) -> int:
        """Store one message on ``topic``; its sequence in the topics stream. A stream
        removed since it was made is made again, once."""
        subject = self.subjects.topic(topic)
        with self._stored(topic):
            store = await self.ready(nc)
            try:
                return await store.publish(subject, data, headers)
            except nats.errors.NoRespondersError:
                store.ready = False  # deleted meanwhile, or JetStream restarting
                await self._ensure(nc, store)
                return await store.publish(subject, data, headers)

    async def _ensure(self, nc: NatsConnection, store: TopicStore) -> None:
        """The streams made when missing, waiting up to ``task_patience`` for JetStream."""
        await patiently(
            nc,
            self._what,
            store.ensure,
            until=time.monotonic() + self.settings.task_patience,
            stopped=lambda: self._stores.closed,
        )

    @contextmanager
    def _stored(self, topic: str) -> Iterator[None]:
        """The one boundary: what failed, as a ``NotStored`` with its fix."""
        what = f"durable publish to topic {topic!r}"
        try:
            yield
        except NotStored:
            raise
        except ConnectionFailed as exc:  # patiently: JetStream never answered
            raise NotStored(
                f"{what}: JetStream did not answer ({exc.message}); is the server running"
                " with JetStream on (nats-server -js, or 'jetstream {}' in its config)?",
                topic=topic,
                reason="jetstream_unavailable",
            ) from exc
        except ReachError:
            raise  # Unauthorized: the refusal says which subject
        except nats.errors.NoRespondersError as exc:
            raise NotStored(
                f"{what}: no stream stores {self.subjects.topic(topic)} (stream {self.stream}"
                " was made without it?); add the subject to the stream, or delete the"
                " stream so Reach makes it again",
                topic=topic,
                reason="no_stream",
            ) from exc
        except nats.js.errors.APIError as exc:
            raise NotStored(
                f"{what}: stream {self.stream} refused it ({exc.description or exc});"
                " see its limits (topic_max_bytes, max_payload)",
                topic=topic,
                reason="refused",
            ) from exc
        except CONNECTION_LOST as exc:
            raise NotStored(
                f"{what}: not connected to NATS ({type(exc).__name__}); publish again once"
                " the connection is back",
                topic=topic,
                reason="disconnected",
            ) from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise NotStored(
                f"{what}: no acknowledgement within {self.settings.timeout_ms} ms; it may"
                " or may not be stored (publishing again may store it twice)",
                topic=topic,
                reason="timeout",
            ) from exc
        except TRANSIENT as exc:
            raise NotStored(
                f"{what}: {type(exc).__name__}: {exc}", topic=topic, reason="disconnected"
            ) from exc

    async def history(self, nc: NatsConnection, pattern: str, since: Since) -> Subscription:
        """An ordered consumer on ``pattern`` from ``since``: the stored messages first,
        then live ones as they are stored, one stream in sequence order (no gap or
        duplicate where history meets live: both come from the stream). ``NotStored``
        (``no_stream``) when nothing keeps topics yet, or when the stream (made by hand,
        narrower) does not keep every topic ``pattern`` matches: such a subscription
        would wait for ever, deaf, as an agent's durable subscription would (which
        refuses to start for it)."""
        config = ConsumerConfig(idle_heartbeat=_HEARTBEAT)
        if isinstance(since, int):
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = since
        else:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = start_time(since)
        subject = self.subjects.topic(pattern)
        js = nc.jetstream()
        try:
            info = await js.stream_info(self.stream)
            stored = list(info.config.subjects or [])
            if not any(covers(s, subject) for s in stored):
                raise NotStored(
                    f"no history of topic {pattern!r}: stream {self.stream} does not keep"
                    f" topic {pattern!r} (its subjects: {', '.join(stored)}); add {subject}"
                    " to it, or subscribe without since",
                    topic=pattern,
                    reason="no_stream",
                )
            return await js.subscribe(
                subject, stream=self.stream, config=config, ordered_consumer=True
            )
        except nats.js.errors.NotFoundError:
            raise NotStored(
                f"no history of topic {pattern!r}: stream {self.stream} does not exist (it"
                " is made by the first durable publish or durable subscription, or by"
                " 'reach topics init')",
                topic=pattern,
                reason="no_stream",
            ) from None
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            raise NotStored(
                f"no history of topic {pattern!r}: JetStream did not answer; is the server"
                " running with JetStream on (nats-server -js, or 'jetstream {}' in its"
                " config)?",
                topic=pattern,
                reason="jetstream_unavailable",
            ) from None

    async def replay(self, nc: NatsConnection, dl: DeadLetter) -> int:
        """Store dead letter ``dl`` (a durable topic's) again, for the one consumer that
        gave up on it (every subscriber of the topic if it names none), then remove it
        from the DLQ; the new message's sequence. A second replay of the same letter
        within the stream's duplicate window stores nothing new."""
        store = await self.ready(nc)
        consumer = dl.headers.get(DLQ_CONSUMER, "")
        subject = (
            self.subjects.topic_redo(consumer, dl.topic)
            if consumer
            else self.subjects.topic(dl.topic)
        )
        headers = {
            k: v
            for k, v in dl.headers.items()
            if not k.startswith(("Reach-Dlq-", "Nats-")) and k != TASK_ID
        }
        headers["Nats-Msg-Id"] = f"redo.{store.dlq_stream}.{dl.seq}"
        headers[REPLAY_OF] = dl.headers.get(DLQ_SEQ, "")
        seq = await store.publish(subject, dl.data, headers)
        with contextlib.suppress(nats.js.errors.NotFoundError):  # a concurrent replay did
            await store.js.delete_msg(store.dlq_stream, dl.seq)
        return seq

    async def close(self) -> None:
        await self._stores.close()


def start_time(since: datetime.datetime | datetime.timedelta) -> datetime.datetime:
    """The UTC time a ``since`` names (a naive datetime is taken as UTC)."""
    now = datetime.datetime.now(datetime.UTC)
    if isinstance(since, datetime.timedelta):
        return now - since
    if since.tzinfo is None:
        return since.replace(tzinfo=datetime.UTC)
    return since.astimezone(datetime.UTC)
