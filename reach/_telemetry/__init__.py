"""Telemetry: metrics read at scrape, spans only when a tracer provider is configured, and
logs carrying ids. The public face is ``reach.Telemetry``."""

from .catalogue import CATALOGUE, LAG_BUCKETS, LATENCY_BUCKETS, Spec
from .cells import Histogram
from .collector import Emitter, ReachCollector, Source
from .logs import LOG_AGENT, LOG_WORK, IdsFilter, JsonFormatter, configure_logging
from .server import MetricsServer
from .setup import configure_tracing
from .tracing import ATTR, resolve_tracer

__all__ = [
    "ATTR",
    "CATALOGUE",
    "LAG_BUCKETS",
    "LATENCY_BUCKETS",
    "LOG_AGENT",
    "LOG_WORK",
    "Emitter",
    "Histogram",
    "IdsFilter",
    "JsonFormatter",
    "MetricsServer",
    "ReachCollector",
    "Source",
    "Spec",
    "configure_logging",
    "configure_tracing",
    "resolve_tracer",
]
