"""What a registry counts: ``RegistryStats`` (plain numbers about the traffic it handles)
and ``RegistryCells`` (counters by label and the heartbeat-lag histogram), kept on its
``Core`` as things happen and read by ``observe`` at scrape time."""

from __future__ import annotations

from dataclasses import dataclass

from .._telemetry import LAG_BUCKETS, Histogram

__all__ = ["RegistryCells", "RegistryStats"]


@dataclass(slots=True)
class RegistryStats:
    """What a registry counts about the traffic it handles."""

    heartbeats: int = 0
    dropped_malformed: int = 0  # did not decode
    dropped_spoofed: int = 0  # subject and body name different agents
    dropped_invalid: int = 0  # decoded, but an id or number no record may carry
    clamped: int = 0  # heartbeats stored with numbers brought into range
    stale_heartbeats: int = 0  # older than the heartbeat already stored: not written
    heartbeats_unwritten: int = 0  # no news and a young lease: not written (``news``)
    reregister_requests: int = 0
    registrations: int = 0
    deregistrations: int = 0
    bad_requests: int = 0  # API requests answered bad_request (undecodable or invalid)
    mismatched_requests: int = 0  # of those: register/deregister naming another agent
    legacy_requests: int = 0  # register/deregister on the old subjects without an id
    corrupt_records: int = 0  # stored values that did not decode (replaced on next write)
    probes: int = 0
    cas_conflicts: int = 0
    write_errors: int = 0
    routes_unsent: int = 0  # lease writes whose routes copies were not sent: the next mends
    background_failures: int = 0  # background coroutines that raised (logged; loops restarted)
    connections_replaced: int = 0  # NATS connections given up for good, served again anew
    # durable-task recovery (``reach._tasks.recovery``), read at access
    sweeps: int = 0
    sweeps_skipped: int = 0  # another replica held the sweep lock for that interval
    tasks_recovered: int = 0  # tasks whose message was gone, published again
    max_deliveries: int = 0  # messages that reached max deliveries, moved to the DLQ
    advisories_missed: int = 0  # of those, found by a sweep: their advisory was lost
    undecodable_records: int = 0  # task records that did not decode, replaced by FAILED
    cancels_finished: int = 0  # cancels a sweep finished (message removed, or ended)
    recovery_errors: int = 0  # advisories or records that failed (logged, tried again)


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
