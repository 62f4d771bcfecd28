"""The agent's Prometheus families, read from its counters at each scrape (the cells the
workers add to, its stats and its task runner's).

It reads the agent through the small ``Observed`` interface, so it knows nothing of the
Agent and a test can hand it a fake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .._tasks import TaskStats
from .._telemetry import Emitter
from .._topics import TopicCells
from ..wire import Priority, Status
from .model import AgentCells, AgentStats

__all__ = ["Observed", "agent_source"]


class Observed(Protocol):
    """What the metrics source reads of an agent."""

    name: str
    agent_id: str
    stats: AgentStats
    task_stats: TaskStats
    #: how long the last drain took (seconds); None before the first
    last_drain_seconds: float | None

    @property
    def status(self) -> Status: ...

    def cells(self) -> dict[str, AgentCells]: ...

    def queue_lengths(self) -> dict[Priority, int]: ...

    def task_outcomes(self) -> dict[tuple[str, str], int]: ...

    def topic_cells(self) -> dict[str, TopicCells]: ...


def agent_source(agent: Observed) -> Callable[[Emitter], None]:
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
        out.counter("reach_agent_schedule_firings", (name, "made"), t.fired)
        out.counter("reach_agent_schedule_firings", (name, "skipped"), t.firings_skipped)
        out.counter("reach_agent_schedule_firings", (name, "missed"), t.firings_missed)
        out.counter("reach_agent_schedule_firings", (name, "dropped"), t.firings_dropped)
        out.counter("reach_agent_schedule_firings_late", (name,), t.fired_late)
        out.gauge("reach_agent_handlers_stuck", (name, "request"), s.stuck)
        out.gauge("reach_agent_handlers_stuck", (name, "task"), t.stuck)
        topics = agent.topic_cells()
        out.gauge(
            "reach_agent_handlers_stuck", (name, "topic"), sum(c.stuck for c in topics.values())
        )
        for pattern, c in topics.items():
            key = (name, pattern)
            out.counter("reach_agent_topic_deliveries", key, c.delivered)
            out.counter("reach_agent_topic_acked", key, c.acked)
            out.counter("reach_agent_topic_redeliveries", key, c.redelivered)
            out.counter("reach_agent_topic_failures", key, c.failed)
            out.counter("reach_agent_topic_dead_lettered", key, c.dead_lettered)
            if c.lag is not None:
                out.gauge("reach_agent_topic_lag", key, c.lag)
            if c.ack_pending is not None:
                out.gauge("reach_agent_topic_ack_pending", key, c.ack_pending)

    return collect
