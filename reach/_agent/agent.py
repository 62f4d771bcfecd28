"""The Agent: what it serves, start and stop, and the one owner of the agent's lifecycle.

One class, read top to bottom: construction; the decorators that declare what it serves
(capabilities, topics, durable tasks; each refuses once the agent runs); what it shows of
itself (info, heartbeat, counters); its lifecycle; its telemetry; and the process entry
points (``serve_forever``, ``run``). It holds its parts: ``Intake`` (admission),
``Workers`` (running and answering), ``Lifecycle`` (the state machine), ``Presence``
(registry), ``Subscriptions``, ``ControlListeners`` ($ctl, $ping, $SRV) and a
``TaskRunner`` for durable tasks.

Every background coroutine lives in a ``Background``: workers, the deadline watch and the
presence loop in ``_work``; the one stop coroutine in ``_stopper``. SIGTERM, ``$ctl drain``,
``stop()`` and ``async with`` all end in that same stop coroutine: PAUSED (out of the queue
groups), finish in-flight work, deregister, STOPPED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self, TypeVar

from nats.nuid import NUID

from .._background import Background
from .._client import Client
from .._codec import now_ms
from .._contracts.schemas import capability_info, topic_info
from .._handlers import Capable, Handler, TaskContext, inspect_handler
from .._nats import NatsConnection, check_refused, close_nats, connect_nats, flush_nats
from .._runtime import on_stop_signals, run_async
from .._subjects import validate_agent_id, validate_capability, validate_topic
from .._tasks import TaskDecl, TaskRunner, TaskStats
from .._tasks.states import check_timeout
from .._telemetry import configure_logging, configure_tracing
from .._telemetry.core import Attachment, Telemetry
from .._topics import TopicCells, TopicDecl, TopicRunner
from ..errors import ConfigurationError, ReachError
from ..settings import ReachSettings
from ..wire import AgentInfo, CapabilityInfo, Heartbeat, Priority, Status, TopicInfo
from . import srv
from .control import ControlListeners
from .intake import Intake, topic_handler
from .lifecycle import TIMEOUT_WINDOW, Lifecycle, Pause, Reason, State
from .metrics import agent_source
from .model import AgentCells, AgentStats, Served, TopicSpec
from .presence import Presence
from .subscriptions import Subscriptions
from .workers import Workers

__all__ = ["Agent"]

log = logging.getLogger("reach.agent")

C = TypeVar("C", bound=Capable)


class Agent:
    """One running instance of a named agent that serves capabilities.

    Capabilities are served on ``reach.cap.<cap>`` (queue group ``cap.<cap>``: one instance
    takes each request) and ``reach.agent.<agent_id>.<cap>`` (this instance only).
    """

    def __init__(
        self,
        name: str,
        agent_id: str | None = None,
        *,
        tags: list[str] | tuple[str, ...] = (),
        max_concurrency: int | None = None,
        max_queue: int | None = None,
        drain_timeout: float | None = None,
        version: str = "1.0.0",
        description: str = "",
        metadata: dict[str, str] | None = None,
        settings: ReachSettings | None = None,
        url: str | None = None,
        reply_headers: bool = False,
        telemetry: Telemetry | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.settings = settings if settings is not None else ReachSettings()
        #: metrics, spans and health (shared with the agent's client); its own unless passed
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        #: serve /metrics and /healthz on this port while running (0: any free port)
        self.metrics_port = metrics_port if metrics_port is not None else self.settings.metrics_port
        self._attachment: Attachment | None = None
        self._drain_started: float | None = None
        #: how long the last drain took (seconds); None before the first
        self.last_drain_seconds: float | None = None
        try:
            validate_agent_id(name)
            self.agent_id = validate_agent_id(agent_id or f"{name}-{NUID().next().decode()}")
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        self.name = name
        self.tags = list(tags)
        self.version = version
        self.description = description
        self.metadata = dict(metadata or {})
        # None means "as the settings say"; 0 is a value, refused rather than replaced
        self.max_concurrency = (
            self.settings.max_concurrency if max_concurrency is None else max_concurrency
        )
        self.max_queue = self.settings.max_queue if max_queue is None else max_queue
        self.drain_timeout = self.settings.drain_timeout if drain_timeout is None else drain_timeout
        if self.max_concurrency < 1:
            raise ConfigurationError(
                f"max_concurrency={self.max_concurrency}: an agent needs at least one worker;"
                " pass 1 or more, or leave it out for REACH_MAX_CONCURRENCY (default 8)"
            )
        if self.max_queue < 0:
            raise ConfigurationError(
                f"max_queue={self.max_queue}: pass 0 (refuse work when every worker is busy)"
                " or more, or leave it out for REACH_MAX_QUEUE (default 64)"
            )
        # A success reply names its agent in its own reply-to subject (the instance's direct
        # subject): free to parse. Headers on every reply cost ~20% of throughput (measured),
        # so Reach-Agent/Reach-Duration-Ms on success replies are opt-in.
        self.reply_headers = reply_headers
        self.stats = AgentStats()
        self._url = self.settings.nats_url if url is None else url
        self._client = Client(
            self._url, settings=self.settings, name=self.agent_id, telemetry=self.telemetry
        )
        self.subjects = self._client.subjects
        self._caps: dict[str, Served] = {}
        self._topics: list[TopicSpec] = []
        self._topic_infos: list[TopicInfo] = []  # every on_topic, durable or not
        self.task_stats = TaskStats()
        self._tasks = TaskRunner(
            self.agent_id,
            self.settings,
            self.subjects,
            self.task_stats,
            self.settings.task_concurrency or self.max_concurrency,
            context=TaskContext,
        )
        self._tasks.on_exit = self._handler_exit
        self._tasks.on_stuck = lambda n: self._workers.stuck_elsewhere("task", n)
        self._durable_topics = TopicRunner(
            name,
            self.agent_id,
            self.settings,
            self.subjects,
            self.settings.topic_concurrency or self.max_concurrency,
        )
        self._durable_topics.on_exit = self._handler_exit
        self._durable_topics.on_stuck = lambda n: self._workers.stuck_elsewhere("topic", n)
        self._exit: BaseException | None = None  # a handler's SystemExit, for serve_forever
        self._serving = False
        self._nc: NatsConnection | None = None
        self._life = Lifecycle(self._status_changed)
        self._work = Background(f"agent {self.agent_id}")
        self._stopper = Background(f"agent {self.agent_id} lifecycle")
        self._stopping: asyncio.Task[None] | None = None
        self._control_lock = asyncio.Lock()  # start, pause, resume and leaving the queues
        self._drain_requested = asyncio.Event()
        self._subs = Subscriptions(self.agent_id, self.subjects)
        self._started_ms = 0
        self._presence = Presence(
            self.agent_id,
            self.subjects,
            self.settings,
            info=self.info,
            heartbeat=self.heartbeat,
            status=lambda: self._life.status,
            review=lambda: self._workers.review(time.monotonic()),
        )
        self._build()

    def _build(self) -> None:
        """Fresh workers and intake for a (re)start."""
        self._workers = Workers(
            self.agent_id,
            self._client,
            self.stats,
            self._life,
            max_concurrency=self.max_concurrency,
            max_queue=self.max_queue,
            reply_headers=self.reply_headers,
            on_exit=self._handler_exit,
            # DEGRADED by timeouts ends when the timeout window (10 s) and three heartbeats
            # have passed without a new one
            timeout_quiet=max(TIMEOUT_WINDOW, 3 * self.settings.heartbeat_interval),
            streams=self.subjects.streams(self.agent_id),
        )
        self._intake = Intake(self.agent_id, self._workers, self._life, self.stats)

    # -- what it serves, declared before it starts ------------------------------------

    def _check_open(self, name: str, what: str) -> None:
        validate_capability(name)
        if self._life.running:
            raise ConfigurationError(f"add {what} before the agent starts")
        if name in self._caps or name in self._tasks.decls:
            raise ConfigurationError(f"{name!r} is already served by this agent")

    def capability(
        self, name: str, *, version: str = "1.0.0", description: str | None = None
    ) -> Callable[[C], C]:
        """Serve ``name`` with the decorated async function ``(payload[, ctx]) -> result``,
        or with an async generator ``(payload[, ctx])`` whose items are the chunks of a
        streaming reply (``client.stream``): each ``yield`` waits while the caller has
        the window of chunks it allowed still to read.

        Its contract goes out in the agent's registration: ``description`` (the docstring
        unless given) and the JSON Schemas of the payload and result annotations."""
        self._check_open(name, "capabilities")

        def register(fn: C) -> C:
            self._check_open(name, "capabilities")
            spec = inspect_handler(fn, f"capability {name!r}", may_stream=True)
            info = capability_info(
                name, version, fn, description, f"capability {name!r}", streams=spec.streams
            )
            cells = AgentCells() if self.telemetry.metrics else None  # None: metrics are off
            self._caps[name] = Served(info, spec, cells=cells)
            return fn

        return register

    def task(
        self,
        name: str,
        *,
        version: str = "1.0.0",
        description: str | None = None,
        timeout: float | None = None,
        max_attempts: int | None = None,
    ) -> Callable[[Handler], Handler]:
        """Serve ``name`` as a durable task: submitted with ``client.submit``, kept in
        JetStream until an instance runs it to the end. The handler is the same as for a
        capability; its ``ctx`` is a ``TaskContext`` (``task_id``, ``attempt``,
        ``progress()``). ``timeout`` (seconds per attempt) and ``max_attempts`` apply to
        submits that name none (then ``REACH_TASK_TIMEOUT``/``REACH_TASK_MAX_ATTEMPTS``);
        a timeout longer than ``REACH_TASK_RETENTION`` is refused. Its contract is sent
        as a capability's (``description``, the docstring unless given, and schemas)."""
        self._check_open(name, "tasks")
        if timeout is not None and not timeout > 0:
            raise ConfigurationError("timeout must be > 0 seconds")
        if timeout is not None:
            check_timeout(timeout, self._tasks.settings.task_retention, f"task {name!r}")
        if max_attempts is not None and not 1 <= max_attempts <= 100:
            raise ConfigurationError("max_attempts must be between 1 and 100")

        def register(fn: Handler) -> Handler:
            self._check_open(name, "tasks")
            spec = inspect_handler(fn, f"task {name!r}")
            info = capability_info(name, version, fn, description, f"task {name!r}")
            self._tasks.decls[name] = TaskDecl(info, spec, timeout, max_attempts)
            return fn

        return register

    def on_topic(
        self,
        topic: str,
        *,
        durable: bool = False,
        ordered: bool = False,
        description: str | None = None,
    ) -> Callable[[Handler], Handler]:
        """Receive every broadcast on ``topic`` (wildcards allowed), on every instance.

        ``durable=True``: every message stored in stream ``REACH_TOPICS`` while the
        subscription exists reaches this agent *name* at least once, on one of its
        instances (they share a JetStream consumer), also when all of them were away or
        restarting; the message is acknowledged when the handler returns, redelivered
        with backoff when it raises, and dead-lettered after ``REACH_TOPIC_MAX_DELIVER``
        deliveries. ``ordered=True`` (durable only): one message at a time for the
        name, so each topic's messages are handled in the order they were stored.
        ``description`` (the docstring unless given) and the payload's schema go out in
        the agent's registration."""
        validate_topic(topic, wildcards=True)
        if self._life.running:
            raise ConfigurationError("add topic handlers before the agent starts")
        if ordered and not durable:
            raise ConfigurationError(
                f"on_topic({topic!r}, ordered=True) needs durable=True: a plain topic is"
                " already delivered in order to each instance"
            )
        if durable and topic in self._durable_topics.decls:
            raise ConfigurationError(f"topic {topic!r} already has a durable handler")

        def register(fn: Handler) -> Handler:
            spec = inspect_handler(fn, f"topic {topic!r}")
            self._topic_infos.append(
                topic_info(topic, fn, description, durable=durable, ordered=ordered)
            )
            if durable:
                self._durable_topics.decls[topic] = TopicDecl(topic, spec, ordered)
            else:
                self._topics.append(TopicSpec(topic, spec))
            return fn

        return register

    # -- introspection -----------------------------------------------------------------

    @property
    def client(self) -> Client:
        """A client on the agent's own connection, for calling other capabilities."""
        return self._client

    @property
    def state(self) -> State:
        """Where the agent is in its life: STARTING, UP, DEGRADED, PAUSED, DRAINING, STOPPED."""
        return self._life.state

    @property
    def status(self) -> Status:
        """The status it advertises (DRAINING and STARTING show as PAUSED, STOPPED as DOWN)."""
        return self._life.status

    @property
    def presence(self) -> Presence:
        """Registration and heartbeats: ``seq``, ``registered``, ``stop()``."""
        return self._presence

    @property
    def capabilities(self) -> list[CapabilityInfo]:
        return [c.info for c in self._caps.values()]

    @property
    def queue_len(self) -> int:
        return len(self._workers.queue)

    def info(self) -> AgentInfo:
        return AgentInfo(
            agent_id=self.agent_id,
            name=self.name,
            version=self.version,
            capabilities=self.capabilities,
            tasks=[t.info for t in self._tasks.decls.values()],
            tags=self.tags,
            topics=self._topic_infos,
            max_concurrency=self.max_concurrency,
            max_queue=self.max_queue,
            started_ms=self._started_ms,
            metadata=self.metadata,
        )

    def service_snapshot(self) -> srv.ServiceSnapshot:
        """What ``$SRV`` answers say about this instance, as of now."""
        return srv.snapshot(self.info(), self.description, self.subjects, self._caps)

    def heartbeat(self, seq: int = 0) -> Heartbeat:
        s = self.stats
        return Heartbeat(
            agent_id=self.agent_id,
            status=self._life.status,
            seq=seq,
            inflight=s.inflight,
            queue_len=len(self._workers.queue),
            load=s.inflight / self.max_concurrency,
            latency_ms=round(s.latency_ewma_ms, 3),
            served=s.served,
            failed=s.failed,
            dropped=s.expired,
            sent_ms=now_ms(),
            reason=self._life.explain(self._workers.details()),
        )

    @property
    def metrics_url(self) -> str | None:
        """Where ``/metrics`` and ``/healthz`` are served while the agent runs, if asked."""
        return self._attachment.url if self._attachment is not None else None

    def cells(self) -> dict[str, AgentCells]:
        """Per capability, what the workers counted (empty when metrics are off)."""
        return {name: c.cells for name, c in self._caps.items() if c.cells is not None}

    def queue_lengths(self) -> dict[Priority, int]:
        return self._workers.queue.lengths()

    def task_outcomes(self) -> dict[tuple[str, str], int]:
        """Task attempts by (capability, outcome)."""
        return dict(self._tasks.outcomes)

    def topic_cells(self) -> dict[str, TopicCells]:
        """Per durable topic pattern, what this instance's subscription did (delivered,
        acked, redelivered, failed, dead-lettered, and the name's lag as last sampled)."""
        return self._durable_topics.cells()

    # -- lifecycle ---------------------------------------------------------------------

    def _status_changed(self, status: Status) -> None:
        """The lifecycle's one listener: tell the registry now, not at the next tick."""
        self._presence.nudge()

    async def start(self) -> None:
        """Connect, subscribe and flush: once this returns, requests reach the agent."""
        async with self._control_lock:
            if not self._life.start():
                return  # already running (or stopping)
            self._stopping = None
            self._drain_requested.clear()
            self._build()
            nc: NatsConnection | None = None
            try:
                nc = await connect_nats(
                    self.settings, self._url, self.agent_id, reconnected=self._reconnected
                )
                self._nc = nc
                await self._client._adopt(nc)
                await self._expose()
                self._started_ms = now_ms()
                self._work.reopen()
                self._workers.start(nc, self._work)
                self._intake.accepting = True
                self._presence.attach(nc)
                await self._subs.subscribe(
                    nc,
                    self._caps,
                    self._intake.handler_for,
                    ControlListeners(self, nc),
                    on_event=self._presence.on_event,
                    streams=(
                        self._workers.outflows.on_control
                        if any(c.spec.streams for c in self._caps.values())
                        else None
                    ),
                    topics=[
                        (
                            t.pattern,
                            topic_handler(
                                self.agent_id, self.subjects, t, self.stats, self._handler_exit
                            ),
                        )
                        for t in self._topics
                    ],
                )
                await self._tasks.start(
                    nc, self._work, self._client, self.tags, lambda: self._stopping is not None
                )
                await self._durable_topics.start(nc, self._work, lambda: self._stopping is not None)
                await flush_nats(nc)
                self._life.started()
                # One registration attempt now (no-responders answers at once when no
                # registry runs); the presence loop retries with backoff and heartbeats.
                await self._presence.register()
                check_refused(nc, f"agent {self.agent_id} start")  # SUBs and PUBs so far
                self._presence.start(self._work)
            except BaseException as exc:
                await self._close(deregister=False, started=False)
                check_refused(nc, f"agent {self.agent_id} start", exc)  # the cause, if it was
                raise
        log.info("agent %s serving %s", self.agent_id, self._serving_what())

    async def _reconnected(self) -> None:
        await self._client.on_reconnect()
        self._durable_topics.reconnected()

    def _serving_what(self) -> str:
        """What the start log says it serves: capabilities by request, then tasks
        ("a, b; tasks c"), or "no capabilities"."""
        parts = [", ".join(self._caps)] if self._caps else []
        if self._tasks.decls:
            parts.append("tasks " + ", ".join(self._tasks.decls))
        return "; ".join(parts) or "no capabilities"

    async def pause(self) -> None:
        """The operator's pause (a health check's is apart): take no new work, leave the
        queue groups (direct calls get ``agent_unavailable``); running work goes on."""
        await self._pause(Pause.OPERATOR)

    async def resume(self) -> None:
        """Undo ``pause``: UP (or DEGRADED) unless a health check's pause holds too."""
        await self._resume(Pause.OPERATOR)

    async def report_health(self, healthy: bool, *, pause: bool = False) -> bool:
        """An outside health signal (a wrapped service's probe): False makes the agent
        DEGRADED (with ``pause``, PAUSED too) until True. True if the state changed."""
        before = self._life.state
        if healthy:
            self._life.recover(Reason.HEALTH)
            if Pause.HEALTH in self._life.paused_by:
                await self._resume(Pause.HEALTH)
        else:
            self._life.degrade(Reason.HEALTH)
            if pause and Pause.HEALTH not in self._life.paused_by:
                await self._pause(Pause.HEALTH)
        return self._life.state is not before

    async def _pause(self, by: Pause) -> None:
        async with self._control_lock:
            if self._life.pause(by) and self._nc is not None:
                await self._subs.leave_queues(self._nc)
                await self._tasks.pause()
                await self._durable_topics.pause()

    async def _resume(self, by: Pause) -> None:
        async with self._control_lock:
            nc = self._nc
            if nc is None:
                return
            if not self._life.resumes(by):
                self._life.resume(by)  # another pause holds: only this one is dropped
                return
            await self._subs.join_queues(nc, self._caps)
            await flush_nats(nc)
            await self._tasks.resume()
            await self._durable_topics.resume()
            # A drain that began meanwhile refuses this; it leaves the queues next.
            self._life.resume(by)

    def request_drain(self) -> None:
        """Drain and stop in the background (``$ctl drain``, SIGTERM): the same path as
        ``stop()``, which then just waits for it."""
        self._drain_requested.set()
        self._begin_stop(graceful=True)

    def register_again(self) -> None:
        self._presence.register_again()

    async def wait_drain_requested(self) -> None:
        """Return when a ``drain`` command arrived or the agent stopped."""
        await self._drain_requested.wait()

    def _begin_stop(self, *, graceful: bool) -> asyncio.Task[None] | None:
        """Start the one stop coroutine (or return the one already running)."""
        if self._stopping is None:
            if not self._life.running:
                return None
            self._life.drain()
            self._stopping = self._stopper.spawn(self._shutdown(graceful), "stop")
        return self._stopping

    async def stop(self) -> None:
        """Graceful: PAUSED, out of the queue groups, finish in-flight work (within
        ``drain_timeout``), deregister, close. Waits for a drain already under way."""
        task = self._begin_stop(graceful=True)
        if task is not None:
            await asyncio.shield(task)

    async def _shutdown(self, graceful: bool) -> None:
        try:
            # The lock: after a start under way has finished, and before any resume.
            async with self._control_lock:
                if graceful and self._nc is not None:
                    await self._presence.send_heartbeat()  # routing stops before we do
                    await self._subs.leave_queues(self._nc)
            if graceful:
                self._drain_began()
                idle, tasks_done, topics_done = await asyncio.gather(
                    self._workers.wait_idle(self.drain_timeout),
                    self._tasks.drain(self.drain_timeout),
                    self._durable_topics.drain(self.drain_timeout),
                )
                if not (idle and tasks_done and topics_done):
                    log.warning(
                        "agent %s: in-flight work outlived drain_timeout (%ss)",
                        self.agent_id,
                        self.drain_timeout,
                    )
                self._drain_ended()
                # Routing stops before we do: deregister once the registry shows PAUSED.
                await self._presence.seen_as(Status.PAUSED, self.settings.probe_timeout)
        finally:
            await self._close(deregister=graceful)

    async def _close(self, *, deregister: bool, started: bool = True) -> None:
        """Close everything; ``started`` False after a failed start (whose error says why:
        no "stopped" line beside it)."""
        if self._life.state is State.STOPPED:
            return  # a failed start closed it already
        self._intake.accepting = False
        try:
            await self._presence.stop()
            await self._workers.close(self._work)
            await self._tasks.close()
            await self._durable_topics.close()
            if deregister and self._presence.registered:
                await self._presence.deregister()
            self._presence.attach(None)
            await self._client.close()
        finally:
            await self._hide()
            # Whatever failed above, the agent is stopped, not stuck in DRAINING.
            nc, self._nc = self._nc, None
            if nc is not None and nc.is_connected:
                await self._subs.withdraw(nc)
            self._subs.forget()
            await self._intake.close()
            if nc is not None:
                await close_nats(nc, drain=False)
            self._life.stopped()
            self._drain_requested.set()
            log.log(logging.INFO if started else logging.DEBUG, "agent %s stopped", self.agent_id)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        task = self._begin_stop(graceful=et is None)
        if task is not None:
            await asyncio.shield(task)

    # -- telemetry: spans, the metrics source, the health check, the port -------------

    async def _expose(self) -> None:
        """At start: spans on, the source and health check added, the port served."""
        self._workers.tracer = self._tasks.tracer = self.telemetry.tracer
        if self._attachment is None:
            self._attachment = await self.telemetry.attach(
                f"agent {self.agent_id}",
                agent_source(self),
                self._healthy,
                self.metrics_port,
                self.settings.metrics_host,
            )

    def _healthy(self) -> bool:
        nc = self._nc
        return nc is not None and nc.is_connected

    async def _hide(self) -> None:
        """At stop: the port closed, the source and check removed."""
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            await attachment.close()

    def _drain_began(self) -> None:
        self._drain_started = time.monotonic()

    def _drain_ended(self) -> None:
        if self._drain_started is not None:
            self.last_drain_seconds = time.monotonic() - self._drain_started
            self._drain_started = None

    # -- as a whole process ----------------------------------------------------------

    def _handler_exit(self, exc: BaseException) -> bool:
        """A handler raised SystemExit or KeyboardInterrupt. Under ``serve_forever`` the
        agent drains as on SIGTERM (other work in flight finishes) and ``serve_forever``
        raises it; True then. Otherwise it propagates as Python would: asyncio ends the
        loop abruptly, under everything still running."""
        if not self._serving:
            return False
        if self._exit is None:
            self._exit = exc
        self.request_drain()
        return True

    async def serve_forever(self) -> None:
        """Start, serve until SIGTERM/SIGINT, ``$ctl drain`` or cancellation, then drain and
        stop. A second Ctrl-C while it drains ends the process at once (status 130)."""
        self._serving, self._exit = True, None
        draining = f"draining in-flight work for up to {self.drain_timeout:g}s"
        # The drain is inside the block: a second Ctrl-C during it is heard.
        with on_stop_signals(lambda _: self.request_drain(), draining=draining):
            try:
                await self.start()
                await self._drain_requested.wait()
                log.info("agent %s: draining", self.agent_id)
            finally:
                await self.stop()
                self._serving = False
        if self._exit is not None:
            raise self._exit

    def run(self) -> None:
        """Blocking entry point for a process that is one agent (uses uvloop when present).
        Logs go to stderr as ``REACH_LOG_FORMAT`` says, unless logging is set up already;
        spans are exported as ``REACH_TRACE_EXPORTER`` says, unless a tracer is set. A
        ``ReachError`` (NATS out of reach, credentials refused) ends the process with one
        ``error: <code>: <message>`` line on stderr and status 1."""
        if not logging.getLogger().handlers:
            configure_logging(self.settings.log_format, self.settings.log_level)
        provider = None
        if self.telemetry.tracer is None and self.telemetry.tracing:
            provider = configure_tracing(self.settings, self.name)
            if provider is not None:
                self.telemetry.tracer = provider.get_tracer("reach")
        try:
            run_async(self.serve_forever())
        except ReachError as exc:
            # A program's entry point: one line that says what to do and a non-zero status,
            # not a traceback (a start that cannot connect or is refused ends here).
            raise SystemExit(f"error: {exc.code}: {exc.message}") from None
        finally:
            if provider is not None:
                provider.shutdown()  # export what is buffered
