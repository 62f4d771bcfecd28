"""The agent runtime: subscriptions, a bounded priority queue, workers, graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import msgspec
import nats.errors
from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.nuid import NUID

from . import _srv
from ._client import Client
from ._codec import encode_json, encode_payload, error_reply, now_ms
from ._handlers import Context, Handler, HandlerSpec, inspect_handler
from ._nats import connect_nats, flush_nats
from ._runtime import run_async
from ._scheduler import WorkQueue
from ._subjects import validate_agent_id, validate_capability, validate_topic
from .errors import ConfigurationError, NotStarted, RemoteError
from .settings import ReachSettings
from .wire import (
    AgentInfo,
    CapabilityInfo,
    Control,
    ControlReply,
    Deregistration,
    ErrorCode,
    Header,
    Heartbeat,
    Priority,
    RegisterReply,
    Registration,
    Status,
)

__all__ = ["Agent"]

log = logging.getLogger("reach.agent")

_PRIORITIES = {p.value: p for p in Priority}
_register_reply = msgspec.json.Decoder(RegisterReply)
_control = msgspec.json.Decoder(Control)
_EWMA_ALPHA = 0.2
_DEADLINE_SWEEP = 0.05
_TIMEOUTS_TO_DEGRADE = 3
_TIMEOUT_WINDOW = 10.0
_RECOVER_AFTER = 10


@dataclass(slots=True)
class _Capability:
    info: CapabilityInfo
    spec: HandlerSpec
    direct: str = ""
    handler: Callable[[Msg], Any] | None = None
    requests: int = 0
    errors: int = 0
    processing_ns: int = 0
    last_error: str = ""


@dataclass(slots=True)
class _Job:
    msg: Msg
    cap: _Capability
    priority: Priority
    deadline_ms: int | None
    request_id: str
    expired: bool = False


@dataclass(slots=True)
class _Topic:
    pattern: str
    spec: HandlerSpec


@dataclass(slots=True)
class AgentStats:
    """Counters an agent keeps about itself (also reported in heartbeats and $SRV.STATS)."""

    served: int = 0
    failed: int = 0
    rejected: int = 0
    expired: int = 0
    invalid: int = 0
    inflight: int = 0
    latency_ewma_ms: float = 0.0


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
    ) -> None:
        self.settings = settings if settings is not None else ReachSettings()
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
        self.max_concurrency = max_concurrency or self.settings.max_concurrency
        self.max_queue = self.settings.max_queue if max_queue is None else max_queue
        self.drain_timeout = self.settings.drain_timeout if drain_timeout is None else drain_timeout
        if self.max_concurrency < 1 or self.max_queue < 0:
            raise ConfigurationError("max_concurrency must be >= 1 and max_queue >= 0")
        # A success reply names its agent in its own reply-to subject (the instance's direct
        # subject): free to parse. Headers on every reply cost ~20% of throughput (measured),
        # so Reach-Agent/Reach-Duration-Ms on success replies are opt-in.
        self.reply_headers = reply_headers
        self.status = Status.UP
        self.stats = AgentStats()
        self._url = url or self.settings.nats_url
        self._client = Client(self._url, settings=self.settings, name=self.agent_id)
        self.subjects = self._client.subjects
        self._caps: dict[str, _Capability] = {}
        self._topics: list[_Topic] = []
        self._nc: NatsConnection | None = None
        self._queue: WorkQueue[_Job] = WorkQueue(self.max_queue)
        self._queue_subs: list[Subscription] = []
        self._direct_subs: list[Subscription] = []
        self._other_subs: list[Subscription] = []
        self._hb_now = asyncio.Event()
        self._hb_seq = 0
        self._hb_interval = self.settings.heartbeat_interval
        self._need_register = True
        self._registered = False
        self._overloaded = False
        self._timeout_degraded = False
        self._timeouts: deque[float] = deque()
        self._recoveries = 0
        self._paused = False
        self._drain_requested = asyncio.Event()
        self._tasks: asyncio.TaskGroup | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._outstanding = 0
        self._deadlines: dict[asyncio.Task[Any], _Job] = {}
        self._deadline_armed = asyncio.Event()
        self._running = False
        self._accepting = False
        self._idle = asyncio.Event()
        self._started_ms = 0
        self._stop_lock: asyncio.Lock | None = None

    # -- declaration -------------------------------------------------------------------

    def capability(
        self, name: str, *, version: str = "1.0", description: str = ""
    ) -> Callable[[Handler], Handler]:
        """Serve ``name`` with the decorated async function ``(payload[, ctx]) -> result``."""
        validate_capability(name)
        if self._running:
            raise ConfigurationError("add capabilities before the agent starts")

        def register(fn: Handler) -> Handler:
            if name in self._caps:
                raise ConfigurationError(f"capability {name!r} is already served by this agent")
            spec = inspect_handler(fn, f"capability {name!r}")
            info = CapabilityInfo(name=name, version=version, description=description)
            self._caps[name] = _Capability(info, spec)
            return fn

        return register

    def on_topic(self, topic: str) -> Callable[[Handler], Handler]:
        """Receive every broadcast on ``topic`` (wildcards allowed), on every instance."""
        validate_topic(topic, wildcards=True)
        if self._running:
            raise ConfigurationError("add topic handlers before the agent starts")

        def register(fn: Handler) -> Handler:
            self._topics.append(_Topic(topic, inspect_handler(fn, f"topic {topic!r}")))
            return fn

        return register

    # -- introspection -----------------------------------------------------------------

    @property
    def client(self) -> Client:
        """A client on the agent's own connection, for calling other capabilities."""
        return self._client

    @property
    def capabilities(self) -> list[CapabilityInfo]:
        return [c.info for c in self._caps.values()]

    @property
    def queue_len(self) -> int:
        return len(self._queue)

    def info(self) -> AgentInfo:
        return AgentInfo(
            agent_id=self.agent_id,
            name=self.name,
            version=self.version,
            capabilities=self.capabilities,
            tags=self.tags,
            max_concurrency=self.max_concurrency,
            max_queue=self.max_queue,
            started_ms=self._started_ms,
            metadata=self.metadata,
        )

    def heartbeat(self, seq: int = 0) -> Heartbeat:
        s = self.stats
        return Heartbeat(
            agent_id=self.agent_id,
            status=self.status,
            seq=seq,
            inflight=s.inflight,
            queue_len=len(self._queue),
            load=s.inflight / self.max_concurrency,
            latency_ms=round(s.latency_ewma_ms, 3),
            served=s.served,
            failed=s.failed,
            dropped=s.expired,
            sent_ms=now_ms(),
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, subscribe and flush: once this returns, requests reach the agent."""
        if self._running:
            return
        self._stop_lock = asyncio.Lock()
        self._nc = await connect_nats(
            self.settings, self._url, self.agent_id, reconnected=self._client.on_reconnect
        )
        await self._client._adopt(self._nc)
        self._started_ms = now_ms()
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        self._running = True
        self._accepting = True
        self.status = Status.UP
        self._idle.set()
        try:
            self._workers = [
                self._tasks.create_task(self._worker()) for _ in range(self.max_concurrency)
            ]
            self._workers.append(self._tasks.create_task(self._deadline_watch()))
            await self._subscribe()
            await flush_nats(self._nc)
            # One registration attempt now (no-responders answers at once when no registry
            # runs); the presence loop retries with backoff and heartbeats from here on.
            await self._register()
            self._workers.append(self._tasks.create_task(self._presence()))
        except BaseException:
            await self._shutdown(drain=False)
            raise
        log.info("agent %s serving %s", self.agent_id, ", ".join(self._caps) or "no capabilities")

    async def _subscribe(self) -> None:
        nc = self._conn()
        for name, cap in self._caps.items():
            cap.direct = self.subjects.agent(self.agent_id, name)
            cap.handler = self._request_handler(cap)
            self._direct_subs.append(await nc.subscribe(cap.direct, cb=cap.handler))
        await self._subscribe_queues()
        self._other_subs.append(
            await nc.subscribe(self.subjects.ping(self.agent_id), cb=self._on_ping)
        )
        self._other_subs.append(
            await nc.subscribe(self.subjects.ctl(self.agent_id), cb=self._on_ctl)
        )
        for topic in self._topics:
            self._other_subs.append(
                await nc.subscribe(
                    self.subjects.topic(topic.pattern), cb=self._topic_handler(topic)
                )
            )
        for subject in _srv.subjects(self.name, self.agent_id):
            self._other_subs.append(await nc.subscribe(subject, cb=self._on_srv))

    async def _subscribe_queues(self) -> None:
        nc = self._conn()
        for name, cap in self._caps.items():
            self._queue_subs.append(
                await nc.subscribe(
                    self.subjects.cap(name), queue=self.subjects.cap_queue(name), cb=cap.handler
                )
            )

    async def _drain_subs(self, subs: list[Subscription]) -> None:
        # Drain (not unsubscribe) so requests already delivered to us are still served.
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.drain()  # type: ignore[no-untyped-call]
        subs.clear()

    async def stop(self) -> None:
        """Graceful: PAUSED, stop taking work, finish in-flight (``drain_timeout``),
        deregister, close."""
        await self._shutdown(drain=True)

    async def pause(self) -> None:
        """Take no new work (queue groups route elsewhere; direct calls are refused)."""
        if not self._running or self.status == Status.PAUSED:
            return
        self._paused = True
        self._set_status(Status.PAUSED)
        await self._drain_subs(self._queue_subs)

    async def resume(self) -> None:
        if not self._running or self.status != Status.PAUSED or self._drain_requested.is_set():
            return
        await self._subscribe_queues()
        await flush_nats(self._conn())
        self._paused = False
        self._set_status(Status.UP)

    def _set_status(self, status: Status) -> None:
        """Change status and tell the registry now, not at the next heartbeat tick."""
        if status != self.status:
            self.status = status
            self._hb_now.set()

    async def _shutdown(self, *, drain: bool) -> None:
        if not self._running or self._stop_lock is None:
            return
        async with self._stop_lock:
            if not self._running:
                return
            self.status = Status.PAUSED
            if drain:
                await self._send_heartbeat()  # routing stops before we do
                await self._drain_subs(self._queue_subs)
                await self._drain_subs(self._direct_subs)
                self._accepting = False
                if not self._is_idle():
                    self._idle.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.drain_timeout):
                            await self._idle.wait()
            self._accepting = False
            self._running = False
            tasks, self._tasks = self._tasks, None
            for worker in self._workers:
                worker.cancel()
            self._workers = []
            if tasks is not None:
                await tasks.__aexit__(None, None, None)
            for job in self._queue.drain():
                self._outstanding -= 1
                await self._reply_error(
                    job.msg, ErrorCode.AGENT_UNAVAILABLE, "agent stopped before running the request"
                )
            if drain and self._registered:
                await self._deregister()
            await self._client._close_table()
            nc, self._nc = self._nc, None
            self._queue_subs.clear()
            self._direct_subs.clear()
            self._other_subs.clear()
            if nc is not None and not nc.is_closed:
                with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                    await nc.close()
            self.status = Status.DOWN
            self._drain_requested.set()
            log.info("agent %s stopped", self.agent_id)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._shutdown(drain=et is None)

    async def serve_forever(self) -> None:
        """Start, serve until SIGTERM/SIGINT (or cancellation), then drain and stop."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        installed: list[signal.Signals] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
        try:
            await self.start()
            done = asyncio.ensure_future(self._drain_requested.wait())
            signalled = asyncio.ensure_future(stop.wait())
            await asyncio.wait((done, signalled), return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
            signalled.cancel()
            log.info("agent %s: draining", self.agent_id)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            await self.stop()

    def run(self) -> None:
        """Blocking entry point for a process that is one agent (uses uvloop when present)."""
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        run_async(self.serve_forever())

    # -- request path ------------------------------------------------------------------

    def _conn(self) -> NatsConnection:
        if self._nc is None:
            raise NotStarted(f"agent {self.agent_id} is not started")
        return self._nc

    def _is_idle(self) -> bool:
        return self._outstanding == 0

    def _request_handler(self, cap: _Capability) -> Callable[[Msg], Any]:
        async def on_request(msg: Msg) -> None:
            try:
                await self._accept(msg, cap)
            except Exception:
                # A bug of ours must cost one request, never the subscription.
                log.exception("agent %s: could not accept a request", self.agent_id)
                await self._reply_error(msg, ErrorCode.FAILED, "agent could not accept request")

        return on_request

    async def _accept(self, msg: Msg, cap: _Capability) -> None:
        """Runs in the subscription's task: validate cheaply, then queue or refuse at once."""
        if not msg.reply:
            self.stats.invalid += 1
            return
        priority = Priority.NORMAL
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
        if not self._accepting:
            await self._reply_error(msg, ErrorCode.AGENT_UNAVAILABLE, "agent is stopping")
            return
        if priority is Priority.HIGH and self.status == Status.DEGRADED:
            self.stats.rejected += 1
            await self._reply_error(
                msg,
                ErrorCode.RESOURCE_EXHAUSTED,
                f"agent {self.agent_id} is DEGRADED: high priority goes to an UP instance",
            )
            return
        if self._paused and msg.subject == cap.direct:
            # Paused: queue groups already route elsewhere; direct callers must go elsewhere.
            await self._reply_error(msg, ErrorCode.AGENT_UNAVAILABLE, "agent is paused")
            return
        job = _Job(msg, cap, priority, deadline, request_id)
        if not self._queue.offer(priority, job):
            self.stats.rejected += 1
            await self._reply_error(
                msg,
                ErrorCode.RESOURCE_EXHAUSTED,
                f"agent {self.agent_id} is full ({self.max_queue} queued)",
            )
            return
        self._outstanding += 1
        self._idle.clear()
        if (
            self.max_queue
            and len(self._queue) * 5 >= self.max_queue * 4
            and (self.status == Status.UP)
        ):
            self._overloaded = True
            self._set_status(Status.DEGRADED)

    async def _bad_header(self, msg: Msg, reason: str) -> None:
        self.stats.invalid += 1
        await self._reply_error(msg, ErrorCode.BAD_REQUEST, reason)

    async def _worker(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        while True:
            job = await self._queue.get()
            self.stats.inflight += 1
            try:
                await self._run(job, task)
            except asyncio.CancelledError:
                # Stopped past drain_timeout: tell the caller instead of leaving it waiting.
                await self._reply_error(
                    job.msg, ErrorCode.AGENT_UNAVAILABLE, "agent stopped while running the request"
                )
                raise
            finally:
                self.stats.inflight -= 1
                self._outstanding -= 1
                if self._outstanding == 0:
                    self._idle.set()
                if self._overloaded and len(self._queue) * 4 <= self.max_queue:
                    self._overloaded = False
                    if self.status == Status.DEGRADED and not self._timeout_degraded:
                        self._set_status(Status.UP)

    async def _run(self, job: _Job, task: asyncio.Task[Any]) -> None:
        cap, msg = job.cap, job.msg
        if job.deadline_ms is not None and job.deadline_ms <= now_ms():
            self.stats.expired += 1
            return
        started = time.perf_counter_ns()
        cap.requests += 1
        try:
            payload = cap.spec.decode(msg.data)
        except msgspec.DecodeError as exc:
            self._count_error(cap, str(exc))
            self.stats.invalid += 1
            await self._reply_error(msg, ErrorCode.BAD_REQUEST, f"invalid payload: {exc}")
            return
        args: tuple[Any, ...] = (payload,)
        if cap.spec.wants_context:
            args = (payload, self._context(job))
        if job.deadline_ms is not None:
            self._deadlines[task] = job
            if not self._deadline_armed.is_set():
                self._deadline_armed.set()
        try:
            result = await cap.spec.fn(*args)
            body = encode_payload(result)
        except asyncio.CancelledError:
            if not job.expired:
                raise
            task.uncancel()
            self._handler_timed_out()
            self._count_error(cap, "deadline passed while running")
            await self._reply_error(msg, ErrorCode.TIMEOUT, "deadline passed while running")
            return
        except RemoteError as exc:
            # A handler may refuse deliberately with a protocol error; its message is meant
            # for the caller.
            self._count_error(cap, exc.message)
            await self._reply_error(msg, ErrorCode(exc.code), exc.message)
            return
        except Exception:
            self._handler_failed(job)
            await self._reply_error(
                msg, ErrorCode.FAILED, f"handler failed (request id {job.request_id or '-'})"
            )
            return
        finally:
            if job.deadline_ms is not None:
                self._deadlines.pop(task, None)
        if self._timeout_degraded:
            self._recoveries += 1
            if self._recoveries >= _RECOVER_AFTER:
                self._timeout_degraded = False
                self._timeouts.clear()
                if self.status == Status.DEGRADED and not self._overloaded:
                    self._set_status(Status.UP)
        elapsed = time.perf_counter_ns() - started
        cap.processing_ns += elapsed
        ms = elapsed / 1e6
        s = self.stats
        s.served += 1
        s.latency_ewma_ms = (
            ms if s.served == 1 else s.latency_ewma_ms + _EWMA_ALPHA * (ms - s.latency_ewma_ms)
        )
        headers = None
        if self.reply_headers:
            headers = {Header.AGENT: self.agent_id, Header.DURATION_MS: f"{ms:.3f}"}
        try:
            await self._conn().publish(msg.reply, body, reply=cap.direct, headers=headers)
        except (nats.errors.Error, OSError) as exc:
            log.warning("agent %s: reply to %s lost: %s", self.agent_id, job.request_id, exc)

    def _handler_timed_out(self) -> None:
        """3 handler timeouts within 10 s: DEGRADED (no high priority) until 10 successes."""
        now = time.monotonic()
        self._timeouts.append(now)
        while self._timeouts and self._timeouts[0] < now - _TIMEOUT_WINDOW:
            self._timeouts.popleft()
        self._recoveries = 0
        if len(self._timeouts) >= _TIMEOUTS_TO_DEGRADE and not self._timeout_degraded:
            self._timeout_degraded = True
            if self.status == Status.UP:
                self._set_status(Status.DEGRADED)

    async def _deadline_watch(self) -> None:
        """Cancel handlers still running past their caller's deadline.

        One sweep every 50 ms while handlers with deadlines run, instead of a timer per
        request: per-request asyncio.timeout cost ~10% of throughput; the price is up to
        50 ms of overrun. Idle agents do not wake up.
        """
        while True:
            if not self._deadlines:
                self._deadline_armed.clear()
                await self._deadline_armed.wait()
            await asyncio.sleep(_DEADLINE_SWEEP)
            now = now_ms()
            for task, job in list(self._deadlines.items()):
                if not job.expired and job.deadline_ms is not None and job.deadline_ms <= now:
                    job.expired = True
                    task.cancel()

    def _handler_failed(self, job: _Job) -> None:
        self._count_error(job.cap, "handler raised")
        log.exception(
            "agent %s: handler for %s failed (request id %s)",
            self.agent_id,
            job.cap.info.name,
            job.request_id or "-",
        )

    def _count_error(self, cap: _Capability, reason: str) -> None:
        cap.errors += 1
        cap.last_error = reason
        self.stats.failed += 1

    def _context(self, job: _Job) -> Context:
        hdrs = job.msg.headers or {}
        try:
            attempt = int(hdrs.get(Header.ATTEMPT, "1"))
        except ValueError:
            attempt = 1
        return Context(
            agent=self,
            capability=job.cap.info.name,
            request_id=job.request_id,
            priority=job.priority,
            deadline_ms=job.deadline_ms,
            caller=hdrs.get(Header.CALLER, ""),
            attempt=attempt,
            headers=dict(hdrs),
        )

    async def _reply_error(self, msg: Msg, code: ErrorCode, message: str) -> None:
        body, headers = error_reply(code, message, self.agent_id)
        nc = self._nc
        if nc is None or not msg.reply:
            return
        try:
            await nc.publish(msg.reply, body, headers=headers)
        except (nats.errors.Error, OSError) as exc:
            log.warning("agent %s: error reply lost: %s", self.agent_id, exc)

    # -- presence: registration and heartbeats -----------------------------------------

    async def _register(self) -> bool:
        body = encode_json(Registration(info=self.info(), status=self.status))
        try:
            msg = await self._conn().request(
                self.subjects.registry("register"), body, timeout=self.settings.probe_timeout
            )
            if msg.headers and Header.SERVICE_ERROR_CODE in msg.headers:
                log.warning(
                    "agent %s: registry refused registration: %s",
                    self.agent_id,
                    msg.headers.get(Header.SERVICE_ERROR, ""),
                )
                return False
            reply = _register_reply.decode(msg.data)
        except (nats.errors.Error, msgspec.DecodeError, TimeoutError, OSError) as exc:
            log.debug("agent %s: registration failed: %s", self.agent_id, exc)
            return False
        self._hb_interval = min(reply.heartbeat_interval, self.settings.heartbeat_interval)
        self._need_register = False
        self._registered = True
        log.info("agent %s registered with %s", self.agent_id, reply.registry or "a registry")
        return True

    async def _deregister(self) -> None:
        body = encode_json(Deregistration(agent_id=self.agent_id))
        with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
            await self._conn().request(
                self.subjects.registry("deregister"), body, timeout=self.settings.probe_timeout
            )

    async def _send_heartbeat(self) -> None:
        self._hb_seq += 1
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._conn().publish(
                self.subjects.heartbeat(self.agent_id), encode_json(self.heartbeat(self._hb_seq))
            )

    async def _presence(self) -> None:
        """Heartbeat every interval (at once on a status change); register until it works."""
        loop = asyncio.get_running_loop()
        backoff = self.settings.register_backoff
        register_at = loop.time() + random.uniform(0, backoff) if self._need_register else 0.0
        while True:
            now = loop.time()
            if self._need_register and now >= register_at:
                if await self._register():
                    backoff = self.settings.register_backoff
                else:
                    backoff = min(backoff * 2, self.settings.register_backoff_max)
                    register_at = loop.time() + random.uniform(0, backoff)  # full jitter
            self._hb_now.clear()
            await self._send_heartbeat()
            wait = self._hb_interval
            if self._need_register:
                wait = max(0.0, min(wait, register_at - loop.time()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._hb_now.wait()

    async def _on_ctl(self, msg: Msg) -> None:
        try:
            command = _control.decode(msg.data).command
        except msgspec.DecodeError as exc:
            if msg.reply:
                await self._reply_error(msg, ErrorCode.BAD_REQUEST, f"invalid control: {exc}")
            return
        if command == "register":
            self._need_register = True
            self._hb_now.set()
        elif command == "pause":
            await self.pause()
        elif command == "resume":
            await self.resume()
        elif command == "drain":
            self._drain_requested.set()
            self._set_status(Status.PAUSED)
        else:
            if msg.reply:
                await self._reply_error(
                    msg,
                    ErrorCode.BAD_REQUEST,
                    f"unknown command {command!r}: use pause, resume, drain or register",
                )
            return
        if msg.reply:
            reply = ControlReply(agent_id=self.agent_id, status=self.status)
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._conn().publish(msg.reply, encode_json(reply))

    async def wait_drain_requested(self) -> None:
        """Return when a ``drain`` command arrived (``serve_forever`` then stops the agent)."""
        await self._drain_requested.wait()

    # -- other listeners ---------------------------------------------------------------

    async def _on_ping(self, msg: Msg) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._conn().publish(msg.reply, encode_json(self.heartbeat()))

    async def _on_srv(self, msg: Msg) -> None:
        if not msg.reply:
            return
        body = _srv.answer(msg.subject, self)
        if body is not None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._conn().publish(msg.reply, body)

    def _topic_handler(self, topic: _Topic) -> Callable[[Msg], Any]:
        async def on_message(msg: Msg) -> None:
            try:
                payload = topic.spec.decode(msg.data)
            except msgspec.DecodeError as exc:
                self.stats.invalid += 1
                log.warning(
                    "agent %s: invalid message on topic %s: %s",
                    self.agent_id,
                    self.subjects.topic_of(msg.subject),
                    exc,
                )
                return
            try:
                if topic.spec.wants_context:
                    await topic.spec.fn(payload, self.subjects.topic_of(msg.subject))
                else:
                    await topic.spec.fn(payload)
            except Exception:
                log.exception("agent %s: topic handler for %s failed", self.agent_id, topic.pattern)

        return on_message

    # -- helpers for $SRV ---------------------------------------------------------------

    def endpoint_stats(self) -> list[tuple[CapabilityInfo, int, int, int, str]]:
        return [
            (c.info, c.requests, c.errors, c.processing_ns, c.last_error)
            for c in self._caps.values()
        ]
