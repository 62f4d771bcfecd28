"""Intake: a request's first moments, in its subscription's task. Validate the headers
cheaply, then queue it or refuse it at once (full, stopping, paused, degraded)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from .._codec import now_ms
from .._subjects import Subjects
from ..wire import Header, Priority
from .lifecycle import Lifecycle, Reason
from .model import AgentStats, Job, Served, TopicSpec
from .workers import Workers

__all__ = ["Intake"]

log = logging.getLogger("reach.agent")

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

    def handler_for(self, cap: Served) -> Callable[[Msg], Awaitable[None]]:
        async def on_request(msg: Msg) -> None:
            try:
                await self._accept(msg, cap)
            except Exception:
                # A bug of ours must cost one request, never the subscription.
                self.stats.internal_errors += 1
                log.exception("agent %s: could not accept a request", self.agent_id)
                try:
                    await self.workers.reply_error(msg, "failed", "agent could not accept request")
                except Exception:
                    log.exception("agent %s: could not refuse a request", self.agent_id)

        return on_request

    async def _accept(self, msg: Msg, cap: Served) -> None:
        if not msg.reply:
            self.stats.invalid += 1
            self._refused("no_reply_subject")
            return
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
                    await self._bad_header(
                        msg, f"{Header.PRIORITY} {raw_prio!r}: use high, normal or low"
                    )
                    return
                priority = found
            raw_deadline = hdrs.get(Header.DEADLINE)
            if raw_deadline is not None:
                try:
                    deadline = int(raw_deadline)
                except ValueError:
                    await self._bad_header(msg, f"{Header.DEADLINE} {raw_deadline!r}: use unix ms")
                    return
                if deadline <= now_ms():
                    self.stats.expired += 1
                    return
        if not request_id:
            # Without Reach-Request-Id the reply subject names the request (PROTOCOL.md).
            request_id = msg.reply.removeprefix("_INBOX.")
        if not self.accepting:
            self._refused("stopping")
            await self.workers.reply_error(msg, "agent_unavailable", "agent is stopping")
            return
        life = self.life
        if priority is _HIGH and life.refuse_high:
            self.stats.rejected += 1
            self._refused("degraded")
            await self.workers.reply_error(
                msg,
                "resource_exhausted",
                f"agent {self.agent_id} is DEGRADED: high priority goes to an UP instance",
            )
            return
        if life.refuse_direct and msg.subject == cap.direct:
            # Out of the queue groups already; direct callers must go elsewhere too.
            self._refused("paused")
            await self.workers.reply_error(
                msg, "agent_unavailable", f"agent {self.agent_id} is {life.state.lower()}"
            )
            return
        workers = self.workers
        queue = workers.queue
        if not queue.offer(priority, Job(msg, cap, priority, deadline, request_id)):
            self.stats.rejected += 1
            self._refused("full")
            await workers.reply_error(
                msg,
                "resource_exhausted",
                f"agent {self.agent_id} is full ({workers.max_queue} queued)",
            )
            return
        workers.outstanding += 1
        workers.idle.clear()
        if len(queue) >= workers.overload_at and not workers.overloaded:
            workers.overloaded = True
            life.degrade(Reason.OVERLOAD)

    def _refused(self, reason: str) -> None:
        refusals = self.stats.refusals
        refusals[reason] = refusals.get(reason, 0) + 1

    async def _bad_header(self, msg: Msg, reason: str) -> None:
        self.stats.invalid += 1
        self._refused("bad_header")
        await self.workers.reply_error(msg, "bad_request", reason)


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
