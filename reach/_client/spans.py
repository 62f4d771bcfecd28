"""The client's spans: one CLIENT span per request attempt, its context sent on in the
``traceparent`` header. Only reached when a tracer provider is configured."""

from __future__ import annotations

import asyncio

from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from .._inbox import Inbox, Reply
from .._telemetry import ATTR
from ..errors import RemoteError
from ..wire import Header
from .call import Call

__all__ = ["traced_attempt"]


async def traced_attempt(
    tracer: Tracer,
    inbox: Inbox,
    call: Call,
    subject: str,
    headers: dict[str, str],
    budget: float,
    target: str | None,
    lossy: bool = False,
) -> Reply:
    with tracer.start_as_current_span(
        f"send {call.capability}",
        kind=SpanKind.CLIENT,
        attributes={
            ATTR.SYSTEM: "nats",
            ATTR.DESTINATION: subject,
            ATTR.OPERATION: "send",
            ATTR.CAPABILITY: call.capability,
            ATTR.POLICY: call.policy.value,
            ATTR.ATTEMPT: int(headers.get(Header.ATTEMPT, "1")),
            ATTR.AGENT_ID: target or "",
        },
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        carrier = dict(headers)  # the shared headers stay free of this attempt's span
        propagate.inject(carrier)
        try:
            reply = await inbox.send(
                call,
                subject,
                carrier,
                budget,
                target,
                measure=True,
                lossy=lossy,
                stream=call.stream,
            )
        except asyncio.CancelledError:
            span.set_attribute(ATTR.OUTCOME, "cancelled")  # a hedge loser, a caller gone
            raise
        except RemoteError as exc:
            span.set_attribute(ATTR.OUTCOME, exc.outcome)
            if exc.agent_id:
                span.set_attribute(ATTR.AGENT_ID, exc.agent_id)
            span.set_status(Status(StatusCode.ERROR, exc.code))
            raise
        span.set_attribute(ATTR.OUTCOME, "ok")
        span.set_attribute(ATTR.AGENT_ID, reply.agent_id)
        return reply
