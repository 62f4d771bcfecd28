"""Who may take a request, and in what order: pure functions over registry records."""

from __future__ import annotations

import enum
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .wire import AgentRecord, CapabilityInfo, Priority, Status

_BASE = {Status.UP: 10.0, Status.DEGRADED: 6.0}
W_LOAD = 4.0
W_LATENCY = 2.0
DEGRADED_COST = 2.0


class Policy(enum.StrEnum):
    """How a client picks the instance for a request."""

    BALANCED = "balanced"  # power of two choices on expected time to answer
    SCORED = "scored"  # the registry's seed formula, best first
    QUEUE = "queue"  # the NATS queue group decides
    DIRECT = "direct"  # one agent id, never substituted
    AFFINITY = "affinity"  # the instance that last succeeded for this key


@dataclass(frozen=True, slots=True)
class Weights:
    """Per-capability knobs of the ``scored`` policy."""

    w_load: float = W_LOAD
    w_latency: float = W_LATENCY
    threshold: float = 0.3  # normalised score under which an instance is dropped


def capability_of(record: AgentRecord, capability: str) -> CapabilityInfo | None:
    for cap in record.info.capabilities:
        if cap.name == capability:
            return cap
    return None


def major(version: str) -> str:
    return version.split(".", 1)[0]


def reject_reason(
    record: AgentRecord,
    capability: str,
    version: str | None,
    tags: Sequence[str],
    priority: Priority,
) -> str | None:
    """Why this instance may not take the request, or None when it may."""
    cap = capability_of(record, capability)
    if cap is None:
        return "does not offer it"
    if version is not None and major(cap.version) != major(version):
        return f"offers version {cap.version}, not {major(version)}.x"
    missing = [t for t in tags if t not in record.info.tags]
    if missing:
        return f"lacks tag {missing[0]!r}"
    if record.status == Status.UP:
        return None
    if record.status == Status.DEGRADED:
        return "is DEGRADED (high priority needs UP)" if priority is Priority.HIGH else None
    return f"is {record.status.value}"


def eligible(
    records: Iterable[AgentRecord],
    capability: str,
    version: str | None,
    tags: Sequence[str],
    priority: Priority,
) -> list[AgentRecord]:
    return [r for r in records if reject_reason(r, capability, version, tags, priority) is None]


def explain_miss(
    records: Iterable[AgentRecord],
    capability: str,
    version: str | None,
    tags: Sequence[str],
    priority: Priority,
) -> str:
    """A sentence saying what was asked and what exists, for CapabilityNotFound."""
    offering = [r for r in records if capability_of(r, capability) is not None]
    asked = f"{capability!r}"
    if version is not None:
        asked += f" version {major(version)}.x"
    if tags:
        asked += f" with tags {list(tags)}"
    if priority is Priority.HIGH:
        asked += " at high priority"
    if not offering:
        return f"no live agent offers {asked}"
    reasons = Counter(
        reject_reason(r, capability, version, tags, priority) or "is eligible" for r in offering
    )
    parts = [
        f"{n} instance{'s' if n > 1 else ''} {'offer' if n > 1 else 'offers'} it but "
        f"{_plural(reason, n)}"
        for reason, n in reasons.most_common()
    ]
    return f"no live agent can take {asked}: " + "; ".join(parts)


def _plural(reason: str, n: int) -> str:
    if n == 1:
        return reason
    for one, many in (
        ("is ", "are "),
        ("lacks ", "lack "),
        ("offers ", "offer "),
        ("does not", "do not"),
    ):
        if reason.startswith(one):
            return many + reason[len(one) :]
    return reason


def score(record: AgentRecord, max_latency: float, weights: Weights = Weights()) -> float:
    """The seed formula: base (UP 10, DEGRADED 6) + w_load*(1-load) + w_lat*(1-lat/max)."""
    hb = record.heartbeat
    load = min(1.0, max(0.0, hb.load)) if hb else 0.0
    latency = hb.latency_ms if hb else 0.0
    lat_term = 1.0 - latency / max_latency if max_latency > 0 else 1.0
    return (
        _BASE.get(record.status, 0.0) + weights.w_load * (1.0 - load) + weights.w_latency * lat_term
    )


def normalised(value: float, weights: Weights) -> float:
    """A score as a share of the best possible one (UP, idle, fastest)."""
    return value / (_BASE[Status.UP] + weights.w_load + weights.w_latency)


def rank(
    records: Iterable[AgentRecord],
    capability: str,
    version: str | None,
    tags: Sequence[str],
    priority: Priority,
    weights: Weights = Weights(),
) -> list[tuple[AgentRecord, float, str]]:
    """Eligible instances, best first, with their score and why; those whose normalised
    score is under the threshold are dropped."""
    ok = eligible(records, capability, version, tags, priority)
    max_latency = max((r.heartbeat.latency_ms for r in ok if r.heartbeat), default=0.0)
    scored = []
    for r in ok:
        s = score(r, max_latency, weights)
        if normalised(s, weights) < weights.threshold:
            continue
        hb = r.heartbeat
        why = (
            f"{r.status.value}, load {hb.load:.2f}, latency {hb.latency_ms:.1f} ms"
            if hb
            else f"{r.status.value}, no heartbeat yet"
        )
        scored.append((r, s, why))
    scored.sort(key=lambda t: (-t[1], t[0].info.agent_id))
    return scored


def balanced_cost(
    record: AgentRecord, client_inflight: int, measured_ms: float | None, fallback_ms: float
) -> float:
    """Expected time to an answer: latency x (1 + load + outstanding / capacity).

    Latency is this client's peak EWMA for the instance, else the latency it reports, else
    the capability's median; outstanding is this client's in-flight plus the reported
    queue. DEGRADED doubles the cost. Latency alone ignores queues, load alone ignores
    speed: either sends work to the wrong instance when speeds and capacities differ.
    """
    hb = record.heartbeat
    latency = measured_ms
    if latency is None:
        latency = hb.latency_ms if hb is not None and hb.latency_ms > 0 else fallback_ms
    capacity = max(1, record.info.max_concurrency)
    load = hb.load if hb is not None else 0.0
    queued = hb.queue_len if hb is not None else 0
    cost = max(latency, 0.001) * (1.0 + load + (client_inflight + queued) / capacity)
    return cost * DEGRADED_COST if record.status is Status.DEGRADED else cost


def two_choices(ids: Sequence[str], rng: random.Random, cost: Callable[[str], float]) -> str:
    """Power of two choices: two distinct random candidates, the cheaper one wins."""
    n = len(ids)
    if n == 1:
        return ids[0]
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    if j >= i:
        j += 1
    a, b = ids[i], ids[j]
    return a if cost(a) <= cost(b) else b
