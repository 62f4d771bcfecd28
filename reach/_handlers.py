"""How a user function becomes a capability or topic handler: typed decoding and context."""

from __future__ import annotations

import inspect
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._codec import PayloadDecoder, decoder_for, now_ms
from .wire import Priority

if TYPE_CHECKING:
    from ._client import Client

Handler = Callable[..., Awaitable[Any]]
#: what a capability may be: a ``Handler``, or an async generator of its reply's chunks
Capable = Callable[..., Awaitable[Any] | AsyncIterator[Any]]


@dataclass(slots=True)
class Context:
    """What a handler may want to know about the request it serves.

    It names the serving instance (``agent_id``) and carries the agent's ``client`` for calls
    to other capabilities; it does not hold the Agent itself, so a handler cannot stop,
    pause or reconfigure the agent that runs it.
    """

    agent_id: str
    client: Client
    capability: str
    request_id: str
    priority: Priority
    deadline_ms: int | None
    caller: str
    attempt: int
    headers: dict[str, str] = field(default_factory=dict)

    def remaining(self) -> float | None:
        """Seconds left before the caller's deadline (None when it set none)."""
        if self.deadline_ms is None:
            return None
        return max(0.0, (self.deadline_ms - now_ms()) / 1000)


@dataclass(slots=True)
class HandlerSpec:
    """A handler with the decoder for its payload parameter and whether it takes a Context.
    ``streams``: an async generator, whose items are the chunks of a streaming reply."""

    fn: Callable[..., Any]  # a Handler, or (``streams``) an async generator function
    decode: PayloadDecoder
    wants_context: bool
    streams: bool = False


def inspect_handler(fn: Capable, what: str, *, may_stream: bool = False) -> HandlerSpec:
    """Read the payload type from the first parameter's annotation (bytes, dict, Struct...).
    ``may_stream``: an async generator is accepted too (a capability's streaming reply)."""
    streams = inspect.isasyncgenfunction(fn)
    if streams and not may_stream:
        raise TypeError(
            f"{what} handler {fn!r} is an async generator: only a capability may stream"
        )
    if not streams and not inspect.iscoroutinefunction(fn):
        raise TypeError(f"{what} handler {fn!r} must be an async function")
    params = list(inspect.signature(fn).parameters.values())
    if not params or len(params) > 2:
        raise TypeError(f"{what} handler {fn.__name__} must take (payload) or (payload, ctx)")
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError) as exc:
        raise TypeError(f"{what} handler {fn.__name__}: cannot resolve annotations: {exc}") from exc
    payload_type = hints.get(params[0].name, Any)
    try:
        decode = decoder_for(payload_type)
    except TypeError as exc:
        raise TypeError(
            f"{what} handler {fn.__name__}: payload type {payload_type!r} is not decodable: {exc}"
        ) from exc
    return HandlerSpec(fn, decode, len(params) == 2, streams)


@dataclass(slots=True)
class TaskContext(Context):
    """The Context of a durable task: also its ``task_id``, and ``progress()``.

    ``attempt`` counts runs of this task (1 on the first), so a handler can make its own
    side effects idempotent, e.g. by keying them on ``(task_id, attempt)`` or on
    ``headers["Reach-Idempotency-Key"]``.
    """

    task_id: str = ""
    report: Callable[[float, str], Awaitable[None]] | None = None

    async def progress(self, fraction: float, note: str = "") -> None:
        """Record how far the task is (0..1) and a short note in its record."""
        if self.report is not None:
            await self.report(min(1.0, max(0.0, float(fraction))), note[:200])
