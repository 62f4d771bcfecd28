"""Tracing for the ``reach`` entry points, from settings: the SDK with a console or OTLP
exporter. Applications that configure OpenTelemetry themselves never call this."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from ..settings import ReachSettings

__all__ = ["configure_tracing"]


def configure_tracing(settings: ReachSettings, service: str) -> TracerProvider | None:
    """A tracer provider as the settings ask (None for ``trace_exporter=none``)."""
    if settings.trace_exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    exporter: SpanExporter
    if settings.trace_exporter == "console":
        exporter = ConsoleSpanExporter()
    else:
        if not settings.otlp_endpoint:
            raise ConfigurationError("trace_exporter=otlp needs REACH_OTLP_ENDPOINT")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigurationError(
                "trace_exporter=otlp needs the otlp extra: pip install 'agent-reach-nats[otlp]'"
            ) from None
        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint)
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
