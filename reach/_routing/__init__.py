"""Routing, pure: who may take a request (policies), the reliability machinery (resilience)
and a client's routing state (router). No I/O, no asyncio, no import of the client: time
comes in as numbers and the routing table is read through ``router.TableView``."""

from .outcomes import FAILOVER, LOST, NOT_COUNTED, Choice, TableView
from .policies import (
    Policy,
    Weights,
    balanced_cost,
    clamp_latency,
    clamp_load,
    eligible,
    explain_miss,
    fan_out,
    in_range,
    normalised,
    rank,
    reject_reason,
    score,
    two_choices,
)
from .resilience import (
    BreakerState,
    CircuitBreaker,
    LatencyWindow,
    PeakEwma,
    RetryBudget,
    TokenBucket,
    backoff_delay,
)
from .router import Router

__all__ = [
    "FAILOVER",
    "LOST",
    "NOT_COUNTED",
    "BreakerState",
    "Choice",
    "CircuitBreaker",
    "LatencyWindow",
    "PeakEwma",
    "Policy",
    "RetryBudget",
    "Router",
    "TableView",
    "TokenBucket",
    "Weights",
    "backoff_delay",
    "balanced_cost",
    "clamp_latency",
    "clamp_load",
    "eligible",
    "explain_miss",
    "fan_out",
    "in_range",
    "normalised",
    "rank",
    "reject_reason",
    "score",
    "two_choices",
]
