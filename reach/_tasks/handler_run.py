"""One run of a task handler: its context, the call that turns its failure into the task's
outcome, and the CONSUMER span of the attempt (only with a tracer)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Tracer

from .._codec import now_ms
from .._telemetry import ATTR
from ..errors import RemoteError, RetryLater
from .model import ContextFactory, Delivery, HandlerContext

if TYPE_CHECKING:
    from .execute import Executor
    from .model import TaskDecl

__all__ = ["call_handler", "redelivered", "task_context", "task_span"]

log = logging.getLogger("reach.tasks")


async def call_handler(
    decl: TaskDecl, payload: Any, ctx: HandlerContext, on_exit: Callable[[BaseException], bool]
) -> tuple[bool, Any]:
    """(True, result) or (False, the exception): a handler's failure is the task's
    outcome, not a crash of ours. As on the request path, an exception that is not a
    refusal (``RemoteError``) is logged with its traceback under the task id; the task's
    record keeps only its code and message."""
    try:
        if decl.spec.wants_context:
            return True, await decl.spec.fn(payload, ctx)
        return True, await decl.spec.fn(payload)
    except (RemoteError, RetryLater) as exc:
        return False, exc  # a refusal (the task's answer), or a retry asked for: no fault
    except Exception as exc:
        _log(ctx, " failed")
        return False, exc
    except (KeyboardInterrupt, SystemExit) as stop:
        if not on_exit(stop):
            raise
        _log(ctx, ": the handler stopped the process")
        return False, RuntimeError("the handler stopped the process")


def _log(ctx: HandlerContext, what: str) -> None:
    """Called in an ``except`` block: the exception being handled is logged with it."""
    log.error(
        "agent %s: task %s (%s, attempt %d)%s",
        ctx.agent_id,
        ctx.task_id,
        ctx.capability,
        ctx.attempt,
        what,
        exc_info=True,
    )


def task_context(
    make: ContextFactory, agent_id: str, client: object, ex: Executor, d: Delivery, timeout: float
) -> HandlerContext:
    async def report(fraction: float, note: str) -> None:
        await ex.progress(d, fraction, note)

    return make(
        agent_id=agent_id,
        client=client,
        capability=d.sub.capability,
        request_id=d.task_id,
        priority=d.sub.priority,
        deadline_ms=now_ms() + int(timeout * 1000),
        caller=d.sub.caller,
        attempt=d.n,
        headers=dict(d.msg.headers or {}),
        task_id=d.task_id,
        report=report,
    )


def redelivered(d: Delivery) -> bool:
    """JetStream delivered this message before (to us or to another agent)."""
    try:
        return int(d.msg.metadata.num_delivered) > 1
    except (ValueError, TypeError, AttributeError, IndexError):
        return False  # not a JetStream reply subject (cannot happen for a pulled task)


@contextmanager
def task_span(tracer: Tracer, agent_id: str, d: Delivery) -> Iterator[None]:
    """The attempt's span, child of the submit's, current while the handler runs and the
    result and callback are written. The context comes from the message's headers (W3C
    ``traceparent``/``tracestate``, as any SDK sends it), else from the task body (a task
    republished by a recovery sweep or replayed from the DLQ keeps its trace that way)."""
    headers = d.msg.headers or {}
    if "traceparent" in headers:
        carrier = headers
    else:
        carrier = {"traceparent": d.sub.traceparent} if d.sub.traceparent else {}
    with tracer.start_as_current_span(
        f"process {d.sub.capability}",
        context=propagate.extract(carrier),
        kind=SpanKind.CONSUMER,
        attributes={
            ATTR.SYSTEM: "nats",
            ATTR.DESTINATION: d.msg.subject,
            ATTR.OPERATION: "process",
            ATTR.CAPABILITY: d.sub.capability,
            ATTR.AGENT_ID: agent_id,
            ATTR.TASK_ID: d.task_id,
            ATTR.PRIORITY: d.sub.priority.value,
        },
    ) as span:
        try:
            yield
        finally:
            span.set_attribute(ATTR.ATTEMPT, d.n)
            span.set_attribute(ATTR.OUTCOME, d.outcome or "not_run")
