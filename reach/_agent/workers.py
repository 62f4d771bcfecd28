"""Workers: run accepted requests and answer them, whatever the handler does.

A handler may raise anything (a refusal with its own code included), raise CancelledError
itself, return what cannot be encoded or sent, or overrun its deadline, even ignoring the
cancellation: the caller always gets an answer and the agent keeps its ``max_concurrency``
workers. Each way a request can fail (the handler failed, refused, ran past its deadline,
or we did) is counted, logged under the request id and answered with an error the caller
can act on, never the handler's exception text. A bug of ours on this path is caught
around the worker loop, logged, counted in ``AgentStats.internal_errors`` and answered
``failed``; the worker goes on. With a tracer, each handler run is a SERVER span
(``traced_handler``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from .._background import Background
from .._codec import encode_payload, error_reply, now_ms, wire_error
from .._delivery import publish, publish_by_nats
from .._nats import HEADROOM, TRANSIENT, NatsConnection, fits
from .._telemetry import ATTR, LOG_AGENT, LOG_WORK
from ..errors import RemoteError
from ..wire import Header
from .lifecycle import TIMEOUT_WINDOW, Lifecycle, Reason, TimeoutWatch
from .model import AgentStats, Job
from .scheduler import WorkQueue
from .streaming import CUT_CANCEL, CUT_REFUSED, PATIENCE, Outflows

if TYPE_CHECKING:
    from .._client import Client

__all__ = ["Workers"]

log = logging.getLogger("reach.agent")

_EWMA_ALPHA = 0.2
_SWEEP = 0.05  # deadline watch period, seconds
_ABANDON_AFTER_MS = 500  # a cancelled handler still running this long past its deadline
_CLOSE_GRACE = 1.0  # seconds to wait at stop for handlers that ignore cancellation


class Workers:
    """``max_concurrency`` workers over one priority queue, plus the deadline watch."""

    def __init__(
        self,
        agent_id: str,
        client: Client,
        stats: AgentStats,
        life: Lifecycle,
        *,
        max_concurrency: int,
        max_queue: int,
        reply_headers: bool,
        on_exit: Callable[[BaseException], bool],
        timeout_quiet: float = TIMEOUT_WINDOW,
        streams: str = "",
    ) -> None:
        """``streams``: the stem of the agent's stream subjects (``Subjects.streams``)."""
        self.agent_id = agent_id
        self.stats = stats
        self.queue: WorkQueue[Job] = WorkQueue(max_queue)
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.reply_headers = reply_headers
        #: handler timeouts make the agent DEGRADED; ``timeout_quiet`` seconds without one
        #: (or successes) make it UP again
        self.timeouts = TimeoutWatch(quiet=timeout_quiet)
        self.overloaded = False
        #: queue length from which the agent is DEGRADED (80%), and back UP (25%)
        self.overload_at = (4 * max_queue + 4) // 5 if max_queue else sys.maxsize
        self.recover_at = max_queue // 4
        #: accepted and not yet answered; ``idle`` is set whenever it is 0
        self.outstanding = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._client = client
        self._life = life
        self._on_exit = on_exit  # True: the agent takes a handler's SystemExit in hand
        self.tracer: Tracer | None = None  # spans around handler runs; None: off
        self._nc: NatsConnection
        self._owner: Background | None = None
        self._deadlines: dict[asyncio.Task[Any], Job] = {}
        self._armed = asyncio.Event()
        self._unreplaced = 0  # abandoned handlers' workers not replaced (over the cap)
        #: the task and durable topic runners' abandoned handlers still running, by kind
        self._stuck_elsewhere: dict[str, int] = {}
        #: the streaming replies being sent
        self.outflows = Outflows(streams, stats, self._watch_cut)

    def start(self, nc: NatsConnection, owner: Background) -> None:
        self._nc = nc
        self._owner = owner
        self.outflows.start(nc)
        for _ in range(self.max_concurrency):
            owner.keep(self._worker, "worker")
        owner.keep(self._deadline_watch, "deadline-watch")
        owner.keep(self.outflows.watch, "stream-watch")

    async def close(self, owner: Background) -> None:
        """Cancel every worker (in-flight requests are answered ``agent_unavailable``) and
        answer what is still queued; a handler that ignores cancellation is left behind."""
        stuck = await owner.close(_CLOSE_GRACE)
        if stuck:
            log.error(
                "agent %s: %d coroutine(s) ignore cancellation (a handler swallowing"
                " CancelledError?); left behind",
                self.agent_id,
                stuck,
            )
        self._deadlines.clear()
        for job in self.queue.drain():
            self._done()
            await self.reply_error(job.msg, "agent_unavailable", "agent stopped before running it")

    def admit(self, job: Job) -> bool:
        """Queue an accepted request (in nats-py's reading task: nothing here waits); False
        when the queue is full. From ``overload_at`` waiting the agent is DEGRADED, until
        the workers bring the queue down to ``recover_at``."""
        queue = self.queue
        if not queue.offer(job.priority, job):
            return False
        self.outstanding += 1
        self.idle.clear()
        if len(queue) >= self.overload_at and not self.overloaded:
            self.overloaded = True
            self._life.degrade(Reason.OVERLOAD)
        return True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing accepted is unanswered; False if ``timeout`` came first."""
        try:
            async with asyncio.timeout(timeout):
                await self.idle.wait()
        except TimeoutError:
            return False
        return True

    def review(self, now: float) -> None:
        """Time passes (at every heartbeat): DEGRADED by timeouts ends after a quiet spell,
        even when no request comes to succeed."""
        if self.timeouts.tick(now) and self._life.recover(Reason.TIMEOUTS):
            log.info(
                "agent %s: no handler timeout for %gs; timeouts no longer degrade it",
                self.agent_id,
                self.timeouts.quiet,
            )

    def details(self) -> dict[Reason, str]:
        """The DEGRADED reasons in words, with their numbers (the heartbeat's ``reason``)."""
        return {
            Reason.TIMEOUTS: self.timeouts.describe(),
            Reason.OVERLOAD: (
                f"queue overload: {len(self.queue)} of {self.max_queue} waiting;"
                f" UP again at {self.recover_at}"
            ),
            Reason.STUCK: _stuck_words(self.stats.stuck, self._stuck_elsewhere),
        }

    def stuck_elsewhere(self, kind: str, n: int) -> None:
        """The task runner (``kind`` "task") or the durable topic runner ("topic") has
        ``n`` handlers that ignored their cancellation and run on. Each holds its slot (a
        task slot or a topic worker, never replaced), so any of them costs the agent
        capacity, as request handlers past the cap do: DEGRADED while any holds."""
        self._stuck_elsewhere[kind] = n
        self._judge_stuck()

    def _judge_stuck(self) -> None:
        if self._unreplaced or any(self._stuck_elsewhere.values()):
            self._life.degrade(Reason.STUCK)
        else:
            self._life.recover(Reason.STUCK)

    def _done(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.idle.set()

    # -- the worker loop ---------------------------------------------------------------

    async def _worker(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        queue, stats = self.queue, self.stats
        LOG_AGENT.set(self.agent_id)  # this worker's context, for the logs of its handlers
        while True:
            job = await queue.get()
            stats.inflight += 1
            work = LOG_WORK.set(job)
            try:
                await self._run(job, task)
            except asyncio.CancelledError:
                # Stopped past drain_timeout: tell the caller instead of leaving it waiting.
                if not job.answered:
                    await self._send_answer(
                        job, "agent_unavailable", "agent stopped while running the request"
                    )
                raise
            except Exception:
                await self._internal_error(job)
            finally:
                LOG_WORK.reset(work)
                if not job.abandoned:
                    stats.inflight -= 1
                    self._done()
                else:
                    stats.stuck -= 1
                if self.overloaded and len(queue) <= self.recover_at:
                    self.overloaded = False
                    self._life.recover(Reason.OVERLOAD)
            if job.abandoned:
                if not self._unreplaced:
                    return  # a replacement worker took this one's place
                self._unreplaced -= 1  # none did (too many stuck): serve again
                self._judge_stuck()

    async def _run(self, job: Job, task: asyncio.Task[Any]) -> None:
        cap, msg = job.cap, job.msg
        if job.deadline_ms is not None and job.deadline_ms <= now_ms():
            self.stats.expired += 1
            return
        started = time.perf_counter_ns()
        cap.requests += 1
        spec = cap.spec
        try:
            payload = spec.decode(msg.data)
        except msgspec.DecodeError as exc:
            self._count_error(job, str(exc))
            self.stats.invalid += 1
            await self._answer(job, "bad_request", f"invalid payload: {exc}")
            return
        args: tuple[Any, ...] = (payload,)
        if spec.wants_context:
            args = (payload, job.context(self.agent_id, self._client))
        if job.deadline_ms is not None:
            self._deadlines[task] = job
            if not self._armed.is_set():
                self._armed.set()
        fn = spec.fn
        streaming = job.window  # (read once: a request's run pays one look for streams)
        if streaming:  # the pump runs the generator, the reply is the stream's end
            fn, args = self.outflows.open_for(job, task).pump, (fn, *args)
        try:
            if self.tracer is None:
                result = await fn(*args)
            else:
                result = await traced_handler(self.tracer, self.agent_id, job, fn, args)
            body = encode_payload(result)
        except asyncio.CancelledError:
            if job.cancelled:
                task.uncancel()  # the deadline watch's or the stream's, not a stop
            if task.cancelling():
                raise  # the agent stops
            if job.abandoned:
                return  # answered already
            if job.cancelled:
                await self._stopped(job)
            else:
                await self._failed(job, "cancelled", "handler was cancelled")
            return
        except RemoteError as exc:
            if job.cancelled:
                await self._late(job, task)
            else:
                await self._refused(job, exc)
            return
        except (KeyboardInterrupt, SystemExit) as stop:
            # The process is going down: answer first, and see it leave, since nothing
            # will after (a buffered reply dies with the process).
            if not job.abandoned:
                await self._failed(job, "failed", "handler stopped the process")
                try:
                    await self._nc.flush(timeout=1)
                except TRANSIENT as exc:
                    log.warning("agent %s: last reply not flushed: %s", self.agent_id, exc)
            if self._on_exit(stop):
                return
            raise
        except BaseException:
            if job.cancelled:
                await self._late(job, task)
            else:
                await self._failed(job, "failed", "handler failed")
            return
        finally:
            if job.deadline_ms is not None:
                self._deadlines.pop(task, None)
        if job.cancelled:
            # The handler ignored the cancellation (its deadline's, its stream's) and
            # returned late.
            await self._late(job, task)
            return
        if self.timeouts.tripped and self.timeouts.succeeded():
            self._life.recover(Reason.TIMEOUTS)
        elapsed = time.perf_counter_ns() - started
        ms = elapsed / 1e6
        headers = None
        if self.reply_headers:
            headers = {Header.AGENT: self.agent_id, Header.DURATION_MS: f"{ms:.3f}"}
        via = cap.direct
        if streaming:  # a stream's end: how many chunks, from its subject
            headers = {**(headers or {}), Header.END: str(job.chunks)}
            via = job.via
        nc = self._nc
        if (
            headers is not None
            and len(body) > nc.max_payload - HEADROOM
            and not fits(nc, body, headers)
        ):
            await self._failed(job, "failed", f"result of {len(body)} bytes is too large")
            return
        job.answered = True
        cells = cap.cells
        if cells is not None:  # counted before the reply: a caller may read it at once
            cells.latency.observe(elapsed / 1e9)
            cells.ok[job.priority] += 1
        try:
            # nothing else accepted, so nothing to batch with: out now
            alone = self.outstanding == 1
            if not publish(nc, msg.reply, body, via, headers, alone=alone):
                await publish_by_nats(nc, msg.reply, body, via, headers, alone=alone)
        except TRANSIENT as exc:
            if len(body) > nc.max_payload:
                await self._failed(job, "failed", f"result of {len(body)} bytes is too large")
                return
            log.warning("agent %s: reply to %s lost: %s", self.agent_id, job.request_id, exc)
        cap.processing_ns += elapsed
        s = self.stats
        s.served += 1
        if streaming:
            return  # a stream's length is its caller's reading: not a latency to route by
        s.latency_ewma_ms = (
            ms if s.served == 1 else s.latency_ewma_ms + _EWMA_ALPHA * (ms - s.latency_ewma_ms)
        )

    # -- the ways a request can fail -----------------------------------------------------

    async def _failed(self, job: Job, code: str, what: str) -> None:
        """The handler failed: log the traceback under the request id, tell the caller
        only that (its exception text may hold secrets)."""
        rid = job.request_id or "-"
        self._count_error(job, what)
        log.error(
            "agent %s: %s for %s (request id %s)",
            self.agent_id,
            what,
            job.cap.info.name,
            rid,
            exc_info=sys.exc_info()[0] is not None,
        )
        await self._answer(job, code, f"{what} (request id {rid})")

    async def _refused(self, job: Job, exc: RemoteError) -> None:
        """A deliberate refusal: its code and message are meant for the caller."""
        wire = wire_error(exc)
        if wire is None:
            await self._failed(job, "failed", f"handler refused with invalid code {exc.code!r}")
            return
        code, status, retryable = wire
        self._count_error(job, exc.message)
        await self._answer(job, code, exc.message, status=status, retryable=retryable)

    async def _late(self, job: Job, task: asyncio.Task[Any]) -> None:
        """The handler ended, however, after the deadline watch (or its stream's caller)
        cancelled it: that cancellation is consumed here (else the worker would take its
        next request's CancelledError for a stop), and the caller, unless answered
        already, told why it was stopped."""
        task.uncancel()
        if job.abandoned:
            return
        await self._stopped(job)

    async def _stopped(self, job: Job) -> None:
        """Answer a handler that was cancelled: for its stream's caller, or past its
        deadline."""
        if job.cut:
            await self._cut(job)
        else:
            await self._timed_out(job)

    async def _cut(self, job: Job) -> None:
        """A stream's handler stopped for its caller: by its cancel (nobody reads an
        answer), the server refusing its frames (nothing can reach the caller), or its
        silence (told, in case it still listens)."""
        if job.cut == CUT_CANCEL:
            job.answered = True
            return
        if job.cut == CUT_REFUSED:  # nothing reaches the caller: no answer to send
            self._count_error(job, "NATS refused its frames to the caller")
            job.answered = True
            return
        self._count_error(job, "the caller went silent")
        await self._answer(
            job,
            "cancelled",
            f"the caller said nothing for {job.patience or PATIENCE:g}s: stream stopped",
        )

    async def _timed_out(self, job: Job) -> None:
        if self.timeouts.timed_out(time.monotonic()):
            self._life.degrade(Reason.TIMEOUTS)
        self._count_error(job, "deadline passed while running")
        await self._answer(job, "timeout", "deadline passed while running")

    async def _internal_error(self, job: Job) -> None:
        """A bug of ours around this request: counted and answered; the worker goes on."""
        self.stats.internal_errors += 1
        self.stats.failed += 1
        rid = job.request_id or "-"
        log.exception("agent %s: internal error serving request %s", self.agent_id, rid)
        try:
            await self._answer(job, "failed", f"agent failed (request id {rid})")
        except Exception:
            log.exception("agent %s: could not answer request %s", self.agent_id, rid)

    def _count_error(self, job: Job, reason: str) -> None:
        job.cap.failed(reason)
        self.stats.failed += 1

    async def _answer(
        self, job: Job, code: str, message: str, *, status: int = 500, retryable: bool = False
    ) -> None:
        job.answered = True
        if job.cap.cells is not None:
            job.cap.cells.error(job.priority, code)
        await self._send_answer(job, code, message, status=status, retryable=retryable)

    async def _send_answer(
        self, job: Job, code: str, message: str, *, status: int = 500, retryable: bool = False
    ) -> None:
        """An error reply; a stream's says how many chunks it sent, from its subject."""
        if job.chunks < 0:
            await self.reply_error(job.msg, code, message, status=status, retryable=retryable)
            return
        await self.send_error(
            job.msg.reply,
            code,
            message,
            status=status,
            retryable=retryable,
            end=job.chunks,
            via=job.via,
        )

    async def reply_error(
        self, msg: Any, code: str, message: str, *, status: int = 500, retryable: bool = False
    ) -> None:
        """Answer ``msg`` with an error (best effort: a lost reply is logged)."""
        await self.send_error(msg.reply, code, message, status=status, retryable=retryable)

    async def send_error(
        self,
        reply: str,
        code: str,
        message: str,
        *,
        status: int = 500,
        retryable: bool = False,
        end: int | None = None,
        via: str = "",
    ) -> None:
        """Send an error to the reply subject ``reply`` (nothing when there is none);
        ``end``: the last frame of a stream that sent that many chunks, from ``via``."""
        if not reply:
            return
        body, headers = error_reply(
            code, message, self.agent_id, status=status, retryable=retryable
        )
        if end is not None:
            headers[Header.END] = str(end)
        try:
            await self._nc.publish(reply, body, reply=via, headers=headers)
        except TRANSIENT as exc:
            log.warning("agent %s: error reply lost: %s", self.agent_id, exc)

    # -- deadlines -------------------------------------------------------------------------

    def _watch_cut(self, task: asyncio.Task[Any], job: Job) -> None:
        """``Outflow.stop`` cancelled a stream's handler for its caller: from now on it is
        watched as a handler past its deadline (a stream may have none), so one that
        ignores the cancel is abandoned after the same grace."""
        job.deadline_ms = now_ms()
        self._deadlines[task] = job
        if not self._armed.is_set():
            self._armed.set()

    async def _deadline_watch(self) -> None:
        """Cancel handlers still running past their caller's deadline.

        One sweep every 50 ms while handlers with deadlines run, instead of a timer per
        request: per-request asyncio.timeout cost ~10% of throughput; the price is up to
        50 ms of overrun. Idle agents do not wake up. A handler that ignores the
        cancellation (its deadline's, or its stream's: ``_watch_cut``) is abandoned
        ``_ABANDON_AFTER_MS`` after it: its caller is answered and its worker replaced.
        """
        deadlines = self._deadlines
        while True:
            if not deadlines:
                self._armed.clear()
                await self._armed.wait()
            await asyncio.sleep(_SWEEP)
            now = now_ms()
            due = [
                (task, job)
                for task, job in deadlines.items()
                if job.deadline_ms is not None and job.deadline_ms <= now
            ]
            for task, job in due:
                # _abandon awaits: a task seen before may have moved on to another job.
                if deadlines.get(task) is not job:
                    continue
                deadline = job.deadline_ms
                assert deadline is not None
                if not job.cancelled:  # (a cut stream's was cancelled already)
                    job.cancelled = True
                    task.cancel()
                elif deadline + _ABANDON_AFTER_MS <= now:
                    await self._abandon(task, job)

    async def _abandon(self, task: asyncio.Task[Any], job: Job) -> None:
        what = (
            f"ignores the cancellation of its stream (cut: {job.cut})"
            if job.cut
            else "ignores cancellation past its deadline"
        )
        job.abandoned = True
        self._deadlines.pop(task, None)
        stats = self.stats
        stats.abandoned += 1
        stats.stuck += 1
        stats.inflight -= 1
        self._done()
        if stats.stuck > self.max_concurrency:
            # Replacing without limit would pile up stuck tasks: serve with fewer workers.
            self._unreplaced += 1
            self._judge_stuck()
            log.critical(
                "agent %s: handler for %s (request id %s) %s; %d handlers are stuck,"
                " over max_concurrency: its worker is NOT replaced (%d workers lost until"
                " they end)",
                self.agent_id,
                job.cap.info.name,
                job.request_id or "-",
                what,
                stats.stuck,
                self._unreplaced,
            )
        else:
            log.error(
                "agent %s: handler for %s (request id %s) %s; its worker is replaced",
                self.agent_id,
                job.cap.info.name,
                job.request_id or "-",
                what,
            )
            owner = self._owner
            if owner is not None and not owner.closed:
                owner.keep(self._worker, "worker")
        await self._stopped(job)


_HOLDS = {"task": "each holds its task slot", "topic": "each holds its topic worker"}


def _stuck_words(requests: int, elsewhere: dict[str, int]) -> str:
    """The STUCK reason with its numbers, for people."""
    others = [(kind, n) for kind, n in elsewhere.items() if n]
    parts = [f"{requests} request handler(s)"] if requests or not others else []
    parts += [
        f"{n} {kind} handler(s) ({_HOLDS.get(kind, 'each holds its slot')})" for kind, n in others
    ]
    return "handlers stuck past their deadline: " + ", ".join(parts)


async def traced_handler(
    tracer: Tracer,
    agent_id: str,
    job: Job,
    fn: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
) -> Any:
    """A SERVER span around one handler run, child of the caller's attempt span; current
    while the handler runs, so the calls it makes continue the trace."""
    msg = job.msg
    headers = msg.headers or {}
    with tracer.start_as_current_span(
        f"process {job.cap.info.name}",
        context=propagate.extract(headers),
        kind=SpanKind.SERVER,
        attributes={
            ATTR.SYSTEM: "nats",
            ATTR.DESTINATION: msg.subject,
            ATTR.OPERATION: "process",
            ATTR.CAPABILITY: job.cap.info.name,
            ATTR.AGENT_ID: agent_id,
            ATTR.PRIORITY: job.priority.value,
            ATTR.ATTEMPT: _int(headers.get(Header.ATTEMPT, "1")),
        },
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            result = await fn(*args)
        except asyncio.CancelledError:
            span.set_attribute(ATTR.OUTCOME, "cancelled")  # its deadline, or a stop
            raise
        except RemoteError as exc:
            span.set_attribute(ATTR.OUTCOME, exc.code)
            span.set_status(Status(StatusCode.ERROR, exc.code))
            raise
        except Exception as exc:
            span.set_attribute(ATTR.OUTCOME, "failed")
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        span.set_attribute(ATTR.OUTCOME, "ok")
        return result


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0
