"""Spans only when the application configured a tracer provider: decided once, when the
``Telemetry`` is made, so the telemetry-off path never touches OpenTelemetry."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Tracer, TracerProvider

__all__ = ["ATTR", "resolve_tracer"]


def resolve_tracer(provider: TracerProvider | None) -> Tracer | None:
    """The tracer for Reach's spans, or None when nobody collects them."""
    if provider is None:
        provider = trace.get_tracer_provider()
    if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
        return None  # no SDK configured: spans would be thrown away
    return provider.get_tracer("reach")


class ATTR:
    """Attribute names: OpenTelemetry's messaging conventions, and Reach's own."""

    SYSTEM = "messaging.system"
    DESTINATION = "messaging.destination.name"
    OPERATION = "messaging.operation.type"
    OPERATION_NAME = "messaging.operation.name"
    MESSAGE_ID = "messaging.message.id"
    CAPABILITY = "reach.capability"
    AGENT_ID = "reach.agent_id"
    ATTEMPT = "reach.attempt"
    OUTCOME = "reach.outcome"
    POLICY = "reach.routing_policy"
    PRIORITY = "reach.priority"
    TASK_ID = "reach.task_id"
    ASKED = "reach.gather.asked"  # instances a gather sent to
    ANSWERED = "reach.gather.answered"  # of them, those that answered
