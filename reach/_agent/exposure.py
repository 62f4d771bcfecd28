"""The agent's side of telemetry: its heartbeat, its metrics source, its health check and
its own ``/metrics`` and ``/healthz`` port (``Agent(metrics_port=...)`` or
``REACH_METRICS_PORT``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .._codec import now_ms
from ..wire import Heartbeat, Priority
from .model import AgentCells, AgentStats, Served
from .observe import agent_source

if TYPE_CHECKING:
    from .._nats import NatsConnection
    from .._tasks import TaskRunner
    from .._telemetry.core import Attachment, Telemetry
    from ..settings import ReachSettings
    from .agent import Agent
    from .lifecycle import Lifecycle
    from .workers import Workers

__all__ = ["Exposure"]


class Exposure:
    """Mixed into ``Agent``."""

    agent_id: str
    settings: ReachSettings
    telemetry: Telemetry
    metrics_port: int | None
    _caps: dict[str, Served]
    _workers: Workers
    _tasks: TaskRunner
    _nc: NatsConnection | None
    _attachment: Attachment | None
    _drain_started: float | None
    _life: Lifecycle
    stats: AgentStats
    max_concurrency: int
    #: how long the last drain took (seconds); None before the first
    last_drain_seconds: float | None

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

    def _cells_for_new_capability(self) -> AgentCells | None:
        return AgentCells() if self.telemetry.metrics else None

    async def _expose(self, agent: Agent) -> None:
        """At start: spans on, the source and health check added, the port served."""
        self._workers.tracer = self._tasks.tracer = self.telemetry.tracer
        if self._attachment is None:
            self._attachment = await self.telemetry.attach(
                f"agent {self.agent_id}",
                agent_source(agent),
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
