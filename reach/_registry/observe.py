"""What a registry shows of itself: counters kept as plain numbers on its ``Core`` and the
scrape-time source that reads them, the fleet and the task recovery's last sweep."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .._tasks import TaskState
from .._telemetry import LAG_BUCKETS, Emitter, Histogram

if TYPE_CHECKING:
    from .service import Registry

__all__ = ["RegistryCells", "registry_source"]


class RegistryCells:
    """Counters with labels the registry's parts add to as things happen."""

    def __init__(self) -> None:
        self.transitions: dict[tuple[str, str], int] = {}  # (new status, reason)
        self.probes: dict[str, int] = {}  # outcome
        self.queries: dict[str, int] = {"route": 0, "list": 0}
        self.lag = Histogram(LAG_BUCKETS)

    def transition(self, status: str, reason: str) -> None:
        key = (status, reason)
        self.transitions[key] = self.transitions.get(key, 0) + 1

    def probed(self, outcome: str) -> None:
        self.probes[outcome] = self.probes.get(outcome, 0) + 1


def registry_source(registry: Registry) -> Callable[[Emitter], None]:
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
        if rs.dlq_messages is not None:
            out.gauge("reach_dlq_messages", (), rs.dlq_messages)

    return collect
