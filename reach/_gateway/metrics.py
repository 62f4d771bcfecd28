"""The gateway's HTTP metrics: requests by route template, method and status code, and
latency by route, kept as plain numbers and reported to the client's ``Telemetry`` at
scrape time like every other Reach source. Labels are bounded: routes are the app's
templates (``/v1/tasks/{task_id}``), anything unmatched is one ``unmatched`` series."""

from __future__ import annotations

from .._telemetry import LATENCY_BUCKETS, Emitter, Histogram

__all__ = ["HttpMetrics"]

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_MAX_ROUTES = 256


class HttpMetrics:
    """Counts of one gateway app; ``collect`` is its ``Telemetry`` source."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.latency: dict[str, Histogram] = {}
        self.in_flight = 0

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        latency = self.latency.get(route)
        if latency is None:
            if len(self.latency) >= _MAX_ROUTES:
                route = "unmatched"
                latency = self.latency.get(route)
            if latency is None:
                latency = self.latency[route] = Histogram(LATENCY_BUCKETS)
        latency.observe(seconds)
        key = (route, method if method in _METHODS else "OTHER", str(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def collect(self, out: Emitter) -> None:
        for labels, n in list(self.requests.items()):
            out.counter("reach_gateway_http_requests", labels, n)
        for route, hist in list(self.latency.items()):
            out.histogram("reach_gateway_http_request_duration_seconds", (route,), hist)
        out.gauge("reach_gateway_http_requests_in_flight", (), self.in_flight)
