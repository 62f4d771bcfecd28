"""The fleet summary, computed from two samples: pure, no I/O, no clock.

Instances per status, in-flight and queue come from the routing table (the registry's
records, heartbeats included). Request and error rates do not: a heartbeat's counters are
as old as the heartbeat (5 s by default) and count the whole agent, not one capability. They
come from each agent's ``$SRV.STATS`` answer, read at both samples: live counters per
capability (endpoint). A rate is the delta of a counter over the time between the two
reads of that agent; a counter that went down, or a ``started`` stamp that changed, means
the agent restarted, and then everything it counted since is the delta.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .._tasks.counts import CapabilityTasks, TaskCensus
from ..wire import AgentRecord, Status

__all__ = [
    "LIVE",
    "AgentCounters",
    "CapabilityStatus",
    "Counters",
    "FleetStatus",
    "Sample",
    "Summary",
    "Traffic",
    "summarize",
]

#: the statuses a request can be routed to
LIVE = frozenset({Status.UP, Status.DEGRADED})


@dataclass(frozen=True, slots=True)
class Counters:
    """One capability's counters in one agent: requests handled, errors among them, and
    nanoseconds spent on the successful ones."""

    requests: int = 0
    errors: int = 0
    processing_ns: int = 0


@dataclass(frozen=True, slots=True)
class AgentCounters:
    """One agent's ``$SRV.STATS`` answer: read at ``at`` (monotonic seconds); ``started``
    identifies the process run (a change means a restart)."""

    at: float
    started: str
    endpoints: Mapping[str, Counters]


@dataclass(frozen=True, slots=True)
class Sample:
    """The fleet at one instant: the routing table, the counters of the agents that
    answered (by agent id), the task census (None: tasks unused or unreadable), and notes
    about what could not be read."""

    at: float
    wall_ms: int
    records: Sequence[AgentRecord]
    counters: Mapping[str, AgentCounters] = field(default_factory=dict)
    tasks: TaskCensus | None = None
    notes: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class Traffic:
    """Requests and errors over the interval; the rates are None when nothing could be
    measured (no earlier sample, or no instance answered both times). ``latency_ms``: the
    mean time of the successful requests of the interval (None: there were none)."""

    requests: int = 0
    errors: int = 0
    requests_per_s: float | None = None
    errors_per_s: float | None = None
    latency_ms: float | None = None


@dataclass(frozen=True, slots=True)
class CapabilityStatus:
    """One capability. ``kinds``: "request" and/or "task" (how its instances serve it).
    ``inflight``/``queue`` add up the heartbeats of its instances (an instance serving
    several capabilities counts under each). ``no_live``: nothing can take a request or a
    task now (no instance UP or DEGRADED)."""

    name: str
    kinds: tuple[str, ...]
    instances: dict[str, int]
    live: int
    no_live: bool
    traffic: Traffic
    inflight: int = 0
    queue: int = 0
    tasks: CapabilityTasks | None = None


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """Every instance once. ``unmeasured``: live agents whose counters could not be read at
    both samples; their traffic is not in the rates."""

    agents: int
    instances: dict[str, int]
    traffic: Traffic
    inflight: int
    queue: int
    unmeasured: int


@dataclass(frozen=True, slots=True)
class Summary:
    wall_ms: int
    interval: float | None
    fleet: FleetStatus
    capabilities: list[CapabilityStatus]
    tasks: TaskCensus | None
    notes: list[str]


class _Acc:
    """Traffic being added up."""

    __slots__ = ("errors", "errors_rate", "measured", "ns", "ok", "requests", "requests_rate")

    def __init__(self) -> None:
        self.requests = self.errors = self.ns = self.ok = 0
        self.requests_rate = self.errors_rate = 0.0
        self.measured = False

    def add(self, delta: Counters, seconds: float) -> None:
        self.measured = True
        self.requests += delta.requests
        self.errors += delta.errors
        self.ns += delta.processing_ns
        self.ok += delta.requests - delta.errors
        self.requests_rate += delta.requests / seconds
        self.errors_rate += delta.errors / seconds

    def traffic(self) -> Traffic:
        if not self.measured:
            return Traffic()
        return Traffic(
            requests=self.requests,
            errors=self.errors,
            requests_per_s=self.requests_rate,
            errors_per_s=self.errors_rate,
            latency_ms=round(self.ns / self.ok / 1e6, 3) if self.ok > 0 else None,
        )


def deltas(
    before: AgentCounters | None, after: AgentCounters
) -> tuple[float, dict[str, Counters]] | None:
    """What one agent counted between two reads, per capability, and the seconds between
    them; None without an earlier read to compare with."""
    if before is None or after.at <= before.at:
        return None
    restarted = before.started != after.started
    out: dict[str, Counters] = {}
    for name, cur in after.endpoints.items():
        prev = None if restarted else before.endpoints.get(name)
        if prev is None or (
            cur.requests < prev.requests
            or cur.errors < prev.errors
            or cur.processing_ns < prev.processing_ns
        ):
            prev = Counters()  # counting began again: all it counted is new
        out[name] = Counters(
            cur.requests - prev.requests,
            cur.errors - prev.errors,
            cur.processing_ns - prev.processing_ns,
        )
    return after.at - before.at, out


def _by_status() -> dict[str, int]:
    return {s.value: 0 for s in Status}


class _Table:
    """The routing table added up: per capability, how it is served, its instances by
    status and their in-flight and queued work; the same for the fleet."""

    def __init__(self) -> None:
        self.kinds: dict[str, set[str]] = {}
        self.instances: dict[str, dict[str, int]] = {}
        self.load: dict[str, tuple[int, int]] = {}
        self.fleet = _by_status()
        self.inflight = self.queue = 0

    def offered(self, rec: AgentRecord) -> set[str]:
        """The capabilities ``rec`` serves, noting how."""
        for c in rec.info.tasks:
            self.kinds.setdefault(c.name, set()).add("task")
        for c in rec.info.capabilities:
            self.kinds.setdefault(c.name, set()).add("request")
        return {c.name for c in (*rec.info.capabilities, *rec.info.tasks)}

    def add(self, rec: AgentRecord) -> None:
        self.fleet[rec.status.value] += 1
        hb = rec.heartbeat
        busy, waiting = (hb.inflight, hb.queue_len) if hb is not None else (0, 0)
        self.inflight += busy
        self.queue += waiting
        for name in self.offered(rec):
            self.instances.setdefault(name, _by_status())[rec.status.value] += 1
            was = self.load.get(name, (0, 0))
            self.load[name] = (was[0] + busy, was[1] + waiting)


def _traffic(before: Sample, after: Sample) -> tuple[dict[str, _Acc], _Acc]:
    """Per capability and in all, what the agents read at both samples counted between."""
    per_cap: dict[str, _Acc] = {}
    total = _Acc()
    for agent_id, cur in after.counters.items():
        got = deltas(before.counters.get(agent_id), cur)
        if got is None:
            continue
        seconds, by_cap = got
        for name, delta in by_cap.items():
            per_cap.setdefault(name, _Acc()).add(delta, seconds)
            total.add(delta, seconds)
    return per_cap, total


def summarize(before: Sample | None, after: Sample, remembered: Iterable[str] = ()) -> Summary:
    """The summary of ``after``, with rates since ``before`` (None: no rates). A capability
    in ``before``, in ``remembered`` (names seen earlier, as ``reach top`` keeps them) or in
    the task census is listed even when no instance offers it any more, flagged."""
    table = _Table()
    names = set(remembered)
    unmeasured = 0
    if before is not None:
        for rec in before.records:
            names |= table.offered(rec)
    for rec in after.records:
        table.add(rec)
        if before is not None and rec.status in LIVE:
            agent_id = rec.info.agent_id
            unmeasured += agent_id not in before.counters or agent_id not in after.counters
    per_cap, total = _traffic(before, after) if before is not None else ({}, _Acc())
    census = after.tasks.capabilities if after.tasks is not None else {}
    for name in census:
        table.kinds.setdefault(name, set()).add("task")
    rows = []
    for name in names | table.kinds.keys():
        counts = table.instances.get(name, _by_status())
        live = sum(counts[s.value] for s in LIVE)
        kinds = table.kinds.get(name, set())
        busy, waiting = table.load.get(name, (0, 0))
        acc = per_cap.get(name)
        rows.append(
            CapabilityStatus(
                name=name,
                kinds=tuple(sorted(kinds)),
                instances=counts,
                live=live,
                no_live=live == 0,
                traffic=acc.traffic() if acc is not None else Traffic(),
                inflight=busy,
                queue=waiting,
                tasks=census.get(name, CapabilityTasks()) if "task" in kinds else None,
            )
        )
    rows.sort(key=lambda r: (not r.no_live, r.name))
    return Summary(
        wall_ms=after.wall_ms,
        interval=round(after.at - before.at, 3) if before is not None else None,
        fleet=FleetStatus(
            agents=len(after.records),
            instances=table.fleet,
            traffic=_fleet_traffic(total, before is not None and unmeasured == 0),
            inflight=table.inflight,
            queue=table.queue,
            unmeasured=unmeasured,
        ),
        capabilities=rows,
        tasks=after.tasks,
        notes=list(after.notes),
    )


def _fleet_traffic(total: _Acc, all_measured: bool) -> Traffic:
    """The fleet's traffic; when no counter was read, zero if no live agent went unread
    (an empty fleet serves nothing), unknown otherwise."""
    if total.measured or not all_measured:
        return total.traffic()
    return Traffic(requests_per_s=0.0, errors_per_s=0.0)
