"""Intake: a request's first moments, in nats-py's reading task (``subscribe_direct``).
Validate the headers cheaply, then queue it or refuse it at once (full, stopping, paused,
degraded)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from .._background import Background
from .._codec import now_ms
from .._subjects import Subjects
from ..wire import Header, Priority
from .lifecycle import Lifecycle
from .model import AgentStats, Job, Served, TopicSpec
from .streaming import MAX_PATIENCE, MAX_WINDOW, MIN_PATIENCE
from .workers import Workers

__all__ = ["Intake"]

log = logging.getLogger("reach.agent")

_REFUSALS_GRACE = 0.5  # seconds for refusals still being sent when the agent stops
#: bytes of refusals waiting to be sent, at most: one read of the socket can bring thousands
#: of requests, all refused before the sender runs. Counted as each refusal's reply subject
#: and message plus ``_ENTRY_BYTES``, so the bound holds in memory whatever the subjects'
#: length (by count, nats-py's 524,288 pending messages, it was ~139 MB with short ones and
#: up to ~2 GB with the 4 KB a subject may have): ~15,000 refusals with short subjects.
_OUTBOX_BYTES = 4 * 1024 * 1024
#: what an entry costs beyond its strings' characters: the tuple, two string headers, the
#: deque's slot (measured: ~156 bytes with a shared message)
_ENTRY_BYTES = 200
_PRIORITIES = {p.value: p for p in Priority}
_HIGH = Priority.HIGH
_NORMAL = Priority.NORMAL


class Intake:
    """Admission control in front of the workers' queue."""

    def __init__(self, agent_id: str, workers: Workers, life: Lifecycle, stats: AgentStats) -> None:
        self.agent_id = agent_id
        self.workers = workers
        self.stats = stats
        self.life = life
        #: False once the agent stops for good: what still arrives is refused
        self.accepting = False
        #: owns the task that sends refusals, until the subscriptions are gone (``close``)
        self.refusals = Background(f"agent {agent_id} refusals")
        #: (reply subject, code, message): not the request, whose payload may be large
        self._outbox: deque[tuple[str, str, str]] = deque()
        #: what the outbox holds, in bytes (``_cost``), and the most it may
        self._outbox_bytes = 0
        self._outbox_budget = _OUTBOX_BYTES
        self._sender: asyncio.Task[None] | None = None

    def handler_for(self, cap: Served) -> Callable[[Msg], None]:
        """What ``cap``'s subscriptions deliver to, in nats-py's reading task
        (``subscribe_direct``): check, then queue or refuse; nothing here waits."""

        def on_request(msg: Msg) -> None:
            try:
                refusal = self._accept(msg, cap)
            except Exception:
                # A bug of ours must cost one request, never the subscription.
                self.stats.internal_errors += 1
                log.exception("agent %s: could not accept a request", self.agent_id)
                refusal = ("failed", "agent could not accept request")
            if refusal is not None:
                self._refuse(msg, *refusal)

        return on_request

    def _refuse(self, msg: Msg, code: str, message: str) -> None:
        """Queue the refusal for the one task that sends them (a send may wait). The queue
        is bounded in bytes: past it, under a flood, a refusal is counted
        (``unsent_refusals``) and its caller left to its timeout, rather than memory and
        tasks growing with the flood."""
        cost = _cost(msg.reply, message)
        if self.refusals.closed or self._outbox_bytes + cost > self._outbox_budget:
            self.stats.unsent_refusals += 1  # (closed: stopped with the connection down)
            return
        self._outbox.append((msg.reply, code, message))
        self._outbox_bytes += cost
        if self._sender is None or self._sender.done():
            self._sender = self.refusals.spawn(self._send_refusals(), "refusals")

    async def _send_refusals(self) -> None:
        outbox, send_error = self._outbox, self.workers.send_error
        while outbox:
            reply, code, message = outbox.popleft()
            self._outbox_bytes -= _cost(reply, message)
            await send_error(reply, code, message)

    async def close(self) -> None:
        """Once nothing is delivered any more: let the refusals on their way go out."""
        await self.refusals.finish(_REFUSALS_GRACE)  # (a sender that runs on is logged)
        left = len(self._outbox)  # (one cut mid-send is not counted)
        if left:
            self.stats.unsent_refusals += left
            log.warning("agent %s: %d refusal(s) not sent at stop", self.agent_id, left)
        self._outbox.clear()
        self._outbox_bytes = 0

    def _accept(self, msg: Msg, cap: Served) -> tuple[str, str] | None:
        """Queue the request; else the (code, message) to refuse it with, or None when it
        gets no answer (no reply subject, or its caller's deadline passed)."""
        if not msg.reply:
            self.stats.invalid += 1
            self._refused("no_reply_subject")
            return None
        priority = _NORMAL
        deadline: int | None = None
        request_id = ""
        hdrs = msg.headers
        if hdrs:
            request_id = hdrs.get(Header.REQUEST_ID, "")
            raw_prio = hdrs.get(Header.PRIORITY)
            if raw_prio is not None:
                found = _PRIORITIES.get(raw_prio.strip().lower())
                if found is None:
                    return self._bad_header(
                        f"{Header.PRIORITY} {raw_prio!r}: use high, normal or low"
                    )
                priority = found
            raw_deadline = hdrs.get(Header.DEADLINE)
            if raw_deadline is not None:
                try:
                    deadline = int(raw_deadline)
                except ValueError:
                    return self._bad_header(f"{Header.DEADLINE} {raw_deadline!r}: use unix ms")
                if deadline <= now_ms():
                    self.stats.expired += 1
                    return None
        # A request to a capability that does not stream reads no stream header.
        stream: tuple[int, float] | None = None
        if cap.spec.streams:
            asked = _stream_asked(hdrs, cap.info.name)
            if isinstance(asked, str):
                return self._bad_header(asked)
            stream = asked
        if not request_id:
            # Without Reach-Request-Id the reply subject names the request (PROTOCOL.md).
            request_id = msg.reply.removeprefix("_INBOX.")
        if not self.accepting:
            self._refused("stopping")
            return "agent_unavailable", "agent is stopping"
        life = self.life
        if priority is _HIGH and life.refuse_high:
            self.stats.rejected += 1
            self._refused("degraded")
            return (
                "resource_exhausted",
                f"agent {self.agent_id} is DEGRADED: high priority goes to an UP instance",
            )
        if life.refuse_direct and msg.subject == cap.direct:
            # Out of the queue groups already; direct callers must go elsewhere too.
            self._refused("paused")
            return "agent_unavailable", f"agent {self.agent_id} is {life.state.lower()}"
        workers = self.workers
        job = Job(msg, cap, priority, deadline, request_id)  # (keywords cost ~150 ns)
        if stream is not None:
            job.window, job.patience = stream
        if not workers.admit(job):
            self.stats.rejected += 1
            self._refused("full")
            return (
                "resource_exhausted",
                f"agent {self.agent_id} is full ({workers.max_queue} queued)",
            )
        return None

    def _refused(self, reason: str) -> None:
        refusals = self.stats.refusals
        refusals[reason] = refusals.get(reason, 0) + 1

    def _bad_header(self, reason: str) -> tuple[str, str]:
        self.stats.invalid += 1
        self._refused("bad_header")
        return "bad_request", reason


def _stream_asked(hdrs: dict[str, str] | None, name: str) -> tuple[int, float] | str:
    """A streaming capability's request: its first window and patience (0: the agent's
    default), from its headers; else why it is ``bad_request``."""
    raw_window = hdrs.get(Header.STREAM_WINDOW) if hdrs else None
    if not hdrs or raw_window is None:
        return (
            f"{name!r} streams its answer: call it with client.stream(...),"
            " 'reach call --stream', or the gateway's POST /v1/capabilities/"
            f"{name}/stream (on the wire: a {Header.STREAM_WINDOW} header)"
        )
    window = _window(raw_window)
    if not window:
        return f"{Header.STREAM_WINDOW} {raw_window!r}: use 1..{MAX_WINDOW} chunks"
    raw_patience = hdrs.get(Header.STREAM_PATIENCE)
    patience = 0.0
    if raw_patience is not None:
        patience = _patience(raw_patience)
        if not patience:
            return (
                f"{Header.STREAM_PATIENCE} {raw_patience!r}: use"
                f" {MIN_PATIENCE * 1000:.0f}..{MAX_PATIENCE * 1000:.0f} ms"
            )
    return window, patience


def _window(raw: str) -> int:
    """A stream's first window, 0 when it is not one of 1..MAX_WINDOW."""
    try:
        window = int(raw)
    except ValueError:
        return 0
    return window if 1 <= window <= MAX_WINDOW else 0


def _patience(raw: str) -> float:
    """A stream's patience in seconds (the header says ms), 0 when it is out of bounds."""
    try:
        seconds = int(raw) / 1000
    except ValueError:
        return 0.0
    return seconds if MIN_PATIENCE <= seconds <= MAX_PATIENCE else 0.0


def _cost(reply: str, message: str) -> int:
    """Bytes a queued refusal holds (its code is one of a few shared strings)."""
    return len(reply) + len(message) + _ENTRY_BYTES


def topic_handler(
    agent_id: str,
    subjects: Subjects,
    topic: TopicSpec,
    stats: AgentStats,
    on_exit: Callable[[BaseException], bool],
) -> Callable[[Msg], Awaitable[None]]:
    """A broadcast listener: bad messages and failing handlers are logged, never fatal."""

    async def on_message(msg: Msg) -> None:
        try:
            payload = topic.spec.decode(msg.data)
        except msgspec.DecodeError as exc:
            stats.invalid += 1
            log.warning(
                "agent %s: invalid message on topic %s: %s",
                agent_id,
                subjects.topic_of(msg.subject),
                exc,
            )
            return
        try:
            if topic.spec.wants_context:
                await topic.spec.fn(payload, subjects.topic_of(msg.subject))
            else:
                await topic.spec.fn(payload)
        except (KeyboardInterrupt, SystemExit) as stop:
            if not on_exit(stop):
                raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the subscription is being closed
            # Its own CancelledError would end nats-py's delivery loop: the topic stays.
            stats.topic_errors += 1
            log.exception(
                "agent %s: topic handler for %s cancelled itself", agent_id, topic.pattern
            )
        except BaseException:
            stats.topic_errors += 1
            log.exception("agent %s: topic handler for %s failed", agent_id, topic.pattern)

    return on_message
