"""The client facade: capability requests, direct calls, broadcast publish and subscribe.

Background work (the routing-table and config watches, their watchdog and rebuilds) lives
in ``watches``, under one ``TaskOwner``; ``close()`` cancels and awaits it. The request
path is in ``attempts`` and ``inbox``; routing state is the pure ``reach._routing``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from nats.aio.client import Client as NatsConnection

from .._nats import close_nats, connect_nats, flush_nats, permissions_of
from .._routing import Policy, Router, Weights
from .._subjects import MAX_NAME, Subjects
from .._tasks import Tasks
from .._telemetry.core import Telemetry
from ..errors import ConfigurationError, NotStarted
from ..settings import ReachSettings
from ..wire import AgentRecord, Priority
from .attempts import Requester
from .config import ConfigSink, ConfigWrites
from .durable import DurableTasks
from .inbox import Inbox, Reply
from .metrics import ClientMetrics
from .table import RoutingTable
from .topics import TopicSubscription, publish, subscribe
from .watches import Watches

__all__ = ["Client", "ClientStats"]


log = logging.getLogger("reach.client")


@dataclass(frozen=True, slots=True)
class ClientStats:
    """Counters of a client's background and bounded machinery (a read-only snapshot)."""

    changes_dropped: int = 0  # changes() items dropped (oldest first): a listener lagged
    background_failures: int = 0  # background tasks that crashed (logged; loops restart)
    watch_errors: int = 0  # failures inside the routing-table or config watch
    table_rebuilds: int = 0  # routing-table watches (re)built
    attempts_cancelled: int = 0  # attempts cut short: hedge losers, caller timeouts
    heartbeats_clamped: int = 0  # records whose heartbeat numbers were out of range
    records_ignored: int = 0  # agent records that did not decode or named another key
    config_ignored: int = 0  # config keys whose value could not be used
    permission_violations: int = 0  # publishes and subscriptions the server refused
    replies_ignored: int = 0  # replies naming another instance than the one asked


class Client(DurableTasks, ConfigWrites):
    """Calls capabilities and broadcasts; one NATS connection, opened by ``async with``."""

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
        self.url = url or self.settings.nats_url
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
        self._metrics = ClientMetrics(self._router) if self.telemetry.metrics else None
        self._tasks.tracer = self.telemetry.tracer
        if self._metrics is not None:
            self._tasks.on_final = self._metrics.task_final
        self._unsource: Callable[[], None] | None = None
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
        await self._inbox.open(nc)

    async def on_reconnect(self) -> None:
        """Rebuild the watches (nats-py's own can stay silent for ~15 s after a reconnect),
        and fail over at once the attempts whose work may run twice (their answer may be
        lost)."""
        self._inbox.reconnected()
        self._watches.rebuild_soon()

    async def _start_table(self) -> RoutingTable:
        """Start following the registry's bucket on first use (once; callers share it)."""
        nc = self.nc  # NotStarted before connect
        await self._watches.ensure(nc)
        if self._nc is not nc:
            # closed (and maybe reconnected) meanwhile: a table set now would skip the next
            # connection's start, and its watches would never run
            raise NotStarted("client closed while it started routing")
        self._requests.table = self._table
        return self._table

    # -- reading the table -------------------------------------------------------------

    async def agents(self, capability: str | None = None) -> list[AgentRecord]:
        """The routing table: every known instance (of ``capability``), by agent id."""
        table = await self._start_table()
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
        table = await self._start_table()
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
            "deadlines": self._inbox.deadlines,
            "tasks": len(self._watches.owner),
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
        await self._watches.close()
        await self._tasks.close()
        self._requests.table = None
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

    # -- broadcast ---------------------------------------------------------------------

    async def publish(self, topic: str, payload: Any = None) -> None:
        """Broadcast ``payload`` to every subscriber of ``topic``."""
        await publish(self.nc, self.subjects, self.name, self.url, topic, payload)

    async def subscribe(self, topic: str) -> TopicSubscription:
        """Receive every broadcast on ``topic`` (``*`` and ``>`` allowed); flushed on return."""
        return await subscribe(self.nc, self.subjects, self.url, topic)

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
