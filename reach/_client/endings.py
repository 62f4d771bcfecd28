"""What is left when attempts end: losers reaped, and the error that says what was
tried."""

from __future__ import annotations

import asyncio

from ..errors import (
    AgentUnavailable,
    Attempt,
    CapabilityNotFound,
    RemoteError,
    RequestTimeout,
    ResourceExhausted,
)
from .inbox import Reply

__all__ = ["exhausted", "reap"]


async def reap(tasks: list[asyncio.Task[Reply]]) -> None:
    """Cancel what still runs and wait until all of it has ended, even if cancelled
    meanwhile (then re-raise): no attempt outlives its request."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    interrupted = False
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            interrupted = True
        pending = [t for t in pending if not t.done()]
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: a loser's error is not "never retrieved"
    if interrupted:
        raise asyncio.CancelledError


def exhausted(
    capability: str, attempts: list[Attempt], last: RemoteError | None, wait: float
) -> RemoteError:
    """The error for a request whose attempts all failed, saying what was tried."""
    tried = "; ".join(
        f"{a.agent_id or 'queue'}: {a.outcome} in {a.duration_ms:.0f} ms" for a in attempts
    )
    outcomes = {a.outcome for a in attempts}
    cls: type[RemoteError]
    if not attempts:
        cls, why = RequestTimeout, f"no time left within {wait:g}s"
    elif outcomes <= {"no_responders", "agent_unavailable"}:
        cls = CapabilityNotFound if all(not a.agent_id for a in attempts) else AgentUnavailable
        why = "no agent alive"
    elif outcomes <= {"resource_exhausted", "circuit_open"}:
        cls, why = ResourceExhausted, "all busy"
    else:
        cls, why = RequestTimeout, f"no answer within {wait:g}s"
    detail = f"; last: {last.message}" if last is not None else ""
    return cls(
        f"{capability!r}: {why} after {len(attempts)} attempt(s) [{tried}]{detail}",
        capability=capability,
        agent_id=last.agent_id if last is not None else "",
        request_id=last.request_id if last is not None else "",
        attempts=attempts,
    )
