"""Who may take a request, and in what order: pure functions over registry records.

Heartbeat numbers come from peers and are used only through the clamps below: a load
outside [0, 1], a negative, NaN or infinite latency or a negative queue cannot buy traffic.
"""

from __future__ import annotations

import enum
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..wire import AgentRecord, CapabilityInfo, Heartbeat, Priority, Status

_BASE = {Status.UP: 10.0, Status.DEGRADED: 6.0}
W_LOAD = 4.0
W_LATENCY = 2.0
DEGRADED_COST = 2.0
#: What an impossible reported latency (negative, NaN, infinite, over an hour) counts as.
WORST_LATENCY_MS = 3_600_000.0


def clamp_load(load: float) -> float:
    """A reported load in [0, 1]; NaN counts as fully loaded."""
    if 0.0 <= load <= 1.0:
        return load
    return 0.0 if load < 0.0 else 1.0  # NaN fails both comparisons: 1.0


def clamp_latency(latency_ms: float) -> float:
    """A reported latency as finite ms >= 0; anything impossible counts as the worst."""
    return latency_ms if 0.0 <= latency_ms <= WORST_LATENCY_MS else WORST_LATENCY_MS


def in_range(hb: Heartbeat) -> bool:
    """Are a heartbeat's numbers usable as sent (so the clamps change nothing)?"""
    return (
        0.0 <= hb.load <= 1.0
        and 0.0 <= hb.latency_ms <= WORST_LATENCY_MS
        and hb.queue_len >= 0
        and hb.inflight >= 0
    )


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


def mismatch(
    record: AgentRecord, capability: str, version: str | None, tags: Sequence[str]
) -> str | None:
    """Why this instance does not serve what was asked (capability, major version, tags),
    whatever its status; None when it does."""
    cap = capability_of(record, capability)
    if cap is None:
        return "does not offer it"
    if version is not None and major(cap.version) != major(version):
        return f"offers version {cap.version}, not {major(version)}.x"
    missing = [t for t in tags if t not in record.info.tags]
    if missing:
        return f"lacks tag {missing[0]!r}"
    return None


def unroutable(record: AgentRecord, priority: Priority) -> str | None:
    """Why this instance's status keeps new work of ``priority`` away, or None."""
    if record.status == Status.UP:
        return None
    if record.status == Status.DEGRADED:
        return "is DEGRADED (high priority needs UP)" if priority is Priority.HIGH else None
    return f"is {record.status.value}"


def reject_reason(
    record: AgentRecord,
    capability: str,
    version: str | None,
    tags: Sequence[str],
    priority: Priority,
) -> str | None:
    """Why this instance may not take the request, or None when it may."""
    return mismatch(record, capability, version, tags) or unroutable(record, priority)


def fan_out(
    records: Iterable[AgentRecord],
    capability: str,
    version: str | None,
    tags: Sequence[str],
    priority: Priority,
) -> tuple[list[str], dict[str, str]]:
    """Who a gather asks, by agent id: every instance that may take the request (as for
    a request: UP, or DEGRADED below high priority); and, with why, those that serve what
    was asked but whose status keeps them out (PAUSED, UNKNOWN, DOWN, or DEGRADED at high
    priority). Instances of another version or without the tags are in neither."""
    asked: list[str] = []
    skipped: dict[str, str] = {}
    for r in records:
        if mismatch(r, capability, version, tags) is not None:
            continue
        why = unroutable(r, priority)
        if why is None:
            asked.append(r.info.agent_id)
        else:
            skipped[r.info.agent_id] = why
    asked.sort()
    return asked, dict(sorted(skipped.items()))


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
    """The seed formula: base (UP 10, DEGRADED 6) + w_load*(1-load) + w_lat*(1-lat/max),
    with the reported numbers clamped (an impossible latency scores as the slowest)."""
    hb = record.heartbeat
    load = clamp_load(hb.load) if hb else 0.0
    latency = clamp_latency(hb.latency_ms) if hb else 0.0
    if max_latency > 0:
        lat_term = max(0.0, 1.0 - latency / max_latency)
    else:
        lat_term = 0.0 if latency >= WORST_LATENCY_MS else 1.0
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
    reported = (clamp_latency(r.heartbeat.latency_ms) for r in ok if r.heartbeat)
    max_latency = max((x for x in reported if x < WORST_LATENCY_MS), default=0.0)
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
    Reported numbers are clamped inline (this runs twice per request).
    """
    hb = record.heartbeat
    if hb is None:
        load, queued, reported = 0.0, 0, 0.0
    else:
        load, queued, reported = hb.load, hb.queue_len, hb.latency_ms
        if not 0.0 <= load <= 1.0:
            load = 0.0 if load < 0.0 else 1.0  # NaN: fully loaded
        if queued < 0:
            queued = 0
        if not 0.0 <= reported <= WORST_LATENCY_MS:
            reported = WORST_LATENCY_MS  # negative, NaN or infinite: the slowest
    latency = measured_ms
    if latency is None:
        latency = reported if reported > 0 else fallback_ms
    capacity = max(1, record.info.max_concurrency)
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
