"""``Telemetry``: the one object through which Reach is seen, passed in, never global.

Give the same one to every Agent, Client and Registry of a process::

    telemetry = reach.Telemetry(prometheus_client.REGISTRY)  # or a registry of your own
    agent = reach.Agent("billing", telemetry=telemetry, metrics_port=9464)

Metrics: counters and histograms the request path keeps as plain numbers, turned into
Prometheus families when scraped (``/metrics``, or your own exposition of ``registry``).
Spans: only when a tracer provider is configured (passed, or OpenTelemetry's global one
set before this object is made); otherwise no span object is ever created.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.trace import Tracer, TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from ._telemetry import (
    IdsFilter,
    JsonFormatter,
    MetricsServer,
    ReachCollector,
    Source,
    configure_logging,
    resolve_tracer,
)

__all__ = [
    "Attachment",
    "IdsFilter",
    "JsonFormatter",
    "MetricsServer",
    "Telemetry",
    "configure_logging",
]

HealthCheck = Callable[[], bool]


class Telemetry:
    """Metrics registry, tracer and health checks for the Reach objects of one process."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        tracer_provider: TracerProvider | None = None,
        metrics: bool = True,
        tracing: bool = True,
    ) -> None:
        #: where Reach's metrics are registered; a fresh one unless you pass yours
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = metrics
        #: None when spans are off (no provider configured, or ``tracing=False``)
        self.tracer: Tracer | None = resolve_tracer(tracer_provider) if tracing else None
        self._collector = ReachCollector()
        if metrics:
            self.registry.register(self._collector)
        self._health: dict[int, tuple[str, HealthCheck]] = {}

    @classmethod
    def off(cls) -> Telemetry:
        """No metrics and no spans (the baseline of the telemetry benchmark)."""
        return cls(metrics=False, tracing=False)

    @property
    def scrape_errors(self) -> int:
        return self._collector.errors

    def add_source(self, source: Source) -> Callable[[], None]:
        """Have ``source(emitter)`` report at every scrape; returns its remover."""
        if not self.metrics:
            return lambda: None
        return self._collector.add(source)

    def add_health(self, name: str, check: HealthCheck) -> Callable[[], None]:
        """A part of the process that must be well for ``/healthz`` to say 200."""
        key = id(check)
        self._health[key] = (name, check)
        return lambda: self._health.pop(key, None) and None

    def health(self) -> tuple[bool, dict[str, object]]:
        checks = {name: bool(check()) for name, check in list(self._health.values())}
        return all(checks.values()), {"checks": checks}

    def exposition(self) -> bytes:
        """The Prometheus text format of the registry, as ``/metrics`` serves it."""
        return generate_latest(self.registry)

    async def serve(self, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
        """Serve ``/metrics`` and ``/healthz``; the caller closes the returned server."""
        server = MetricsServer(self.registry, self.health)
        await server.start(host, port)
        return server

    async def attach(
        self, name: str, source: Source, healthy: HealthCheck, port: int | None, host: str
    ) -> Attachment:
        """What an Agent or Registry does at start: its source and health check added, and
        its own port served when ``port`` is not None. ``Attachment.close()`` undoes it."""
        undo = [self.add_source(source), self.add_health(name, healthy)]
        server = None
        if port is not None:
            try:
                server = await self.serve(port, host)
            except BaseException:
                for u in undo:
                    u()
                raise
        return Attachment(undo, server)


class Attachment:
    """One part's presence in a ``Telemetry`` (and its metrics port, if it has one)."""

    def __init__(self, undo: list[Callable[[], None]], server: MetricsServer | None) -> None:
        self._undo = undo
        self.server = server

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    async def close(self) -> None:
        server, self.server = self.server, None
        for undo in self._undo:
            undo()
        self._undo = []
        if server is not None:
            await server.close()
