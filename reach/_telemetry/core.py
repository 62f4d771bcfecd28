"""``Telemetry``: the one object through which Reach is seen, passed in, never global.

Give the same one to every Agent, Client and Registry of a process::

    telemetry = reach.Telemetry(prometheus_client.REGISTRY)  # or a registry of your own
    agent = reach.Agent("billing", telemetry=telemetry, metrics_port=9464)

Metrics: counters and histograms the request path keeps as plain numbers, turned into
Prometheus families when scraped (``/metrics``, or your own exposition of ``registry``).
Scrapes run on the event loop (``/metrics``); scraping ``registry`` from another thread
also works, since sources copy what they read.
Spans: only when a tracer provider is configured (passed, or OpenTelemetry's global one
set before this object is made); otherwise no span object is ever created.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from opentelemetry.trace import Tracer, TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from ..errors import ConfigurationError
from .collector import ReachCollector, Source
from .server import MetricsServer
from .tracing import resolve_tracer

__all__ = ["Attachment", "Telemetry"]

log = logging.getLogger("reach.telemetry")

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
        #: False: no spans, whatever provider exists (``Agent.run`` leaves it off too)
        self.tracing = tracing
        #: None when spans are off (no provider configured, or ``tracing=False``)
        self.tracer: Tracer | None = resolve_tracer(tracer_provider) if tracing else None
        self._collector = ReachCollector()
        if metrics:
            self.registry.register(self._collector)
        self._health: dict[int, tuple[str, HealthCheck]] = {}
        self._servers: dict[tuple[str, int], tuple[MetricsServer, int]] = {}

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
        """All checks; one that raises counts as unhealthy (and is logged)."""
        checks: dict[str, bool] = {}
        for name, check in list(self._health.values()):
            try:
                checks[name] = bool(check())
            except Exception:
                log.exception("health check %s failed", name)
                checks[name] = False
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
        ``port`` served unless None. Parts of one process asking for the same port share
        one server; a port taken by another process is a ``ConfigurationError``."""
        undo = [self.add_source(source), self.add_health(name, healthy)]
        if port is None:
            return Attachment(undo, None, None)
        try:
            key = await self._share(host, port)
        except BaseException:
            for u in undo:
                u()
            raise
        return Attachment(undo, self._servers[key][0], lambda: self._release(key))

    async def _share(self, host: str, port: int) -> tuple[str, int]:
        shared = self._servers.get((host, port)) if port else None
        if shared is not None:
            self._servers[(host, port)] = (shared[0], shared[1] + 1)
            return (host, port)
        try:
            server = await self.serve(port, host)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
                " (REACH_METRICS_PORT; another process has it?)"
            ) from None
        key = (host, server.port)
        self._servers[key] = (server, 1)
        return key

    async def _release(self, key: tuple[str, int]) -> None:
        server, refs = self._servers[key]
        if refs > 1:
            self._servers[key] = (server, refs - 1)
            return
        del self._servers[key]
        await server.close()


class Attachment:
    """One part's presence in a ``Telemetry``: its source, health check and port."""

    def __init__(
        self,
        undo: list[Callable[[], None]],
        server: MetricsServer | None,
        release: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self._undo = undo
        self._release = release
        self.server = server

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    async def close(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []
        release, self._release, self.server = self._release, None, None
        if release is not None:
            await release()
