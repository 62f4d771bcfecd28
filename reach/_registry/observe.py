"""What a registry shows of itself: the scrape-time source that reads its counters
(``counters``), the fleet in its view and the task recovery's last sweep.

It reads them through ``RegistryView``, which the ``Registry`` satisfies, so this module
knows nothing of the service that uses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .._tasks import TaskState
from .._tasks.recovery import RecoveryStats
from .._telemetry import Emitter
from ..wire import AgentRecord
from .counters import RegistryCells, RegistryStats

__all__ = ["RegistryView", "registry_source"]


class RegistryView(Protocol):
    """What the metrics source reads of a registry, each time it is scraped."""

    @property
    def cells(self) -> RegistryCells: ...

    @property
    def stats(self) -> RegistryStats: ...

    @property
    def recovery_stats(self) -> RecoveryStats: ...

    def records(self) -> dict[str, AgentRecord]: ...


def registry_source(registry: RegistryView) -> Callable[[Emitter], None]:
    def collect(out: Emitter) -> None:
        cells = registry.cells
        fleet: dict[tuple[str, str], int] = {}
        for record in registry.records().values():
            status = record.status.value
            for served in (*record.info.capabilities, *record.info.tasks):
                key = (served.name, status)
                fleet[key] = fleet.get(key, 0) + 1
        for (name, status), n in fleet.items():
            out.gauge("reach_registry_agents", (name, status), n)
        for (status, reason), n in list(cells.transitions.items()):
            out.counter("reach_registry_transitions", (status, reason), n)
        s = registry.stats
        out.counter("reach_registry_heartbeats", (), s.heartbeats)
        out.counter("reach_registry_heartbeats_unwritten", (), s.heartbeats_unwritten)
        out.counter("reach_registry_routes_unsent", (), s.routes_unsent)
        for reason, n in (
            ("malformed", s.dropped_malformed),
            ("spoofed", s.dropped_spoofed),
            ("invalid", s.dropped_invalid),
            ("stale", s.stale_heartbeats),
        ):
            out.counter("reach_registry_heartbeats_dropped", (reason,), n)
        out.histogram("reach_registry_heartbeat_lag_seconds", (), cells.lag)
        mismatched = s.mismatched_requests
        out.counter("reach_registry_requests_refused", ("agent_mismatch",), mismatched)
        out.counter(
            "reach_registry_requests_refused", ("bad_request",), s.bad_requests - mismatched
        )
        out.counter("reach_registry_legacy_requests", (), s.legacy_requests)
        for outcome, n in list(cells.probes.items()):
            out.counter("reach_registry_probes", (outcome,), n)
        for kind, n in list(cells.queries.items()):
            out.counter("reach_registry_queries", (kind,), n)
        out.counter("reach_registry_task_sweeps", (), s.sweeps)
        out.counter("reach_registry_tasks_recovered", ("republished",), s.tasks_recovered)
        out.counter("reach_registry_tasks_recovered", ("dead_lettered",), s.max_deliveries)
        out.counter("reach_registry_tasks_recovered", ("undecodable",), s.undecodable_records)
        out.counter("reach_registry_tasks_recovered", ("cancel_finished",), s.cancels_finished)
        rs = registry.recovery_stats
        if rs.states is not None:
            for state in TaskState:  # a state no record is in reads 0, not "no data"
                out.gauge("reach_tasks", (state.value,), rs.states.get(state.value, 0))
        if rs.schedules is not None:
            for kind, n in rs.schedules.items():
                out.gauge("reach_schedules", (kind,), n)
        if rs.dlq_messages is not None:
            out.gauge("reach_dlq_messages", (), rs.dlq_messages)

    return collect
