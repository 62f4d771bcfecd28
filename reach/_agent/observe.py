"""What an agent shows of itself: per-capability cells the workers add to, spans around
handler runs (only with a tracer), and the scrape-time source of its metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from .._telemetry import ATTR, Emitter
from ..errors import RemoteError
from ..wire import Header
from .model import Job

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["agent_source", "traced_handler"]


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


def agent_source(agent: Agent) -> Callable[[Emitter], None]:
    """The agent's metrics, read from its counters at each scrape."""
    name, aid = agent.name, agent.agent_id

    def collect(out: Emitter) -> None:
        out.gauge("reach_agent_info", (name, aid, agent.status.value), 1)
        for cap, cells in agent.cells().items():
            for prio, n in list(cells.ok.items()):
                out.counter("reach_agent_requests", (name, cap, prio.value, "ok"), n)
            for (prio, code), n in list(cells.errors.items()):
                out.counter("reach_agent_requests", (name, cap, prio.value, code), n)
            out.histogram("reach_agent_handler_duration_seconds", (name, cap), cells.latency)
        for prio, n in agent.queue_lengths().items():
            out.gauge("reach_agent_queue_length", (name, prio.value), n)
        s = agent.stats
        out.gauge("reach_agent_requests_in_flight", (name,), s.inflight)
        out.counter("reach_agent_requests_expired", (name,), s.expired)
        for reason, n in list(s.refusals.items()):
            out.counter("reach_agent_requests_rejected", (name, reason), n)
        out.counter("reach_agent_refusals_unsent", (name,), s.unsent_refusals)
        if agent.last_drain_seconds is not None:
            out.gauge("reach_agent_drain_duration_seconds", (name,), agent.last_drain_seconds)
        t = agent.task_stats
        for (cap, outcome), n in agent.task_outcomes().items():  # a copy
            out.counter("reach_agent_task_attempts", (name, cap, outcome), n)
        out.counter("reach_agent_task_redeliveries", (name,), t.redelivered)
        out.counter("reach_agent_tasks_dead_lettered", (name,), t.dead_lettered)
        out.counter("reach_agent_task_records_undecodable", (name,), t.undecodable)
        out.gauge("reach_agent_tasks_running", (name,), t.running)
        out.gauge("reach_agent_handlers_stuck", (name, "request"), s.stuck)
        out.gauge("reach_agent_handlers_stuck", (name, "task"), t.stuck)

    return collect
