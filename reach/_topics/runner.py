"""An agent's durable topic subscriptions: each agent *name* is a consumer group.

One durable pull consumer per agent name and pattern, shared by the name's instances
(``store.topic_consumer_name``): each message goes to one instance of each name. An instance
has ``topic_concurrency`` workers per subscription (one for an ``ordered`` one) and pulls,
with the task runner's ``Puller``, as many messages as it has free workers plus as many
again held ready (so the next pull request is under way while they work: measured, ~1.4x
messages/s at 64 in flight with the default 8 workers), keeps each one's ack timer alive
(``in_progress`` every ``topic_ack_wait/3``) until it is settled, and settles it when
the handler returns:

- returned: ack;
- raised (or ran over ``topic_timeout``): nak with the task retry backoff
  (``states.retry_delay`` over ``topic_retry_base``/``topic_retry_cap``), or on its
  ``topic_max_deliver``-th delivery a dead letter (kind ``topic``, the handler's error
  code as its reason), then term. The handler runs as a task of its own
  (``_tasks.bounded``, as a task handler does): one that ignores its cancellation at
  ``topic_timeout`` is abandoned a second later, its message settled all the same (not
  held in progress for ever, which would stop an ordered name), and it keeps its worker
  until it returns, counted as stuck (the agent is DEGRADED meanwhile);
- a payload that does not decode: a dead letter at once (reason ``bad_request``);
- a delivery past ``topic_max_deliver`` (its earlier instances died or stalled holding it):
  a dead letter (reason ``max_deliveries``) without running it.

Dead letters go through ``_tasks.dlq.dead_letter`` to the same stream as the tasks', so
``reach dlq`` lists, shows and replays them. A pause stops pulling and puts back what is
held, not started; a drain does that, lets running handlers finish within its timeout, and
puts back the rest for another instance at once. Consumer lag (messages not yet delivered)
is sampled every ``topic_lag_interval`` for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.msg import Msg

from .._background import Background
from .._codec import now_ms
from .._jsapi import JsApi
from .._nats import TRANSIENT, NatsConnection
from .._subjects import Subjects
from .._tasks.bounded import BoundedRun
from .._tasks.dlq import DLQ_CONSUMER, DLQ_GROUP, DLQ_SEQ, dead_letter
from .._tasks.faults import patiently
from .._tasks.model import TaskHandler
from .._tasks.opening import open_store
from .._tasks.pull import Puller, close_pulling, keep_alive, settle
from .._tasks.states import retry_delay
from ..errors import ConfigurationError, RemoteError
from ..settings import ReachSettings
from ..wire.tasks import TaskAttempt
from .store import TopicStore

__all__ = ["TopicCells", "TopicDecl", "TopicRunner"]

log = logging.getLogger("reach.topics")

_LINGER = 5.0  # seconds an idle pull request waits on the server


@dataclass(slots=True)
class TopicDecl:
    """A durable topic subscription of an agent (``@agent.on_topic(..., durable=True)``)."""

    pattern: str
    spec: TaskHandler
    ordered: bool = False


@dataclass(slots=True)
class TopicCells:
    """What one durable subscription of this instance did (for metrics and tests)."""

    delivered: int = 0  # deliveries to this instance, redeliveries included
    acked: int = 0  # handled: the handler returned
    redelivered: int = 0  # deliveries that were not a message's first
    failed: int = 0  # the handler raised or ran over its timeout
    dead_lettered: int = 0
    running: int = 0  # handlers running now
    #: handlers that ignored their cancellation at ``topic_timeout`` (their message was
    #: settled as timed out all the same), in all, and still running now (each holds its
    #: worker until it returns)
    abandoned: int = 0
    stuck: int = 0
    lag: int | None = None  # messages not yet delivered to the name, at the last sample
    ack_pending: int | None = None  # delivered to the name, not yet settled


@dataclass(slots=True, eq=False)
class _Sub:
    """One subscription at run time: its consumer, pull requests and workers."""

    decl: TopicDecl
    consumer: str
    #: makes the consumer (again: the puller calls it when the consumer has gone)
    ensure: Callable[[], Awaitable[object]]
    limit: int
    #: messages held beyond the busy workers, so the next pull request is under way
    #: while they work (none for an ordered subscription: the server sends one anyway)
    prefetch: int = 0
    puller: Puller | None = None
    queue: asyncio.Queue[Msg] = field(default_factory=asyncio.Queue)
    #: every message this instance holds, from arrival until it is settled
    held: dict[int, Msg] = field(default_factory=dict)
    busy: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    cells: TopicCells = field(default_factory=TopicCells)
    dispatcher: asyncio.Task[Any] | None = None

    def arrived(self) -> None:
        """The puller brought messages (or its request ended): to the workers. The
        dispatcher is woken only when the request has ended (it may open the next)."""
        puller = self.puller
        if puller is None:
            self.wake.set()
            return
        while puller.buffer:
            msg = puller.buffer.popleft()
            self.held[id(msg)] = msg
            self.idle.clear()
            self.queue.put_nowait(msg)
        if not puller.outstanding:
            self.wake.set()

    def freed(self) -> None:
        """A worker is free again: the dispatcher asks for more only when no request is
        open (an open one brings as many as there were free workers when it opened)."""
        if self.puller is None or not self.puller.outstanding:
            self.wake.set()


class TopicRunner:
    """Every durable topic subscription of one agent instance."""

    def __init__(
        self,
        group: str,
        agent_id: str,
        settings: ReachSettings,
        subjects: Subjects,
        concurrency: int,
    ) -> None:
        self.group = group
        self.agent_id = agent_id
        self.settings = settings
        self.subjects = subjects
        self.concurrency = concurrency
        self.decls: dict[str, TopicDecl] = {}
        self.fetching = False
        #: a handler raised SystemExit: True when the agent stops in order for it
        self.on_exit: Callable[[BaseException], bool] = lambda exc: False
        #: told how many handlers that ignored their cancellation still run (each holds its
        #: worker), whenever that number changes
        self.on_stuck: Callable[[int], None] = lambda n: None
        self._subs: list[_Sub] = []
        self._store: TopicStore | None = None
        self._api: JsApi | None = None
        self._owner: Background | None = None
        self._nc: NatsConnection | None = None

    def cells(self) -> dict[str, TopicCells]:
        """Per pattern, what this instance's subscription did."""
        return {s.decl.pattern: s.cells for s in self._subs}

    # -- start and stop ----------------------------------------------------------------

    async def start(
        self, nc: NatsConnection, owner: Background, stopped: Callable[[], bool] = lambda: False
    ) -> None:
        """Create the stream and consumers if missing (waiting up to ``task_patience`` for
        JetStream to answer, unless ``stopped()``), and start pulling."""
        if not self.decls:
            return
        until = time.monotonic() + self.settings.task_patience
        what = f"agent {self.agent_id}"
        store = await open_store(
            nc,
            f"{what}: topic stream",
            lambda api: TopicStore(nc.jetstream(), self.subjects, self.settings, api),
            until=until,
            stopped=stopped,
        )
        self._api = store.api
        self._store, self._owner, self._nc = store, owner, nc
        self._subs = []
        for decl in self.decls.values():
            if not store.keeps(decl.pattern):  # a stream made by hand, narrower
                raise ConfigurationError(
                    f"{what}: stream {store.stream} does not keep durable topic"
                    f" {decl.pattern!r} (its subjects: {', '.join(store.stored)}); add"
                    f" {self.subjects.topic(decl.pattern)} to it, or subscribe plainly"
                )
            ensure = functools.partial(
                store.ensure_consumer, self.group, decl.pattern, ordered=decl.ordered
            )
            name = await patiently(
                nc,
                f"{what}: consumer of topic {decl.pattern}",
                ensure,
                until=until,
                stopped=stopped,
            )
            log.info(
                "agent %s: durable topic %s%s on consumer %s of %s",
                self.agent_id,
                decl.pattern,
                " (ordered)" if decl.ordered else "",
                name,
                store.stream,
            )
            limit = 1 if decl.ordered else self.concurrency
            self._subs.append(_Sub(decl, name, ensure, limit, 0 if decl.ordered else limit))
        await self._open()
        for s in self._subs:
            for _ in range(s.limit):
                owner.keep(functools.partial(self._work, s), f"topic {s.consumer}: worker")
        owner.keep(self._keep_leases, "topics: leases")
        owner.keep(self._sample_lag, "topics: lag")

    async def _open(self) -> None:
        """The pull requests of every subscription (at start and resume)."""
        nc, owner, store = self._nc, self._owner, self._store
        assert nc is not None
        assert owner is not None
        assert store is not None
        self.fetching = True
        for s in self._subs:
            s.puller = Puller(nc, store.stream, s.consumer, nc.new_inbox(), s.arrived, s.ensure)
            await s.puller.open()
            if not s.held:
                s.idle.set()
            name = f"topic {s.consumer}: pull"
            s.dispatcher = owner.keep(functools.partial(self._dispatch, s), name)

    async def _stop_pulling(self) -> None:
        """No new messages; those held and not started go back at once (running
        handlers go on)."""
        self.fetching = False
        for s in self._subs:
            task, s.dispatcher = s.dispatcher, None
            if task is not None:
                task.cancel()
                await asyncio.wait({task})
            if s.puller is not None:
                await s.puller.close()  # the server skips pull requests nobody listens to
                s.arrived()
            while not s.queue.empty():
                await self._hand_back(s, s.queue.get_nowait())

    async def pause(self) -> None:
        """Take no new messages; running handlers go on (their messages are settled)."""
        if self.fetching:
            await self._stop_pulling()

    async def resume(self) -> None:
        if not self.fetching and self._subs and self._owner is not None:
            await self._open()

    async def drain(self, timeout: float) -> bool:
        """Stop pulling, let running handlers finish within ``timeout``, and put back the
        rest for another instance at once; True when none had to be put back."""
        if not self._subs:
            return True
        await self._stop_pulling()
        idle = [asyncio.ensure_future(s.idle.wait()) for s in self._subs]
        try:
            _, pending = await asyncio.wait(idle, timeout=timeout)
        finally:
            for waiter in idle:
                waiter.cancel()
        if not pending:
            return True
        for s in self._subs:
            for msg in list(s.held.values()):
                await self._hand_back(s, msg)
        return False

    def reconnected(self) -> None:
        """The connection is back: pull again now (the open requests went with the old
        one), not when they would have expired."""
        for s in self._subs:
            if s.puller is not None:
                s.puller.lost()
            s.wake.set()

    async def close(self) -> None:
        """After the owner's background coroutines are cancelled: drop the subscriptions."""
        self.fetching = False
        api, self._api = self._api, None
        pullers = [s.puller for s in self._subs if s.puller is not None]
        await close_pulling(pullers, api, f"agent {self.agent_id}: topic subscriptions")

    async def _hand_back(self, s: _Sub, msg: Msg) -> None:
        """Redeliver at once, to any instance of the name (the delivery is spent)."""
        if s.held.pop(id(msg), None) is not None:
            await settle(msg.nak(), "nak")
        _let_go(s, msg)

    # -- pulling and working -----------------------------------------------------------

    async def _dispatch(self, s: _Sub) -> None:
        """Keep one pull request open for the workers that are free (none held waiting)."""
        assert s.puller is not None
        while self.fetching:
            s.wake.clear()
            free = s.prefetch + s.limit - s.busy - s.queue.qsize()
            if free > 0 and s.puller.idle:
                await s.puller.linger(_LINGER, batch=free)
            # a request the server lost (a restart) never ends by itself: look again then
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2 * _LINGER):
                    await s.wake.wait()

    async def _work(self, s: _Sub) -> None:
        while True:
            msg = await s.queue.get()
            s.busy += 1
            s.cells.running += 1
            try:
                await self._handle(s, msg)
            except asyncio.CancelledError:
                # the agent stops without a drain: back to another instance now, not
                # after the ack timer (already settled: nats-py refuses, quietly)
                await settle(msg.nak(), "nak")
                raise
            finally:
                s.busy -= 1
                s.cells.running -= 1
                _let_go(s, msg)
                s.freed()

    def _topic_of(self, subject: str, consumer: str) -> str:
        redo = self.subjects.topic_redo(consumer, "")
        if subject.startswith(redo):
            return subject[len(redo) :]
        return self.subjects.topic_of(subject)

    async def _handle(self, s: _Sub, msg: Msg) -> None:
        md = msg.metadata
        n = md.num_delivered or 1
        cells, limit = s.cells, self.settings.topic_max_deliver
        cells.delivered += 1
        if n > 1:
            cells.redelivered += 1
        topic = self._topic_of(msg.subject, s.consumer)
        if n > limit:
            why = f"delivered {n - 1} times without an answer: the instances that held it died"
            await self._dead(s, msg, topic, "max_deliveries", why + " or stalled", None)
            return
        try:
            payload = s.decl.spec.decode(msg.data)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            log.warning("agent %s: undecodable message on topic %s: %s", self.agent_id, topic, exc)
            await self._dead(s, msg, topic, "bad_request", f"payload: {exc}", None)
            return
        owner = self._owner
        assert owner is not None
        started = now_ms()
        what = f"agent {self.agent_id}: handler for topic {topic} (message {md.sequence.stream})"
        run = BoundedRun(
            owner,
            self._call(s, payload, topic),
            f"topic {s.consumer}: handler",
            what,
            cells,
            self._stuck,
        )
        try:
            error = await self._bounded(run, topic)
            await self._settle_run(s, msg, topic, n, started, error)
            _let_go(s, msg)  # settled: no more in_progress for it
            await run.outlive()  # a handler that will not stop keeps its worker
        finally:
            run.unstick()  # the agent stops: it is the owner's to end now

    async def _bounded(
        self, run: BoundedRun[tuple[str, str] | None], topic: str
    ) -> tuple[str, str] | None:
        """Wait for the handler up to ``topic_timeout``, else stop it; its outcome."""
        timeout = self.settings.topic_timeout
        if await run.finished(timeout):
            if run.task.cancelled():  # by the owner, not by us
                return "failed", "the handler was cancelled"
            return run.task.result()
        log.warning(
            "agent %s: handler for topic %s ran over topic_timeout (%ss)",
            self.agent_id,
            topic,
            timeout,
        )
        await run.stop("timeout", "worker stays")
        return "timeout", f"the handler ran over topic_timeout ({timeout}s)"

    async def _settle_run(
        self, s: _Sub, msg: Msg, topic: str, n: int, started: int, error: tuple[str, str] | None
    ) -> None:
        """ack, or nak with backoff, or on the last delivery a dead letter."""
        cells, limit = s.cells, self.settings.topic_max_deliver
        if error is None:
            if await settle(msg.ack(), "ack"):
                cells.acked += 1
            return
        cells.failed += 1
        code, message = error
        if n < limit:
            s_ = self.settings
            delay = retry_delay(n, s_.topic_retry_base, s_.topic_retry_cap)
            await settle(msg.nak(delay=delay), "nak")
            return
        attempt = TaskAttempt(
            n=n,
            agent_id=self.agent_id,
            started_ms=started,
            ended_ms=now_ms(),
            outcome="timeout" if code == "timeout" else "failed",
            error=f"{code}: {message}"[:500],
        )
        await self._dead(s, msg, topic, code, message, attempt)

    def _stuck(self) -> None:
        self.on_stuck(sum(s.cells.stuck for s in self._subs))

    async def _call(self, s: _Sub, payload: Any, topic: str) -> tuple[str, str] | None:
        """Run the handler; None when it returned, else (code, message). Its failure is
        the message's outcome, never a crash of ours."""
        spec = s.decl.spec
        try:
            if spec.wants_context:
                await spec.fn(payload, topic)
            else:
                await spec.fn(payload)
            return None
        except RemoteError as exc:
            return exc.code, exc.message
        except Exception as exc:
            log.exception(
                "agent %s: handler for topic %s (%s) failed", self.agent_id, topic, s.decl.pattern
            )
            return "failed", f"{type(exc).__name__}: {exc}"
        except (KeyboardInterrupt, SystemExit) as stop:
            if not self.on_exit(stop):
                raise
            return "failed", "the handler stopped the process"

    async def _dead(
        self,
        s: _Sub,
        msg: Msg,
        topic: str,
        reason: str,
        error: str,
        attempt: TaskAttempt | None,
    ) -> None:
        """Store the dead letter, then take the message off the consumer (``term``)."""
        store = self._store
        assert store is not None
        seq = msg.metadata.sequence.stream
        headers = dict(msg.headers or {})
        headers |= {DLQ_GROUP: self.group, DLQ_CONSUMER: s.consumer, DLQ_SEQ: str(seq)}
        try:
            await dead_letter(
                store,
                capability="",
                task_id="",
                data=msg.data,
                headers=headers,
                reason=reason,
                error=error,
                attempts=[attempt] if attempt is not None else [],
                kind="topic",
                subject=self.subjects.topic_dlq(topic),
                msg_id=f"dlq.topic.{s.consumer}.{seq}",
            )
        except TRANSIENT as exc:
            # not stored: leave the message to its ack timer, so a later delivery tries again
            log.warning("agent %s: topic %s: dead letter not stored: %s", self.agent_id, topic, exc)
            return
        s.cells.dead_lettered += 1
        log.warning(
            "agent %s: message %d of topic %s dead-lettered for %s (%s): %s",
            self.agent_id,
            seq,
            topic,
            self.group,
            reason,
            error,
        )
        await settle(msg.term(), "term")

    # -- leases and lag ----------------------------------------------------------------

    async def _keep_leases(self) -> None:
        """Every ack_wait/3: reset the ack timer of every message held (all at once: one
        slow call must not let another lapse)."""
        while True:
            await asyncio.sleep(self.settings.topic_ack_wait / 3)
            held = [m for s in self._subs for m in list(s.held.values())]
            await keep_alive(held)

    async def _sample_lag(self) -> None:
        while True:
            store = self._store
            if store is not None:
                for s in self._subs:
                    try:
                        s.cells.lag, s.cells.ack_pending = await store.lag(s.consumer)
                    except nats.js.errors.NotFoundError:
                        if s.puller is not None:  # made again before its next pull request
                            s.puller.missing("its info: not found")
                    except TRANSIENT as exc:
                        log.debug("topic %s: lag: %s", s.consumer, exc)
            await asyncio.sleep(self.settings.topic_lag_interval)


def _let_go(s: _Sub, msg: Msg) -> None:
    """``msg`` is no longer held (settled, or handed back)."""
    s.held.pop(id(msg), None)
    if not s.held:
        s.idle.set()
