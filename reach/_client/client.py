"""The client: capability requests, direct calls, broadcast publish and subscribe, durable
tasks (submit, follow, list, dead letters and replay) and writes to the routing configuration.

Background work (the routing-table and config watches, their watchdog and rebuilds) lives
in ``watches``, under one ``Background``; ``close()`` cancels and awaits it. The request
path is in ``attempts`` and ``reach._inbox``; routing state is the pure ``reach._routing``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import msgspec
from nats.aio.client import Client as NatsConnection

from .._codec import now_ms
from .._inbox import Inbox, Reply
from .._nats import close_nats, connect_nats, flush_nats, permissions_of
from .._routing import Policy, Router, Weights
from .._subjects import MAX_NAME, Subjects, validate_capability
from .._tasks import (
    Batch,
    ScheduleInfo,
    TaskRecord,
    TaskRef,
    Tasks,
    TaskState,
    TaskSubmit,
    admin,
    unserved,
)
from .._tasks import schedules as periodic
from .._tasks.admin import DeadLetter
from .._tasks.delayed import due_of
from .._tasks.faults import patiently, task_errors
from .._telemetry.core import Telemetry
from .._topics import DurableTopics, Since
from ..errors import (
    CapabilityNotFound,
    ConfigurationError,
    NotReplayable,
    NotStarted,
    TaskNotFound,
)
from ..settings import ReachSettings
from ..wire import AgentRecord, Priority
from .attempts import Requester
from .config import ConfigSink, config_bucket
from .gather import Gathered, gather
from .metrics import ClientMetrics
from .stream import WINDOW, Stream, Streams
from .table import RoutingTable
from .topics import TopicSubscription, publish, subscribe
from .watches import Watches

__all__ = ["Client", "ClientStats"]


def _seconds(span: datetime.timedelta | float | None) -> float | None:
    return span.total_seconds() if isinstance(span, datetime.timedelta) else span


log = logging.getLogger("reach.client")


@dataclass(frozen=True, slots=True)
class ClientStats:
    """Counters of a client's background and bounded machinery (a read-only snapshot)."""

    changes_dropped: int = 0  # changes() items dropped (oldest first): a listener lagged
    background_failures: int = 0  # background coroutines that crashed (logged; loops restart)
    watch_errors: int = 0  # failures inside the routing-table or config watch
    table_rebuilds: int = 0  # routing-table watches (re)built
    attempts_cancelled: int = 0  # attempts cut short: hedge losers, caller timeouts, gathers
    heartbeats_clamped: int = 0  # records whose heartbeat numbers were out of range
    records_ignored: int = 0  # agent records that did not decode or named another key
    config_ignored: int = 0  # config keys whose value could not be used
    permission_violations: int = 0  # publishes and subscriptions the server refused
    replies_ignored: int = 0  # replies naming another instance than the one asked


class Client:
    """Calls capabilities, broadcasts, submits and follows durable tasks, and writes the
    routing configuration; one NATS connection, opened by ``async with``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: ReachSettings | None = None,
        name: str = "",
        routing: Policy | str | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings if settings is not None else ReachSettings()
        #: metrics, spans and health of this client (its own unless one is passed in)
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.url = self.settings.nats_url if url is None else url
        if len(name) > MAX_NAME:  # it travels in every request's headers
            raise ConfigurationError(f"client name is {len(name)} characters; at most {MAX_NAME}")
        self.name = name
        self.subjects = Subjects(self.settings.subject_prefix)
        self._nc: NatsConnection | None = None
        self._owns_nc = True
        self._flushed = 0  # permission violations already reported by flush()
        self._router = Router(
            breaker_cooldown=self.settings.breaker_cooldown,
            retry_ratio=self.settings.retry_budget,
            rate_limits=self.settings.rate_limits,
            weights={c: Weights(**w) for c, w in self.settings.routing_weights.items()},
            task_types=self.settings.task_types,
        )
        self._inbox = Inbox(self.url, f"{self.subjects.prefix}.agent.")
        self._table = RoutingTable(
            on_leave=self._router.forget, on_renew=self._router.renewed, on_down=self._inbox.gone
        )
        self._config = ConfigSink(self._router)
        self._watches = Watches(
            name or "reach-client", self.settings, self.subjects, self._table, self._config
        )
        self._tasks = Tasks(self.settings, self.subjects, name or "reach-client")
        self._durable = DurableTopics(self.settings, self.subjects)
        self._metrics = ClientMetrics(self._router) if self.telemetry.metrics else None
        self._tasks.tracer = self.telemetry.tracer
        if self._metrics is not None:
            self._tasks.on_final = self._metrics.task_final
        self._unsource: Callable[[], None] | None = None
        #: topic subscriptions opened here and not yet unsubscribed: ``close()`` ends them
        #: before it drains (nats-py's drain waits, up to 30 s, for unread messages)
        self._topic_subs: set[TopicSubscription] = set()
        self._requests = Requester(
            self.settings,
            self.subjects,
            name,
            self._router,
            self._inbox,
            self._start_table,
            Policy(routing or self.settings.routing),
            self._metrics,
            self.telemetry.tracer,
        )
        self._streams = Streams(self._inbox, self._requests)

    @property
    def nc(self) -> NatsConnection:
        """The underlying nats-py connection (for what Agent-Reach does not wrap)."""
        if self._nc is None or self._nc.is_closed:
            raise NotStarted("client is not connected; use 'async with Client(...)' first")
        return self._nc

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def routing(self) -> Policy:
        """The policy of requests that name none."""
        return self._requests.routing

    @routing.setter
    def routing(self, policy: Policy | str) -> None:
        self._requests.routing = Policy(policy)

    async def connect(self) -> Self:
        if self._nc is None or self._nc.is_closed:
            nc = await connect_nats(
                self.settings, self.url, self.name or "reach-client", reconnected=self.on_reconnect
            )
            await self._open(nc, owned=True)
        return self

    async def _adopt(self, nc: NatsConnection) -> None:
        """Share a connection owned by someone else (an Agent's); ``close()`` leaves it open."""
        await self._open(nc, owned=False)

    async def _open(self, nc: NatsConnection, *, owned: bool) -> None:
        self._nc, self._owns_nc, self._flushed = nc, owned, 0
        self._requests.tracer = self._tasks.tracer = self.telemetry.tracer
        if self._metrics is not None and self._unsource is None:
            self._unsource = self.telemetry.add_source(self._metrics.collect)
        self._watches.reopen()
        self._streams.reopen()
        await self._inbox.open(nc)
        await flush_nats(nc)  # the reply inbox's interest is the server's before we start

    async def on_reconnect(self) -> None:
        """Rebuild the watches (nats-py's own can stay silent for ~15 s after a reconnect),
        and fail over at once the attempts whose work may run twice (their answer may be
        lost)."""
        self._inbox.reconnected()
        self._watches.rebuild_soon()

    async def _start_table(self, capability: str | None = None) -> RoutingTable:
        """Follow ``capability``'s instances (None: every agent) from now on, and the
        config, once; concurrent callers share each start."""
        nc = self.nc  # NotStarted before connect
        await self._watches.ensure(nc)
        if capability is None:
            await self._watches.follow_all(nc)
        else:
            capability = self._router.resolve(capability)
            validate_capability(capability)
            await self._watches.follow(nc, capability)
        if self._nc is not nc:
            # closed (and maybe reconnected) meanwhile: a table set now would skip the next
            # connection's start, and its watches would never run
            raise NotStarted("client closed while it started routing")
        self._requests.table = self._table
        return self._table

    # -- reading the table -------------------------------------------------------------

    async def agents(self, capability: str | None = None) -> list[AgentRecord]:
        """The routing table: every known instance (of ``capability``), by agent id.
        Without a capability the client follows the whole fleet from then on (as the
        gateway and ``reach status`` do); otherwise only the capabilities it asked about."""
        table = await self._start_table(capability)
        records = table.offering(capability) if capability else list(table.records.values())
        return sorted(records, key=lambda r: r.info.agent_id)

    async def changes(self) -> AsyncIterator[AgentRecord | str]:
        """Follow the routing table: each record as it is written, an agent id when it goes.
        A consumer that falls more than 1024 changes behind loses the oldest (counted in
        ``stats.changes_dropped``)."""
        table = await self._start_table()
        queue = table.listen()
        try:
            while True:
                yield await queue.get()
        finally:
            table.unlisten(queue)

    async def pick(
        self,
        capability: str,
        *,
        version: str | None = None,
        required_tags: Sequence[str] = (),
        priority: Priority | str = Priority.NORMAL,
        routing: Policy | str | None = None,
        affinity_key: str | None = None,
    ) -> str | None:
        """The agent id the next request would go to (None: the NATS queue group).

        Raises ``CapabilityNotFound`` when instances exist but none fits, like a request.
        """
        table = await self._start_table(capability)
        capability = self._router.resolve(capability)
        return self._router.choose(
            Policy(routing or self.routing),
            table,
            capability,
            version,
            tuple(required_tags),
            Priority(priority),
            (),
            affinity_key,
            asyncio.get_running_loop().time(),
            send=False,
        ).agent_id

    def footprint(self) -> dict[str, int]:
        """Sizes of every per-instance and per-key map this client holds (read-only), so
        long-lived processes can check that they stay bounded. ``table.*`` and ``router.*``
        follow the routing table; ``capabilities.*`` grow with the capabilities called."""
        return {
            **self._table.footprint(),
            **self._router.footprint(),
            "capabilities.checked": self._requests.checked,
            "pending": len(self._inbox.pending),
            "streams": len(self._inbox.streams),
            "deadlines": self._inbox.deadlines,
            "background": len(self._watches.owner),
        }

    @property
    def stats(self) -> ClientStats:
        """Counters: dropped changes, background failures, cancelled attempts, ..."""
        perms = permissions_of(self._nc) if self._nc is not None else None
        return ClientStats(
            changes_dropped=self._table.dropped,
            background_failures=self._watches.owner.failures,
            watch_errors=self._watches.errors,
            table_rebuilds=self._watches.rebuilds,
            attempts_cancelled=self._requests.cancelled,
            heartbeats_clamped=self._table.clamped,
            records_ignored=self._table.undecodable,
            config_ignored=self._config.ignored,
            permission_violations=perms.count if perms is not None else 0,
            replies_ignored=self._inbox.ignored,
        )

    # -- closing -----------------------------------------------------------------------

    async def close(self) -> None:
        """Stop background work and fail pending requests; close the connection if it is
        ours (an adopted one stays open for its owner)."""
        if self._unsource is not None:
            self._unsource()
            self._unsource = None
        await self._streams.close(self._watches.close_timeout)
        await self._watches.close()
        await self._tasks.close()
        await self._durable.close()
        self._requests.table = None
        for sub in list(self._topic_subs):
            await sub.unsubscribe()
        nc, self._nc = self._nc, None
        await self._inbox.close(unsubscribe=not self._owns_nc)
        if nc is not None and self._owns_nc:
            await close_nats(nc)

    async def __aenter__(self) -> Self:
        return await self.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- requests ----------------------------------------------------------------------

    async def request(
        self,
        capability: str,
        payload: Any = None,
        *,
        timeout: float | None = None,
        priority: Priority | str = Priority.NORMAL,
        agent_id: str | None = None,
        response_type: Any = None,
        request_id: str | None = None,
        version: str | None = None,
        required_tags: Sequence[str] = (),
        routing: Policy | str | None = None,
        affinity_key: str | None = None,
        hedge: bool = False,
        max_attempts: int | None = None,
        idempotent: bool = False,
    ) -> Any:
        """Call ``capability`` and return the decoded answer; errors raise ``ReachError``s."""
        reply = await self._requests.call(
            capability,
            payload,
            timeout=timeout,
            priority=priority,
            agent_id=agent_id,
            response_type=response_type,
            request_id=request_id,
            version=version,
            required_tags=required_tags,
            routing=routing,
            affinity_key=affinity_key,
            hedge=hedge,
            max_attempts=max_attempts,
            idempotent=idempotent,
        )
        return reply.value

    async def call(
        self,
        capability: str,
        payload: Any = None,
        *,
        timeout: float | None = None,
        priority: Priority | str = Priority.NORMAL,
        agent_id: str | None = None,
        response_type: Any = None,
        request_id: str | None = None,
        version: str | None = None,
        required_tags: Sequence[str] = (),
        routing: Policy | str | None = None,
        affinity_key: str | None = None,
        hedge: bool = False,
        max_attempts: int | None = None,
        idempotent: bool = False,
    ) -> Reply:
        """Like :meth:`request` but returns the :class:`Reply` (who answered, latency).

        ``capability`` may also be a task type (``REACH_TASK_TYPES`` or the config bucket).
        Routing: ``agent_id`` goes to that instance only and is never substituted.
        Otherwise ``routing`` (default: the client's, ``balanced``) picks among live
        instances in the routing table (UP; DEGRADED too unless priority is high) that offer
        the capability in the same major ``version`` with all ``required_tags``; with no
        instance of it in the table at all, the NATS queue group chooses.

        Time: ``timeout`` (default ``REACH_TIMEOUT_MS``) is the whole deadline, and the
        first attempt gets all of it. An attempt that finds nobody, a full queue, an open
        circuit or a lost connection moves to another instance at once, while the deadline
        and the retry budget last. A timed-out attempt may still be running, so it is
        retried only with ``idempotent=True``, and only on another instance (then an
        attempt may be cut short to leave a faster live instance time to answer).
        ``failed`` and ``bad_request`` are never retried. ``hedge=True`` sends one
        duplicate to a second instance after the capability's p95 latency.
        """
        return await self._requests.call(
            capability,
            payload,
            timeout=timeout,
            priority=priority,
            agent_id=agent_id,
            response_type=response_type,
            request_id=request_id,
            version=version,
            required_tags=required_tags,
            routing=routing,
            affinity_key=affinity_key,
            hedge=hedge,
            max_attempts=max_attempts,
            idempotent=idempotent,
        )

    def stream(
        self,
        capability: str,
        payload: Any = None,
        *,
        timeout: float | None = None,
        total_timeout: float | None = None,
        window: int = WINDOW,
        priority: Priority | str = Priority.NORMAL,
        agent_id: str | None = None,
        response_type: Any = None,
        request_id: str | None = None,
        version: str | None = None,
        required_tags: Sequence[str] = (),
        routing: Policy | str | None = None,
        affinity_key: str | None = None,
        max_attempts: int | None = None,
        idempotent: bool = False,
        patience: float | None = None,
    ) -> Stream:
        """Call a capability whose answer comes in chunks (a handler written as an async
        generator): ``async for chunk in client.stream("chat.complete", prompt): ...``.
        Each chunk is decoded as ``response_type``. A capability that does not stream
        gives its whole answer as the one chunk.

        Until the first chunk it is a request: routed, failed over and refused as
        :meth:`call` says (``agent_id``, ``routing``, ``version``, ``required_tags``,
        breakers, ``idempotent``). Then it stays with the instance that answered: a
        stream cut short after its first chunk raises :class:`~reach.StreamBroken`
        (``chunks`` says how many arrived), never a silent failover. An error the handler
        raises mid-stream is raised after the chunks before it.

        Time: ``timeout`` (default ``REACH_TIMEOUT_MS``) bounds the wait for the first
        chunk and for each chunk after it; ``total_timeout`` (None: none) bounds the whole
        stream, and is the deadline the handler sees in ``ctx.remaining()``.

        Flow control: at most ``window`` chunks are on their way or unread; the handler's
        ``yield`` waits until the reader takes some. Leaving early (``aclose()``, the
        end of ``async with``, an exception or cancellation in the loop) cancels the
        handler at once; a ``break`` out of a bare ``async for`` only once the stream
        object is dropped (Python does not close it). So does a caller
        that goes silent (its process gone): the agent stops a stream whose caller sent
        nothing for ``patience`` seconds (the agent's default, 5 s, when None; 0.5..600).
        This client says something every 0.2 s from its own task while its event loop
        runs, however slowly the reader reads; a loop blocked for longer than
        ``patience`` (a synchronous step) breaks the stream: ``StreamBroken(reason=
        "silent")``. Use ``async with client.stream(...) as s:`` to leave early: the
        handler is cancelled when the block ends, whatever happens in it.
        """
        return Stream(
            self._streams,
            capability,
            payload,
            timeout=timeout,
            total_timeout=total_timeout,
            window=window,
            response_type=response_type,
            patience=patience,
            options={
                "priority": priority,
                "agent_id": agent_id,
                "request_id": request_id,
                "version": version,
                "required_tags": required_tags,
                "routing": routing,
                "affinity_key": affinity_key,
                "max_attempts": max_attempts,
                "idempotent": idempotent,
            },
        )

    async def gather(
        self,
        capability: str,
        payload: Any = None,
        *,
        timeout: float | None = None,
        min_replies: int | None = None,
        priority: Priority | str = Priority.NORMAL,
        version: str | None = None,
        required_tags: Sequence[str] = (),
        response_type: Any = None,
        request_id: str | None = None,
    ) -> Gathered:
        """Ask every live instance of ``capability`` at once, each on its direct subject,
        and return one outcome per instance: a :class:`Gathered` mapping each agent id to
        its :class:`Reply` or to the ``ReachError`` that request would have raised.

        Asked: every instance in the routing table that a request could go to (UP; DEGRADED
        too unless priority is high) in the same major ``version`` with all
        ``required_tags``. PAUSED, UNKNOWN and DOWN instances are not asked (they take no
        new work, or may be gone): ``Gathered.skipped`` names them.

        Returns when every instance has answered or failed, when ``min_replies`` have
        answered (the others are cancelled: ``Gathered.unanswered``), or at the deadline
        ``timeout`` (default ``REACH_TIMEOUT_MS``): an instance silent until then has a
        ``RequestTimeout``. Nothing is retried. Raises only for bad arguments
        (``ConfigurationError``), when no instance can be asked (``CapabilityNotFound``,
        saying why), or when the routing table does not load within half the deadline
        (``RequestTimeout``).
        """
        return await gather(
            self._requests,
            capability,
            payload,
            timeout=timeout,
            min_replies=min_replies,
            priority=priority,
            version=version,
            required_tags=required_tags,
            response_type=response_type,
            request_id=request_id,
        )

    # -- broadcast ---------------------------------------------------------------------

    async def publish(self, topic: str, payload: Any = None, *, durable: bool = False) -> int:
        """Broadcast ``payload`` to every subscriber of ``topic``.

        ``durable=True`` returns once the server has stored it in stream
        ``REACH_TOPICS`` (made on first use), so every durable subscriber gets it however
        long it is away (within ``REACH_TOPIC_RETENTION``); its sequence there is
        returned (0 for a plain broadcast). ``NotStored`` says why it was not confirmed
        (no stream, JetStream unavailable, a timeout: then it may be stored)."""
        sequence = await publish(
            self.nc,
            self.subjects,
            self.name,
            self.url,
            topic,
            payload,
            self._durable if durable else None,
        )
        if durable and self._metrics is not None:
            self._metrics.published(topic)
        return sequence

    async def subscribe(self, topic: str, *, since: Since | None = None) -> TopicSubscription:
        """Receive every broadcast on ``topic`` (``*`` and ``>`` allowed); flushed on return.

        ``since`` (a datetime, a timedelta before now, or a sequence in the topics
        stream) first reads what the stream kept from there, then live messages as they
        are stored, in order, with no gap and no duplicate where one meets the other;
        each message carries its ``seq`` and ``time``. ``NotStored`` when no stream keeps
        topics yet."""
        sub = await subscribe(
            self.nc,
            self.subjects,
            self.url,
            topic,
            since,
            self._durable if since is not None else None,
            on_unsubscribe=self._topic_subs.discard,
        )
        self._topic_subs.add(sub)
        return sub

    async def flush(self) -> None:
        """Wait until the server has everything this client sent (e.g. after publish);
        ``Unauthorized`` naming what it refused on this connection since the last flush
        (a subject the user's permissions in nats-server.conf do not allow)."""
        nc = self.nc
        await flush_nats(nc)
        permissions = permissions_of(nc)
        if permissions is not None and permissions.count != self._flushed:
            mark, self._flushed = self._flushed, permissions.count
            permissions.check(mark, f"flush of {self.name or 'reach-client'}")

    # -- durable tasks: over ``reach._tasks.Tasks`` and ``reach._tasks.admin``; each method
    # runs inside ``task_errors``, so it raises ``ReachError``s only ----------------------

    async def _require_agent(self, sub: TaskSubmit) -> None:
        """``CapabilityNotFound`` unless the routing table holds a live instance that would
        run ``sub`` (``require_agent=True``)."""
        why = unserved(
            await self.agents(), sub.capability, version=sub.version, tags=sub.required_tags
        )
        if why is not None:
            raise CapabilityNotFound(why)

    async def submit(
        self,
        capability: str,
        payload: Any = None,
        *,
        priority: Priority | str = Priority.NORMAL,
        timeout: float | None = None,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        callback: str | None = None,
        required_tags: Sequence[str] = (),
        version: str | None = None,
        require_agent: bool = False,
        at: datetime.datetime | None = None,
        delay: datetime.timedelta | float | None = None,
    ) -> TaskRef:
        """Submit a durable task; returns once JetStream has stored it (and its record is
        readable from any process). It waits for an instance of ``capability`` declared
        with ``@agent.task``, however long that takes (the task stream has no max age): a
        task may be queued before its worker starts.
        ``require_agent=True`` refuses at once instead (``CapabilityNotFound``, nothing
        stored) when the routing table knows no live (UP or DEGRADED) instance serving it
        with ``version`` and ``required_tags``.

        ``timeout`` is per attempt, ``max_attempts`` counts runs (timeouts and lost agents
        are retried with backoff; a handler's error is final unless it is retryable).
        The same ``idempotency_key`` within ``REACH_TASK_IDEMPOTENCY_TTL`` returns the
        same task. ``callback`` is a subject that receives the final record as a request
        and must answer it. A payload must fit in a record: at most about 3/8 of the
        server's ``max_payload`` (``ConfigurationError`` otherwise).

        ``at`` (an aware datetime) or ``delay`` (a timedelta or seconds) holds the task
        back until then: it is SCHEDULED (the server holds it; no process of ours waits),
        then enters the work queue as PENDING. A cancel before then removes it.
        """
        due = due_of(at, delay, now_ms())
        sub = self._tasks.spec(
            capability,
            payload,
            priority=priority,
            timeout=timeout,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            callback=callback,
            required_tags=required_tags,
            version=version,
            due_ms=due,
        )
        if require_agent:
            await self._require_agent(sub)
        with task_errors(f"submit to {capability}"):
            ref = await self._tasks.submit(self.nc, sub)
        if self._metrics is not None:
            self._metrics.submitted(sub.capability, sub.priority.value)
        return ref

    async def submit_batch(
        self,
        capability: str,
        payloads: Sequence[Any],
        *,
        priority: Priority | str = Priority.NORMAL,
        timeout: float | None = None,
        max_attempts: int | None = None,
        callback: str | None = None,
        required_tags: Sequence[str] = (),
        version: str | None = None,
        idempotency_keys: Sequence[str] | None = None,
        require_agent: bool = False,
    ) -> Batch:
        """Submit one task per payload, pipelined. An item that could not be submitted
        holds its error in the batch; nothing raises for all. ``idempotency_keys`` (one per
        payload) make a batch safe to submit again: an item whose key was submitted within
        the TTL gives that task. ``require_agent``: as for ``submit``, checked once,
        before anything is sent."""
        if idempotency_keys is not None and len(idempotency_keys) != len(payloads):
            raise ConfigurationError(
                f"idempotency_keys has {len(idempotency_keys)} keys for"
                f" {len(payloads)} payloads; give one per payload"
            )
        keys = idempotency_keys if idempotency_keys is not None else [None] * len(payloads)
        subs = [
            self._tasks.spec(
                capability,
                p,
                priority=priority,
                timeout=timeout,
                max_attempts=max_attempts,
                idempotency_key=key,
                callback=callback,
                required_tags=required_tags,
                version=version,
            )
            for p, key in zip(payloads, keys, strict=True)
        ]
        if require_agent and subs:
            await self._require_agent(subs[0])
        with task_errors(f"submit to {capability}"):
            batch = await self._tasks.submit_batch(self.nc, subs)
        if self._metrics is not None and subs:
            for _ in range(batch.progress.total - batch.progress.failed):
                self._metrics.submitted(subs[0].capability, subs[0].priority.value)
        return batch

    async def task(self, task_id: str) -> TaskRef:
        """A handle on any task by id, submitted by any process; ``TaskNotFound`` for an
        id with no record (never PENDING)."""
        with task_errors(f"task {task_id}"):
            if await self._tasks.get(self.nc, task_id) is None:
                raise TaskNotFound(task_id)
        return TaskRef(self._tasks, task_id)

    async def task_record(self, task_id: str) -> TaskRecord:
        """The record of a task now (``TaskNotFound`` when there is none)."""
        with task_errors(f"task {task_id}"):
            record = await self._tasks.get(self.nc, task_id)
        if record is None:
            raise TaskNotFound(task_id)
        return record

    async def list_tasks(
        self,
        state: TaskState | str | None = None,
        capability: str | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Task records in ``state`` and of ``capability`` (None: any), most recently
        changed first, at most ``limit``. Only matching records are read."""
        with task_errors("list tasks"):
            store = await self._tasks.ready(self.nc)
            return await admin.list_records(store, state=state, capability=capability, limit=limit)

    async def dead_letters(
        self, capability: str | None = None, limit: int = 100, *, topic: str | None = None
    ) -> list[DeadLetter]:
        """Dead letters (of ``capability``, or of durable ``topic``, wildcards allowed;
        None: all), newest first, at most ``limit``."""
        with task_errors("list dead letters"):
            store = await self._tasks.ready(self.nc)
            return await admin.dead_letters(store, capability, limit, topic=topic)

    async def dead_letter(self, seq: int) -> DeadLetter:
        """The dead letter at DLQ sequence ``seq``; ``DeadLetterNotFound`` if there is none."""
        with task_errors(f"dead letter {seq}"):
            return await admin.dead_letter_at(await self._tasks.ready(self.nc), seq)

    async def replay(self, seq: int) -> TaskRef:
        """Run dead letter ``seq`` again as a new task (``replay_of`` the old one, same
        payload, options and idempotency key), then remove it from the DLQ. A callback
        that was never delivered, or a message that never decoded, cannot be replayed
        (``NotReplayable`` saying why; it stays in the DLQ; ``DeadLetterNotFound`` when
        there is none). Replaying twice gives one task."""
        with task_errors(f"replay of dead letter {seq}"):
            store = await self._tasks.ready(self.nc)
            dl = await admin.dead_letter_at(store, seq)
            task_id = await admin.replay(store, seq, notify=self._tasks.notify)
        return TaskRef(self._tasks, task_id, dl.capability)

    async def replay_topic(self, seq: int) -> int:
        """Deliver dead letter ``seq`` of a durable topic again, to the agent name whose
        subscription gave up on it (the other names handled it already), then remove it
        from the DLQ; its new sequence in the topics stream. ``NotReplayable`` for a
        letter that is not a topic's (``replay`` runs a task's)."""
        with task_errors(f"replay of dead letter {seq}"):
            dl = await admin.dead_letter_at(await self._tasks.ready(self.nc), seq)
            if dl.kind != "topic":
                raise NotReplayable(
                    f"dead letter {seq} is a {dl.kind}'s, not a topic message's:"
                    " use replay() (reach dlq replay does either)"
                )
            return await self._durable.replay(self.nc, dl)

    async def purge_dead_letters(
        self,
        capability: str | None = None,
        older_than: datetime.timedelta | float | None = None,
        *,
        expect: int | None = None,
    ) -> int:
        """Remove dead letters for good: all of them, or those of ``capability``, only
        those stored more than ``older_than`` ago if given; how many went. ``expect``:
        the count you were shown (``count_dead_letters``); when the filters now match a
        different number, nothing is removed (``ConfigurationError`` saying both). The
        letters counted are the ones removed: one stored after the count stays."""
        age = (
            older_than.total_seconds() if isinstance(older_than, datetime.timedelta) else older_than
        )
        with task_errors("purge dead letters"):
            store = await self._tasks.ready(self.nc)
            return await admin.purge_dead_letters(store, capability, age, expect=expect)

    async def count_dead_letters(
        self, capability: str | None = None, older_than: datetime.timedelta | float | None = None
    ) -> int:
        """How many dead letters ``purge_dead_letters`` with these filters would remove."""
        age = (
            older_than.total_seconds() if isinstance(older_than, datetime.timedelta) else older_than
        )
        with task_errors("count dead letters"):
            store = await self._tasks.ready(self.nc)
            return len(await admin.dead_letters_to_purge(store, capability, age))

    async def replay_capability(self, capability: str) -> list[TaskRef]:
        """Replay every dead letter of ``capability``, oldest first; those that cannot be
        replayed stay in the DLQ (logged)."""
        with task_errors(f"replay of {capability}"):
            store = await self._tasks.ready(self.nc)
            ids, skipped = await admin.replay_capability(
                store, capability, notify=self._tasks.notify
            )
        for seq, why in skipped:
            log.warning("dead letter %s not replayed: %s", seq, why)
        return [TaskRef(self._tasks, i, capability) for i in ids]

    # -- periodic schedules: over ``reach._tasks.schedules`` -------------------------------

    async def schedule(
        self,
        name: str,
        capability: str,
        payload: Any = None,
        *,
        every: datetime.timedelta | float | None = None,
        cron: str | None = None,
        tz: str | None = None,
        priority: Priority | str = Priority.NORMAL,
        overlap: str = "allow",
        timeout: float | None = None,
        max_attempts: int | None = None,
        required_tags: Sequence[str] = (),
        version: str | None = None,
    ) -> ScheduleInfo:
        """Run a task of ``capability`` with ``payload`` periodically: ``every`` (whole
        seconds, at least 1) or on a ``cron`` line (six fields, seconds first, e.g.
        ``"0 0 2 * * *"``, or ``"@daily"``) in time zone ``tz`` (UTC by default). The
        server keeps the schedule and fires it with no process of ours running; an agent
        of the capability turns each firing into a task with its own id and record
        (``schedule`` names it), one per period, also for periods missed while the server
        was away. ``name`` is the schedule's identity: scheduling it again replaces it.
        ``overlap="skip"`` starts no period while the previous one is not final (it is
        recorded CANCELLED, error ``skipped``). A payload ``submit`` refuses is refused
        here too (``PayloadTooLarge``). Returns the schedule with its next firing."""
        spec = periodic.spec_of(
            name,
            capability,
            payload,
            every=every,
            cron=cron,
            tz=tz,
            priority=priority,
            overlap=overlap,
            timeout=timeout,
            max_attempts=max_attempts,
            required_tags=list(required_tags),
            version=version,
            caller=self.name,
        )
        self._tasks.check_size(self.nc, spec.payload)  # each period's task must fit, too
        with task_errors(f"schedule {name}"):
            return await periodic.define(await self._tasks.ready(self.nc), spec)

    async def schedules(self) -> list[ScheduleInfo]:
        """Every periodic schedule, by name, with its next firing."""
        with task_errors("list schedules"):
            return await periodic.list_schedules(await self._tasks.ready(self.nc))

    async def unschedule(self, name: str) -> bool:
        """Remove schedule ``name``: nothing fires any more (tasks made already run);
        False when there was none."""
        with task_errors(f"unschedule {name}"):
            return await periodic.remove(await self._tasks.ready(self.nc), name)

    async def pause_schedule(self, name: str) -> ScheduleInfo:
        """Stop firing schedule ``name`` until ``resume_schedule`` (its definition stays)."""
        with task_errors(f"pause {name}"):
            return await periodic.set_paused(await self._tasks.ready(self.nc), name, True)

    async def resume_schedule(self, name: str) -> ScheduleInfo:
        """Fire schedule ``name`` again, from its next period on (none is made up for the
        pause)."""
        with task_errors(f"resume {name}"):
            return await periodic.set_paused(await self._tasks.ready(self.nc), name, False)

    # -- routing configuration: writes to the config bucket every client follows ---------

    async def _config_put(self, key: str, value: bytes) -> None:
        """One write to the config bucket (made when missing), tried again while JetStream
        cannot answer yet (in a cluster a bucket just made has no stream leader for a moment)
        for ``task_patience``; every failure is a ``ReachError``."""
        what = f"config {key}"

        async def put() -> None:
            kv = await config_bucket(
                self.nc.jetstream(),
                self.subjects.bucket("config"),
                create=True,
                replicas=self.settings.replicas,
            )
            await kv.put(key, value)

        with task_errors(what, store="config bucket"):
            until = time.monotonic() + self.settings.task_patience
            await patiently(self.nc, what, put, until=until)

    async def set_routing_weights(
        self,
        capability: str,
        *,
        w_load: float = 4.0,
        w_latency: float = 2.0,
        threshold: float = 0.3,
    ) -> None:
        """Change the ``scored`` weights of a capability for every client, no restart."""
        validate_capability(capability)
        body = {"w_load": w_load, "w_latency": w_latency, "threshold": threshold}
        await self._config_put(f"weights.{capability}", msgspec.json.encode(body))

    async def set_task_type(self, task_type: str, capability: str) -> None:
        """Let callers ask for ``task_type``; it is served by ``capability``."""
        validate_capability(task_type)
        validate_capability(capability)
        await self._config_put(f"task.{task_type}", capability.encode())
