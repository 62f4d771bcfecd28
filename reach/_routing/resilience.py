"""Pure reliability machinery: backoff, retry budget, circuit breakers, token buckets,
and peak-EWMA latency. No I/O and no event loop: time is passed in."""

from __future__ import annotations

import enum
import math
import random
from collections import deque
from dataclasses import dataclass, field


def backoff_delay(
    attempt: int, rng: random.Random, *, base: float = 0.2, cap: float = 3.0
) -> float:
    """Exponential backoff with full jitter: uniform(0, min(cap, base * 2**(attempt-1)))."""
    if attempt < 1:
        return 0.0
    return rng.uniform(0.0, min(cap, base * 2 ** (attempt - 1)))


class RetryBudget:
    """Retries at most ``ratio`` of requests over a sliding window, plus a small floor,
    so a bad minute never multiplies traffic (after Finagle's RetryBudget).

    Counts live in a ring of ``slots`` buckets spanning the window, so memory stays the same
    however many requests pass; the window slides one bucket (window / slots) at a time.
    """

    def __init__(
        self, *, ratio: float = 0.2, floor: int = 10, window: float = 10.0, slots: int = 10
    ) -> None:
        self.ratio = ratio
        self.floor = floor
        self.window = window
        self._width = window / slots
        self._requests = [0] * slots
        self._retries = [0] * slots
        self._slot = 0  # the bucket "now" falls in: int(now / width)
        self._total_requests = 0
        self._total_retries = 0

    def _advance(self, slot: int) -> None:
        """Move to bucket ``slot``, emptying the buckets the window left behind."""
        n = len(self._requests)
        for k in range(self._slot + 1, self._slot + 1 + min(slot - self._slot, n)):
            i = k % n
            self._total_requests -= self._requests[i]
            self._total_retries -= self._retries[i]
            self._requests[i] = self._retries[i] = 0
        self._slot = slot

    def record_request(self, now: float) -> None:
        slot = int(now / self._width)
        if slot > self._slot:
            self._advance(slot)
        self._requests[self._slot % len(self._requests)] += 1
        self._total_requests += 1

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget allows it."""
        slot = int(now / self._width)
        if slot > self._slot:
            self._advance(slot)
        if self._total_retries >= self.floor + self.ratio * self._total_requests:
            return False
        self._retries[self._slot % len(self._retries)] += 1
        self._total_retries += 1
        return True

    @property
    def retries(self) -> int:
        return self._total_retries


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens when the error rate over the last ``window`` outcomes passes ``threshold`` (with
    at least ``min_volume`` outcomes) or after ``max_consecutive`` failures in a row; stays
    open for ``cooldown``; then lets one probe through (half-open)."""

    def __init__(
        self,
        *,
        window: int = 20,
        min_volume: int = 10,
        threshold: float = 0.5,
        max_consecutive: int = 5,
        cooldown: float = 5.0,
    ) -> None:
        self.window = window
        self.min_volume = min_volume
        self.threshold = threshold
        self.max_consecutive = max_consecutive
        self.cooldown = cooldown
        self.state = BreakerState.CLOSED
        self._outcomes: deque[bool] = deque(maxlen=window)
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self._early = False  # one probe before the cooldown ends, per opening from CLOSED

    def allow(self, now: float) -> bool:
        """May a request go through now? (Half-open admits one probe at a time.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now - self._opened_at < self.cooldown:
                return False
            self.state = BreakerState.HALF_OPEN
            self._probing = False
        if self._probing:
            return False
        self._probing = True
        return True

    def would_allow(self, now: float) -> bool:
        """Like ``allow`` without taking the half-open probe slot."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now - self._opened_at >= self.cooldown
        return not self._probing

    @property
    def probing(self) -> bool:
        """Half-open with its probe out."""
        return self.state is BreakerState.HALF_OPEN and self._probing

    def early_probe_ready(self) -> bool:
        """Open, newly (from CLOSED), and its early probe not yet sent."""
        return self.state is BreakerState.OPEN and self._early

    @property
    def opened_at(self) -> float:
        return self._opened_at

    def early_probe(self) -> None:
        """Send one probe before the cooldown ends: what opened a breaker may be an
        instance that is gone (a dead agent's requests time out), which a probe learns at
        once (no-responders). Once per opening, so a live instance that fails gets one
        request more, not a stream of them."""
        self._early = False
        self.state = BreakerState.HALF_OPEN
        self._probing = True

    def give_back(self) -> None:
        """The probe slot was taken but nothing was sent: it is free again."""
        if self.state is BreakerState.HALF_OPEN:
            self._probing = False

    def release(self, now: float) -> None:
        """The probe ended without an outcome for the breaker (nobody listened, the
        connection was lost, it was cancelled): open again for a cooldown, so the slot is
        never held for good, nor given back at once (callers giving up on a hanging
        instance would each send one more)."""
        if self.state is BreakerState.HALF_OPEN:
            self._open(now, early=False)

    def clean(self) -> bool:
        """Closed with no failure in its window: nothing worth remembering."""
        return self.state is BreakerState.CLOSED and all(self._outcomes)

    def success(self, now: float) -> None:
        self._consecutive = 0
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            self._outcomes.clear()
            self._probing = False
        self._outcomes.append(True)

    def failure(self, now: float) -> None:
        self._consecutive += 1
        self._outcomes.append(False)
        if self.state is BreakerState.HALF_OPEN:
            self._open(now, early=False)
            return
        if self.state is BreakerState.OPEN:
            return  # an attempt sent before it opened: it stays open as it was
        failures = sum(1 for ok in self._outcomes if not ok)
        if self._consecutive >= self.max_consecutive or (
            len(self._outcomes) >= self.min_volume
            and failures / len(self._outcomes) > self.threshold
        ):
            self._open(now, early=True)

    def _open(self, now: float, *, early: bool) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = now
        self._probing = False
        self._early = early


class TokenBucket:
    """``rate`` tokens per second up to ``burst``; a request takes one or fails fast."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = now

    def take(self, now: float) -> bool:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


@dataclass(slots=True)
class PeakEwma:
    """Latency that jumps up at once on a slow reply and decays slowly (time constant
    ``tau`` seconds), as in Finagle's and Linkerd's peak-EWMA balancers."""

    tau: float = 1.0
    value: float = 0.0
    at: float = 0.0
    samples: int = 0

    def observe(self, latency_ms: float, now: float) -> None:
        if self.samples == 0 or latency_ms > self.value:
            self.value = latency_ms
        else:
            w = math.exp(-max(0.0, now - self.at) / self.tau)
            self.value = self.value * w + latency_ms * (1.0 - w)
        self.at = now
        self.samples += 1


@dataclass(slots=True)
class LatencyWindow:
    """The last ``size`` latencies of a capability, for its p95 (the hedging delay)."""

    size: int = 200
    values: deque[float] = field(default_factory=lambda: deque(maxlen=200))

    def add(self, latency_ms: float) -> None:
        self.values.append(latency_ms)

    def quantile(self, q: float) -> float | None:
        if len(self.values) < 20:
            return None
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
