"""The client: capability requests, direct calls, broadcast publish and subscribe."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.nuid import NUID
from opentelemetry import propagate, trace

from ._codec import decoder_for, encode_payload, error_from_reply, now_ms
from ._config import ConfigMirror, config_bucket
from ._nats import connect_nats, flush_nats
from ._resilience import attempt_budget, backoff_delay
from ._router import FAILOVER, Router
from ._routing import Policy, Weights
from ._subjects import Subjects, validate_agent_id, validate_capability, validate_topic
from ._table import RoutingTable
from .errors import (
    AgentUnavailable,
    Attempt,
    CapabilityNotFound,
    CircuitOpen,
    ConfigurationError,
    ConnectionFailed,
    InvalidReply,
    NotStarted,
    RemoteError,
    RequestTimeout,
    ResourceExhausted,
)
from .settings import ReachSettings
from .wire import AgentRecord, Header, Priority

__all__ = ["Client", "ClientStats", "Reply", "TopicMessage", "TopicSubscription"]

log = logging.getLogger("reach.client")


@dataclass(frozen=True, slots=True)
class Reply:
    """A successful answer: the decoded value plus who answered and how fast."""

    value: Any
    data: bytes
    agent_id: str
    request_id: str
    latency_ms: float
    duration_ms: float | None = None


@dataclass(frozen=True, slots=True)
class ClientStats:
    """Counters of a client's background and bounded machinery (a read-only snapshot)."""

    changes_dropped: int = 0
    background_failures: int = 0
    watch_errors: int = 0
    table_rebuilds: int = 0
    attempts_cancelled: int = 0
    heartbeats_clamped: int = 0


@dataclass(slots=True)  # not frozen: a frozen init costs ~1 µs per request
class _Call:
    """What stays the same across the attempts of one request."""

    capability: str
    data: bytes
    request_id: str | None
    response_type: Any
    affinity_key: str | None
    version: str | None
    tags: tuple[str, ...]
    priority: Priority
    policy: Policy
    table: RoutingTable | None


@dataclass(frozen=True, slots=True)
class TopicMessage:
    """One broadcast notification."""

    topic: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self, type_: Any = Any) -> Any:
        """Decode the body (as ``type_`` when given); raises msgspec.DecodeError if invalid."""
        return decoder_for(type_)(self.data)


_PRIORITIES: dict[object, Priority] = {**{p: p for p in Priority}, **{p.value: p for p in Priority}}


def _expire(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class Client:
    """Calls capabilities and broadcasts; one NATS connection, opened by ``async with``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: ReachSettings | None = None,
        name: str = "",
        routing: Policy | str | None = None,
    ) -> None:
        self.settings = settings if settings is not None else ReachSettings()
        self.url = url or self.settings.nats_url
        self.name = name
        self.subjects = Subjects(self.settings.subject_prefix)
        self._nc: NatsConnection | None = None
        self._owns_nc = True
        self._nuid = NUID()
        self._checked: set[str] = set()
        self._default_timeout = self.settings.timeout_ms / 1000
        self._agent_subjects = f"{self.subjects.prefix}.agent."
        self._inbox = ""
        self._seq = 0
        self._pending: dict[str, asyncio.Future[Msg]] = {}
        self._table: RoutingTable | None = None
        self._table_retry_at = 0.0
        self._table_lock = asyncio.Lock()
        self._config: ConfigMirror | None = None
        self._config_ok = False
        self.routing = Policy(routing or self.settings.routing)
        self.max_attempts = self.settings.max_attempts
        self.retry_base = self.settings.retry_base
        self.retry_cap = self.settings.retry_cap
        self._router = Router(
            breaker_cooldown=self.settings.breaker_cooldown,
            retry_ratio=self.settings.retry_budget,
            rate_limits=self.settings.rate_limits,
            weights={c: Weights(**w) for c, w in self.settings.routing_weights.items()},
            task_types=self.settings.task_types,
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
    def stats(self) -> ClientStats:
        return ClientStats()

    def footprint(self) -> dict[str, int]:
        r = self._router
        t = self._table
        return {
            "table.records": len(t.records) if t else 0,
            "table.listeners": len(t._listeners) if t else 0,
            "table.queued": max((q.qsize() for q in t._listeners), default=0) if t else 0,
            "tasks": 0,
            "router.inflight": len(r.inflight),
            "router.ewma": len(r.ewma),
            "router.instance_breakers": len(r.instance_breakers),
            "router.affinity": len(r.affinity),
            "pending": len(self._pending),
        }

    async def connect(self) -> Self:
        if self._nc is None or self._nc.is_closed:
            self._nc = await connect_nats(
                self.settings, self.url, self.name or "reach-client", reconnected=self.on_reconnect
            )
            self._owns_nc = True
            await self._start_inbox()
        return self

    async def _adopt(self, nc: NatsConnection) -> None:
        """Share a connection owned by someone else (an Agent's)."""
        self._nc, self._owns_nc = nc, False
        await self._start_inbox()

    async def _start_inbox(self) -> None:
        # One wildcard inbox for all replies. The reply subject, less "_INBOX.", is the request
        # id, so a request needs no Reach-Request-Id header (each header costs a parse on both
        # sides); the inbox is unique per connection, so a counter makes it unique per request.
        self._inbox = f"_INBOX.{self._nuid.next().decode()}."
        await self.nc.subscribe(self._inbox + "*", cb=self._on_reply)
        await flush_nats(self.nc)

    async def _on_reply(self, msg: Msg) -> None:
        fut = self._pending.get(msg.subject[len(self._inbox) :])
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def on_reconnect(self) -> None:
        """Rebuild the routing table's watcher (nats-py's own can stay silent for ~15 s)."""
        if self._table is not None:
            self._table.rebuild_soon()
        self._config_ok = False  # restarted on the next request

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
        kv = await config_bucket(self.nc, self.subjects.bucket("config"), create=True)
        body = {"w_load": w_load, "w_latency": w_latency, "threshold": threshold}
        await kv.put(f"weights.{capability}", msgspec.json.encode(body))

    async def set_task_type(self, task_type: str, capability: str) -> None:
        """Let callers ask for ``task_type``; it is served by ``capability``."""
        validate_capability(task_type)
        validate_capability(capability)
        kv = await config_bucket(self.nc, self.subjects.bucket("config"), create=True)
        await kv.put(f"task.{task_type}", capability.encode())

    def _table_due(self) -> bool:
        """Should the table (or the config mirror) be started or rebuilt before routing?
        Checked without awaiting, so the request path pays nothing once both run."""
        table = self._table
        fresh = table is not None and not table.stale and self._config_ok
        return not fresh and time.monotonic() >= self._table_retry_at

    async def _routing_table(self) -> RoutingTable | None:
        """Start following the registry's bucket on first use; None while it is unavailable."""
        if not self._table_due():
            return self._table
        async with self._table_lock:
            if self._table is None:
                self._table = RoutingTable(
                    self.nc,
                    self.subjects.bucket("agents"),
                    silence_limit=max(3 * self.settings.heartbeat_interval, 1.0),
                )
                ok = await self._table.start(self.settings.connect_timeout)
            elif self._table.stale:
                ok = await self._table.rebuild(self.settings.connect_timeout)
            else:
                ok = True
            if self._config is None or not self._config_ok:
                if self._config is None:
                    self._config = ConfigMirror(
                        self.nc, self.subjects.bucket("config"), self._router
                    )
                self._config_ok = await self._config.start(self.settings.connect_timeout)
            if not ok or not self._config_ok:
                # No registry (or config) bucket yet: use the queue group, look again later.
                self._table_retry_at = time.monotonic() + self.settings.heartbeat_interval
        return self._table

    async def agents(self, capability: str | None = None) -> list[AgentRecord]:
        """The routing table: every known instance (of ``capability``), by agent id."""
        table = await self._routing_table()
        if table is None:
            return []
        records = table.offering(capability) if capability else list(table.records.values())
        return sorted(records, key=lambda r: r.info.agent_id)

    async def changes(self) -> AsyncIterator[AgentRecord | str]:
        """Follow the routing table: each record as it is written, an agent id when it goes."""
        table = await self._routing_table()
        if table is None:
            raise NotStarted("no routing table: no registry has created the agents bucket yet")
        queue = table.listen()
        try:
            while True:
                yield await queue.get()
        finally:
            table.unlisten(queue)

    async def _close_table(self) -> None:
        if self._config is not None:
            await self._config.stop()
            self._config = None
        if self._table is not None:
            await self._table.stop()
            self._table = None

    async def close(self) -> None:
        await self._close_table()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionFailed("client closed", url=self.url))
        nc, self._nc = self._nc, None
        if nc is not None and self._owns_nc and not nc.is_closed:
            try:
                await nc.drain()
            except (nats.errors.Error, TimeoutError, OSError) as exc:
                log.debug("drain on close failed: %s", exc)
                await nc.close()

    async def __aenter__(self) -> Self:
        return await self.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _check_capability(self, capability: str) -> None:
        if capability not in self._checked:
            validate_capability(capability)
            if len(self._checked) < 10_000:
                self._checked.add(capability)

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
    ) -> Any:
        """Call ``capability`` and return the decoded answer; errors raise ``ReachError``s."""
        reply = await self.call(
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
    ) -> Reply:
        """Like :meth:`request` but returns the :class:`Reply` (who answered, latency).

        ``capability`` may also be a task type (``REACH_TASK_TYPES`` or the config bucket).
        Routing: ``agent_id`` goes to that instance only and is never substituted.
        Otherwise ``routing`` (default: the client's, ``balanced``) picks among live
        instances in the routing table (UP; DEGRADED too unless priority is high) that offer
        the capability in the same major ``version`` with all ``required_tags``; with no
        instance of it in the table at all, the NATS queue group chooses. An attempt that
        finds nobody, a full queue, an open circuit or no answer in its share of the time
        moves to another instance while the deadline and the retry budget last;
        ``failed`` and ``bad_request`` are never retried. ``hedge=True`` sends one
        duplicate to a second instance after the capability's p95 latency.
        """
        router = self._router
        table = None
        if agent_id is None:
            table = await self._routing_table() if self._table_due() else self._table
        capability = router.resolve(capability)
        self._check_capability(capability)
        prio = _PRIORITIES.get(priority)
        if prio is None:
            raise ConfigurationError(f"priority {priority!r} is invalid; use high, normal or low")
        if agent_id is not None:
            policy = Policy.DIRECT
        elif routing is None:
            policy = self.routing
        else:
            try:
                policy = Policy(routing)
            except ValueError:
                raise ConfigurationError(
                    f"routing {routing!r} is invalid; use balanced, scored, queue or affinity"
                ) from None
        if agent_id is not None:
            validate_agent_id(agent_id)
        wait = self._default_timeout if timeout is None else timeout
        if wait <= 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout}")
        loop = asyncio.get_running_loop()
        now = loop.time()
        refused = router.admit(capability, now)
        if refused is not None:
            cls = ResourceExhausted if refused == "resource_exhausted" else CircuitOpen
            raise cls(
                f"{capability!r} refused by this client: "
                + ("rate limit reached" if refused == "resource_exhausted" else "circuit open"),
                capability=capability,
            )
        deadline = now + wait
        deadline_ms = now_ms() + int(wait * 1000)
        data = encode_payload(payload)
        limit = 1 if policy is Policy.DIRECT else (max_attempts or self.max_attempts)
        base = {Header.DEADLINE: str(deadline_ms)}
        if prio is not Priority.NORMAL:
            base[Header.PRIORITY] = prio.value
        if self.name:
            base[Header.CALLER] = self.name
        if request_id:
            base[Header.REQUEST_ID] = request_id
        if trace.get_current_span().get_span_context().is_valid:
            propagate.inject(base)
        call = _Call(
            capability,
            data,
            request_id,
            response_type,
            affinity_key,
            version,
            tuple(required_tags),
            prio,
            policy,
            table,
        )
        attempts: list[Attempt] = []
        tried: list[str] = []
        router.budget.record_request(now)
        last: RemoteError | None = None
        for n in range(1, limit + 1):
            remaining = deadline - loop.time()
            if remaining <= 0 or (n > 1 and not router.budget.try_retry(loop.time())):
                break
            if policy is Policy.DIRECT:
                target: str | None = agent_id
            elif table is None:
                target = None  # no registry bucket (yet): the queue group decides
            else:
                target = router.choose(
                    policy,
                    table,
                    capability,
                    call.version,
                    call.tags,
                    prio,
                    tried,
                    affinity_key,
                    loop.time(),
                ).agent_id
            headers = base if n == 1 else {**base, Header.ATTEMPT: str(n)}
            budget = attempt_budget(remaining, limit - n + 1)
            started = loop.time()
            try:
                if hedge and policy is not Policy.DIRECT and target is not None:
                    reply = await self._hedged(call, target, headers, budget)
                else:
                    reply = await self._attempt(call, target, headers, budget)
            except RemoteError as exc:
                outcome = exc.outcome
                attempts.append(
                    Attempt(target or exc.agent_id or "", outcome, (loop.time() - started) * 1000)
                )
                if target is not None:
                    tried.append(target)
                last = exc
                if outcome not in FAILOVER or policy is Policy.DIRECT:
                    if outcome in FAILOVER:
                        router.request_done(capability, False, loop.time())
                    exc.attempts = attempts
                    raise
                if target is None and outcome == "no_responders":
                    # Nobody serves it at all: fail fast, no retry, no breaker (no-responders
                    # is already instant); alone, it keeps its plain message.
                    if len(attempts) == 1:
                        exc.attempts = attempts
                        raise
                    break
                if outcome != "no_responders" and n < limit:
                    # Busy or slow: back off (full jitter) before the next instance, within
                    # the deadline. A vanished instance is skipped at once.
                    pause = backoff_delay(n, router.rng, base=self.retry_base, cap=self.retry_cap)
                    pause = min(pause, max(0.0, deadline - loop.time() - 0.001))
                    if pause > 0:
                        await asyncio.sleep(pause)
                continue
            router.request_done(capability, True, loop.time())
            return reply
        if any(a.outcome != "no_responders" for a in attempts):
            router.request_done(capability, False, loop.time())
        raise self._exhausted(capability, attempts, last, wait)

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
        table = await self._routing_table() if self._table_due() else self._table
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
        ).agent_id

    def _exhausted(
        self, capability: str, attempts: list[Attempt], last: RemoteError | None, wait: float
    ) -> RemoteError:
        """The error for a request whose attempts all failed, saying what was tried."""
        tried = "; ".join(
            f"{a.agent_id or 'queue'}: {a.outcome} in {a.duration_ms:.0f} ms" for a in attempts
        )
        outcomes = {a.outcome for a in attempts}
        cls: type[RemoteError]
        if not attempts:
            cls, why = RequestTimeout, f"no time left within {wait:g}s"
        elif outcomes <= {"no_responders", "agent_unavailable"}:
            cls = CapabilityNotFound if all(not a.agent_id for a in attempts) else AgentUnavailable
            why = "no agent alive"
        elif outcomes <= {"resource_exhausted", "circuit_open"}:
            cls, why = ResourceExhausted, "all busy"
        else:
            cls, why = RequestTimeout, f"no answer within {wait:g}s"
        detail = f"; last: {last.message}" if last is not None else ""
        err = cls(
            f"{capability!r}: {why} after {len(attempts)} attempt(s) [{tried}]{detail}",
            capability=capability,
            agent_id=last.agent_id if last is not None else "",
            request_id=last.request_id if last is not None else "",
            attempts=attempts,
        )
        return err

    async def _attempt(
        self, call: _Call, target: str | None, headers: dict[str, str], budget: float
    ) -> Reply:
        router = self._router
        loop = asyncio.get_running_loop()
        router.started(target)
        started = loop.time()
        outcome = "ok"
        subject = (
            self.subjects.agent(target, call.capability)
            if target
            else self.subjects.cap(call.capability)
        )
        try:
            return await self._send(call, subject, headers, budget, target)
        except RemoteError as exc:
            outcome = exc.outcome
            raise
        finally:
            now = loop.time()
            router.finished(
                target,
                call.capability,
                outcome,
                (now - started) * 1000,
                now,
                call.affinity_key if outcome == "ok" else None,
            )

    async def _hedged(
        self, call: _Call, target: str, headers: dict[str, str], budget: float
    ) -> Reply:
        """Send to ``target``; if no answer by the p95, also to a second instance."""
        delay = self._router.hedge_delay(call.capability)
        first = asyncio.ensure_future(self._attempt(call, target, headers, budget))
        if delay is None or delay >= budget:
            return await first
        done, _ = await asyncio.wait({first}, timeout=delay)
        if done:
            return first.result()
        loop = asyncio.get_running_loop()
        try:
            other = self._router.choose(
                call.policy,
                call.table,
                call.capability,
                call.version,
                call.tags,
                call.priority,
                [target],
                None,
                loop.time(),
            ).agent_id
        except RemoteError:
            return await first
        if other is None or other == target:
            return await first
        second = asyncio.ensure_future(self._attempt(call, other, headers, budget - delay))
        pending = {first, second}
        error: BaseException | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        return task.result()
                    error = task.exception()
            assert error is not None
            raise error
        finally:
            for task in pending:
                task.cancel()

    async def _send(
        self,
        call: _Call,
        subject: str,
        headers: dict[str, str],
        wait: float,
        agent_id: str | None,
    ) -> Reply:
        nc = self.nc
        capability, request_id, response_type = call.capability, call.request_id, call.response_type
        self._seq += 1
        token = str(self._seq)
        reply_to = self._inbox + token
        rid = request_id or reply_to[7:]
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = fut
        expiry = loop.call_later(wait, _expire, fut)
        started = time.perf_counter()
        try:
            await nc.publish(subject, call.data, reply=reply_to, headers=headers)
            msg = await fut
        except TimeoutError:
            raise RequestTimeout(
                f"{capability!r} got no answer within {wait:.3g}s",
                capability=capability,
                agent_id=agent_id or "",
                request_id=rid,
            ) from None
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError) as exc:
            raise ConnectionFailed(f"not connected to NATS: {exc}", url=self.url) from exc
        finally:
            expiry.cancel()
            del self._pending[token]
        latency_ms = (time.perf_counter() - started) * 1000
        hdrs = msg.headers
        if hdrs and not msg.data and hdrs.get("Status") == "503":
            err: RemoteError
            if agent_id is not None:
                err = AgentUnavailable(
                    f"agent {agent_id!r} is not serving {capability!r}",
                    capability=capability,
                    agent_id=agent_id,
                    request_id=rid,
                )
            else:
                err = CapabilityNotFound(
                    f"no live agent offers {capability!r}",
                    capability=capability,
                    request_id=rid,
                )
            err.outcome = "no_responders"
            raise err
        if hdrs and Header.SERVICE_ERROR_CODE in hdrs:
            raise error_from_reply(msg.data, hdrs, capability=capability, request_id=rid)
        try:
            value = decoder_for(Any if response_type is None else response_type)(msg.data)
        except msgspec.DecodeError as exc:
            raise InvalidReply(
                f"{capability}: reply does not match {response_type!r}: {exc}",
                capability=capability,
                request_id=rid,
            ) from exc
        served_by, duration = "", None
        via = msg.reply
        if via and via.startswith(self._agent_subjects):
            served_by = via[len(self._agent_subjects) :].partition(".")[0]
        if hdrs:
            served_by = hdrs.get(Header.AGENT, served_by)
            raw = hdrs.get(Header.DURATION_MS)
            if raw:
                try:
                    duration = float(raw)
                except ValueError:
                    duration = None
        return Reply(value, msg.data, served_by, rid, latency_ms, duration)

    async def publish(self, topic: str, payload: Any = None) -> None:
        """Broadcast ``payload`` to every subscriber of ``topic``."""
        validate_topic(topic)
        headers = {Header.CALLER: self.name} if self.name else None
        try:
            await self.nc.publish(
                self.subjects.topic(topic), encode_payload(payload), headers=headers
            )
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError) as exc:
            raise ConnectionFailed(f"not connected to NATS: {exc}", url=self.url) from exc

    async def subscribe(self, topic: str) -> TopicSubscription:
        """Receive every broadcast on ``topic`` (``*`` and ``>`` allowed); flushed on return."""
        validate_topic(topic, wildcards=True)
        sub = await self.nc.subscribe(self.subjects.topic(topic))
        await flush_nats(self.nc)
        return TopicSubscription(self.subjects, sub)

    async def flush(self) -> None:
        """Wait until the server has everything this client sent (e.g. after publish)."""
        await flush_nats(self.nc)


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
        except nats.errors.TimeoutError:
            raise RequestTimeout(f"no message within {timeout}s") from None
        return TopicMessage(self._subjects.topic_of(msg.subject), msg.data, msg.headers or {})

    async def unsubscribe(self) -> None:
        try:
            await self._sub.unsubscribe()
        except nats.errors.Error as exc:
            log.debug("unsubscribe: %s", exc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.unsubscribe()
