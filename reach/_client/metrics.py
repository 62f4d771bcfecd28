"""A client's metrics: plain numbers on per-capability cells, turned into Prometheus
families only when scraped. The request path finds its cell once per request (one dict
lookup) and adds to it; breaker states are read from the router at scrape time."""

from __future__ import annotations

from .._routing import Router
from .._routing.resilience import BreakerState
from .._telemetry import LATENCY_BUCKETS, Emitter, Histogram
from ..wire.tasks import TaskRecord

__all__ = ["CapCells", "ClientMetrics"]

_MAX_CAPS = 256  # capability names are validated; past this many, one "_other" cell


class CapCells:
    """Everything a client counts about one capability."""

    __slots__ = (
        "attempts",
        "attempts_ok",
        "budget_exhausted",
        "failovers",
        "hedges",
        "inflight",
        "latency",
        "ok",
        "outcomes",
        "retries",
    )

    def __init__(self) -> None:
        self.ok: dict[str, int] = {}  # policy -> requests answered (the common case)
        self.outcomes: dict[tuple[str, str], int] = {}  # (policy, outcome) -> other requests
        self.latency = Histogram(LATENCY_BUCKETS)
        self.inflight = 0
        self.attempts_ok = 0
        self.attempts: dict[str, int] = {}  # outcome -> attempts that were not answered
        self.retries = 0
        self.failovers = 0
        self.hedges = 0
        self.budget_exhausted = 0

    def finished(self, policy: str, outcome: str, seconds: float) -> None:
        self.inflight -= 1
        self.latency.observe(seconds)
        if outcome == "ok":
            ok = self.ok
            ok[policy] = ok.get(policy, 0) + 1
        else:
            key = (policy, outcome)
            self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def attempted(self, outcome: str) -> None:
        if outcome == "ok":
            self.attempts_ok += 1
        else:
            self.attempts[outcome] = self.attempts.get(outcome, 0) + 1


class ClientMetrics:
    """The cells of one client, and its scrape-time source."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.caps: dict[str, CapCells] = {}
        self.tasks_submitted: dict[tuple[str, str], int] = {}
        self.tasks_finished: dict[tuple[str, str], int] = {}
        self.topics_published: dict[str, int] = {}

    def cap(self, capability: str) -> CapCells:
        cells = self.caps.get(capability)
        if cells is None:
            if len(self.caps) >= _MAX_CAPS:
                capability = "_other"
                cells = self.caps.get(capability)
            if cells is None:
                cells = self.caps[capability] = CapCells()
        return cells

    def _bounded(self, capability: str, counts: dict[tuple[str, str], int]) -> str:
        if len(counts) >= 3 * _MAX_CAPS and not any(k[0] == capability for k in counts):
            return "_other"
        return capability

    def submitted(self, capability: str, priority: str) -> None:
        key = (self._bounded(capability, self.tasks_submitted), priority)
        self.tasks_submitted[key] = self.tasks_submitted.get(key, 0) + 1

    def published(self, topic: str) -> None:
        """A durable publish the server stored; past ``_MAX_CAPS`` topics, "_other"."""
        counts = self.topics_published
        if topic not in counts and len(counts) >= _MAX_CAPS:
            topic = "_other"
        counts[topic] = counts.get(topic, 0) + 1

    def task_final(self, rec: TaskRecord) -> None:
        """The final record of a task this client submitted reached it."""
        key = (self._bounded(rec.capability, self.tasks_finished), rec.state.value)
        self.tasks_finished[key] = self.tasks_finished.get(key, 0) + 1

    def collect(self, out: Emitter) -> None:
        for cap, c in list(self.caps.items()):
            for policy, n in list(c.ok.items()):
                out.counter("reach_client_requests", (cap, policy, "ok"), n)
            for (policy, outcome), n in list(c.outcomes.items()):
                out.counter("reach_client_requests", (cap, policy, outcome), n)
            out.histogram("reach_client_request_duration_seconds", (cap,), c.latency)
            out.gauge("reach_client_requests_in_flight", (cap,), c.inflight)
            if c.attempts_ok:
                out.counter("reach_client_attempts", (cap, "ok"), c.attempts_ok)
            for outcome, n in list(c.attempts.items()):
                out.counter("reach_client_attempts", (cap, outcome), n)
            out.counter("reach_client_retries", (cap,), c.retries)
            out.counter("reach_client_failovers", (cap,), c.failovers)
            out.counter("reach_client_hedges", (cap,), c.hedges)
            out.counter("reach_client_retry_budget_exhausted", (cap,), c.budget_exhausted)
        for agent_id, breaker in list(self.router.instance_breakers.items()):
            out.gauge("reach_client_breaker_open", (agent_id,), breaker.state is BreakerState.OPEN)
        for agent_id, n in list(self.router.breaker_openings.items()):
            out.counter("reach_client_breaker_openings", (agent_id,), n)
        for (cap, prio), n in list(self.tasks_submitted.items()):
            out.counter("reach_client_tasks_submitted", (cap, prio), n)
        for (cap, state), n in list(self.tasks_finished.items()):
            out.counter("reach_client_tasks_finished", (cap, state), n)
        for topic, n in list(self.topics_published.items()):
            out.counter("reach_client_topic_published", (topic,), n)
