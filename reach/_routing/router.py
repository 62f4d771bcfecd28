"""A client's routing state: who to send to next, and what it learnt from past answers.

Synchronous and free of I/O: the request path in ``_client`` asks it for a target, sends,
and reports the outcome back. Time comes in as ``now`` (the event loop's clock). It reads
the routing table through the small ``TableView`` protocol, and forgets an instance when
the table says it left, so its maps hold only instances that exist.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from ..errors import AgentUnavailable, CapabilityNotFound, CircuitOpen
from ..wire import Priority
from .outcomes import FAILOVER, INSTANCE_FAILURE, UNANSWERED, Choice, TableView, look
from .policies import (
    Policy,
    Weights,
    balanced_cost,
    explain_miss,
    rank,
    two_choices,
)
from .resilience import (
    BreakerState,
    CircuitBreaker,
    LatencyWindow,
    PeakEwma,
    RetryBudget,
    TokenBucket,
)

_MAX_AFFINITY = 100_000  # remembered sessions per client
_MAX_ABSENT = 10_000  # instances remembered as not listening
_MIN_RESERVE = 0.5  # seconds kept for a retry elsewhere, at least: a busy machine's round trip


class Router:
    def __init__(
        self,
        *,
        breaker_cooldown: float = 5.0,
        retry_ratio: float = 0.2,
        rate_limits: dict[str, tuple[float, float]] | None = None,
        weights: dict[str, Weights] | None = None,
        task_types: dict[str, str] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.rng = rng or random.Random()
        self.breaker_cooldown = breaker_cooldown
        self.budget = RetryBudget(ratio=retry_ratio)
        self.inflight: dict[str, int] = {}
        self.ewma: dict[str, PeakEwma] = {}
        self.cap_latency: dict[str, LatencyWindow] = {}
        self.cap_typical: dict[str, float] = {}
        self.instance_breakers: dict[str, CircuitBreaker] = {}
        #: times each instance's breaker opened (for metrics; dropped when it leaves)
        self.breaker_openings: dict[str, int] = {}
        self.cap_breakers: dict[str, CircuitBreaker] = {}
        self.affinity: dict[tuple[str, str], str] = {}
        self._sessions: dict[str, set[tuple[str, str]]] = {}  # agent id -> its affinity keys
        self._departed: dict[str, int] = {}  # left the table with attempts still in flight
        #: instances whose direct subject answered no-responders, and when: nobody listens
        #: there, whatever their lease says (a dead agent's lease outlives it); until they
        #: answer, their record is written again, or they leave the table
        self.absent: dict[str, float] = {}
        self.rate_limits = dict(rate_limits or {})
        self.buckets: dict[str, TokenBucket] = {}
        self.weights: dict[str, Weights] = dict(weights or {})
        self.task_types: dict[str, str] = dict(task_types or {})

    # -- before a request --------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """Three-level routing: a task type maps to the capability that serves it."""
        return self.task_types.get(name, name)

    def admit_call(self, capability: str, now: float) -> tuple[str | None, bool]:
        """Why the request must fail fast (rate limit or open capability breaker), or None;
        and whether it took the capability breaker's half-open probe: then, and only then,
        its end goes to ``call_ended``."""
        limit = self.rate_limits.get(capability)
        if limit is not None:
            bucket = self.buckets.get(capability)
            if bucket is None:
                bucket = self.buckets[capability] = TokenBucket(limit[0], limit[1], now)
            if not bucket.take(now):
                return "resource_exhausted", False
        breaker = self.cap_breakers.get(capability)
        if breaker is None:
            return None, False
        was = breaker.probing
        if not breaker.allow(now):
            return "circuit_open", False
        return None, breaker.probing and not was

    def call_ended(self, capability: str, outcome: str, now: float) -> None:
        """The call that took the capability's probe ended (perhaps telling the breaker
        nothing): an answer closes the breaker; anything else opens it for a cooldown."""
        breaker = self.cap_breakers.get(capability)
        if breaker is None or not breaker.probing:
            return
        if outcome in UNANSWERED or outcome in FAILOVER:
            breaker.release(now)
        else:
            breaker.success(now)

    # -- choosing ----------------------------------------------------------------------

    def choose(
        self,
        policy: Policy,
        table: TableView | None,
        capability: str,
        version: str | None,
        tags: tuple[str, ...],
        priority: Priority,
        tried: Sequence[str],
        affinity_key: str | None,
        now: float,
        *,
        send: bool = True,
        avoid: Collection[str] = (),
    ) -> Choice:
        """The next target. The queue group when the table knows no instance of the
        capability at all, or every one that fits is in ``avoid`` (the caller decides what
        that means); ``CapabilityNotFound`` when instances exist but none fits.
        ``send=False``: only asking (a route query); a breaker's probe slot is not taken."""
        if policy is Policy.QUEUE or table is None:
            return Choice(None)
        if not table.offers(capability):
            return Choice(None)
        ids = table.eligible_ids(capability, version, tags, priority)
        if not ids:
            offering = table.offering(capability)
            raise CapabilityNotFound(
                explain_miss(offering, capability, version, tags, priority), capability=capability
            )
        if avoid:
            ids = [i for i in ids if i not in avoid]
            if not ids:
                return Choice(None)
        if self.absent:
            present = [i for i in ids if i not in self.absent]
            if not present:
                if version is None and not tags:
                    return Choice(None)  # every listed instance is gone: NATS knows who is
                raise AgentUnavailable(  # the queue group would not keep to version and tags
                    f"every instance of {capability!r} that fits is gone (nobody listens on"
                    " its subject)",
                    capability=capability,
                )
            ids = present
        pool = self._usable(ids, tried, now)
        if (
            not pool
            and tried
            and all(
                i == tried[-1]
                or i not in self.instance_breakers
                or self.instance_breakers[i].would_allow(now)
                for i in ids
            )
        ):
            return Choice(None)  # only the instance just tried is left: let NATS choose
        if not pool:
            early = self._early_probe(ids, tried)
            if early is not None:
                if send:
                    self.instance_breakers[early].early_probe()
                return Choice(early, send)
            raise CircuitOpen(
                f"every instance of {capability!r} is unavailable or its circuit is open",
                capability=capability,
            )
        take = self._take if send else look
        if policy is Policy.AFFINITY and affinity_key is not None:
            sticky = self.affinity.get((capability, affinity_key))
            if sticky is not None and sticky in pool:
                return take(sticky, now)
        if policy is Policy.SCORED:
            weights = self.weights.get(capability, Weights())
            records = [table.records[i] for i in pool]
            ranked = rank(records, capability, version, tags, priority, weights)
            if not ranked:
                raise CapabilityNotFound(
                    f"no instance of {capability!r} scores above {weights.threshold}",
                    capability=capability,
                )
            return take(ranked[0][0].info.agent_id, now)
        typical = self.cap_typical.get(capability, 1.0)

        def cost(agent_id: str) -> float:
            ewma = self.ewma.get(agent_id)
            return balanced_cost(
                table.records[agent_id],
                self.inflight.get(agent_id, 0),
                ewma.value if ewma is not None else None,
                typical,
            )

        return take(two_choices(pool, self.rng, cost), now)

    def reserve(
        self,
        table: TableView,
        capability: str,
        version: str | None,
        tags: tuple[str, ...],
        priority: Priority,
        target: str,
        tried: Sequence[str],
        now: float,
    ) -> float:
        """Seconds to keep back from an attempt on ``target`` for a retry elsewhere: the
        time the fastest other usable instance typically takes (known from its answers),
        three times over and at least ``_MIN_RESERVE`` (0.0 when there is none). The caller
        cuts only when this is at most half of what is left: work that takes a good part of
        the deadline is never cut, and a frozen ``target`` (however fast it used to be)
        leaves time for the other.
        Only a caller whose work may run twice cuts an attempt short for it."""
        if not table.offers(capability):
            return 0.0

        best: float | None = None
        for other in self._usable(table.eligible_ids(capability, version, tags, priority), (), now):
            if other == target or other in tried or other in self.absent:
                continue
            ewma = self.ewma.get(other)
            if ewma is not None and (best is None or ewma.value < best):
                best = ewma.value
        return 0.0 if best is None else max(3 * best / 1000, _MIN_RESERVE)

    def _usable(self, ids: list[str], tried: Sequence[str], now: float) -> list[str]:
        """Instances whose breaker lets traffic through, untried ones first, never the one
        tried last."""
        breakers = self.instance_breakers
        if not tried and not breakers:
            return ids
        last = tried[-1] if tried else None
        allowed = [
            i for i in ids if i != last and (i not in breakers or breakers[i].would_allow(now))
        ]
        fresh = [i for i in allowed if i not in tried]
        return fresh or allowed

    def _early_probe(self, ids: list[str], tried: Sequence[str]) -> str | None:
        """Of instances whose breaker opened and has not sent its early probe, the one
        that opened first (never one already tried by this call)."""
        best: str | None = None
        opened = 0.0
        for i in ids:
            breaker = self.instance_breakers.get(i)
            if (
                breaker is not None
                and breaker.early_probe_ready()
                and i not in tried
                and (best is None or breaker.opened_at < opened)
            ):
                best, opened = i, breaker.opened_at
        return best

    def release_probe(self, agent_id: str) -> None:
        """A probe slot taken by ``choose`` but never sent: free it, learning nothing."""
        breaker = self.instance_breakers.get(agent_id)
        if breaker is not None:
            breaker.give_back()

    def renewed(self, agent_id: str) -> None:
        """The instance's record was written again (a heartbeat, a new registration): it
        may be back (restarted under the same id), so it is tried again."""
        if self.absent:
            self.absent.pop(agent_id, None)

    def _take(self, agent_id: str, now: float) -> Choice:
        breaker = self.instance_breakers.get(agent_id)
        if breaker is not None and breaker.state is not BreakerState.CLOSED:
            return Choice(agent_id, breaker.allow(now))  # the half-open probe
        return Choice(agent_id)

    # -- after an attempt --------------------------------------------------------------

    def started(self, agent_id: str | None) -> None:
        if agent_id is not None:
            self.inflight[agent_id] = self.inflight.get(agent_id, 0) + 1

    def finished(
        self,
        agent_id: str | None,
        capability: str,
        outcome: str,
        latency_ms: float,
        now: float,
        affinity_key: str | None = None,
        probe: bool = False,
    ) -> None:
        """Learn from one attempt; ``started`` must have been called for it. ``probe``: it
        was its breaker's probe (``Choice.probe``)."""
        if agent_id is not None:
            n = self.inflight.get(agent_id)
            if n is None:
                left = self._departed.get(agent_id)
                if left is not None:  # it left the table while this was in flight
                    if left > 1:
                        self._departed[agent_id] = left - 1
                    else:
                        del self._departed[agent_id]
                    breaker = self.instance_breakers.get(agent_id) if probe else None
                    if breaker is not None:  # it came back meanwhile: never keep its slot
                        if outcome == "ok":
                            breaker.success(now)
                        else:
                            breaker.release(now)
                    return  # nothing to learn about an instance that is gone
            elif n > 1:
                self.inflight[agent_id] = n - 1
            else:
                del self.inflight[agent_id]  # only instances with work in flight stay
        if outcome == "ok":
            window = self.cap_latency.get(capability)
            if window is None:
                window = self.cap_latency[capability] = LatencyWindow()
            window.add(latency_ms)
            typical = self.cap_typical.get(capability)
            self.cap_typical[capability] = (
                latency_ms if typical is None else typical + 0.1 * (latency_ms - typical)
            )
            if agent_id is None:
                return
            ewma = self.ewma.get(agent_id)
            if ewma is None:
                ewma = self.ewma[agent_id] = PeakEwma()
            ewma.observe(latency_ms, now)
            if self.absent:
                self.absent.pop(agent_id, None)
            if affinity_key is not None:
                self._stick((capability, affinity_key), agent_id)
            breaker = self.instance_breakers.get(agent_id)
            if breaker is not None:
                breaker.success(now)
                if breaker.clean():
                    del self.instance_breakers[agent_id]
            return
        if agent_id is None:
            return
        if probe and (outcome in UNANSWERED or outcome == "no_responders"):
            breaker = self.instance_breakers.get(agent_id)
            if breaker is not None:
                breaker.release(now)  # the probe taught the breaker nothing
        if outcome in UNANSWERED:
            return
        if outcome == "no_responders":
            # Nobody listens there: passed over while absent. Not a breaker failure: an
            # open breaker's half-open probe would refuse every other request meanwhile.
            self.absent.pop(agent_id, None)  # re-inserted last: the oldest go first
            self.absent[agent_id] = now
            if len(self.absent) > _MAX_ABSENT:
                del self.absent[next(iter(self.absent))]
            return
        if self.absent and outcome != "timeout":
            self.absent.pop(agent_id, None)  # it answered: it is there
        breaker = self.instance_breakers.get(agent_id)
        if outcome in INSTANCE_FAILURE:
            if breaker is None:
                breaker = self.instance_breakers[agent_id] = CircuitBreaker(
                    cooldown=self.breaker_cooldown
                )
            was_open = breaker.state is BreakerState.OPEN
            breaker.failure(now)
            if not was_open and breaker.state is BreakerState.OPEN:
                self.breaker_openings[agent_id] = self.breaker_openings.get(agent_id, 0) + 1
        elif breaker is not None:  # it answered (bad_request, ...): the instance works
            breaker.success(now)
            if breaker.clean():
                del self.instance_breakers[agent_id]

    def _stick(self, key: tuple[str, str], agent_id: str) -> None:
        """Remember the session's instance (least recently used sessions go first)."""
        old = self.affinity.pop(key, None)
        if old is not None and old != agent_id:
            self._unstick(old, key)
        self.affinity[key] = agent_id
        keys = self._sessions.get(agent_id)
        if keys is None:
            keys = self._sessions[agent_id] = set()
        keys.add(key)
        if len(self.affinity) > _MAX_AFFINITY:
            oldest = next(iter(self.affinity))
            self._unstick(self.affinity.pop(oldest), oldest)

    def _unstick(self, agent_id: str, key: tuple[str, str]) -> None:
        keys = self._sessions.get(agent_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._sessions[agent_id]

    def forget(self, agent_id: str) -> None:
        """The instance left the routing table: drop everything learnt about it."""
        outstanding = self.inflight.pop(agent_id, 0)
        if outstanding:
            self._departed[agent_id] = self._departed.get(agent_id, 0) + outstanding
        self.ewma.pop(agent_id, None)
        self.instance_breakers.pop(agent_id, None)
        self.breaker_openings.pop(agent_id, None)
        self.absent.pop(agent_id, None)
        for key in self._sessions.pop(agent_id, ()):
            if self.affinity.get(key) == agent_id:
                del self.affinity[key]

    def footprint(self) -> dict[str, int]:
        """Sizes of the router's maps: per instance (``router.``) and per capability."""
        return {
            "router.inflight": len(self.inflight),
            "router.ewma": len(self.ewma),
            "router.instance_breakers": len(self.instance_breakers),
            "router.breaker_openings": len(self.breaker_openings),
            "router.affinity": len(self.affinity),
            "router.sessions": len(self._sessions),
            "router.departed": len(self._departed),
            "router.absent": len(self.absent),
            "capabilities.latency": len(self.cap_latency),
            "capabilities.breakers": len(self.cap_breakers),
            "capabilities.rate_limits": len(self.buckets),
        }

    def request_done(self, capability: str, ok: bool, now: float) -> None:
        """The capability breaker counts whole requests, after failover."""
        breaker = self.cap_breakers.get(capability)
        if ok:
            if breaker is not None:
                breaker.success(now)
            return
        if breaker is None:
            breaker = self.cap_breakers[capability] = CircuitBreaker(cooldown=self.breaker_cooldown)
        breaker.failure(now)

    def hedge_delay(self, capability: str) -> float | None:
        """Seconds to wait before a hedge: the capability's p95 latency (None: too few)."""
        window = self.cap_latency.get(capability)
        p95 = window.quantile(0.95) if window is not None else None
        return None if p95 is None else p95 / 1000
