"""Asking every instance at once: one request to each live instance's direct subject, and
one outcome per instance, never one exception for all.

Who is asked comes from the routing table (``reach._routing.fan_out``): every instance
that a request could go to (UP, or DEGRADED below high priority) in the major version and
with the tags asked for. PAUSED instances refuse new work by the protocol (a paused or
draining agent answers direct calls ``agent_unavailable``), and UNKNOWN and DOWN ones are
being probed because they stopped heartbeating: a request would get nothing from them or
wait out its deadline on a frozen process. They are not asked, and the result names them
under ``skipped``, with their status, so that a missing answer is never silent.

Each request is an attempt like any other (``Requester.attempt``): the router learns its
latency and outcome per instance (breakers, EWMA, absent instances), and metrics and spans
count it. A gather sends once to each instance: nothing is retried, and no instance is
passed over for its breaker or because it answered no-responders before (as with a direct
call by agent id, the caller named whom to ask). The capability's own breaker and rate
limit, which count calls that one instance serves, do not apply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind, Tracer

from .._codec import encode_payload
from .._inbox import Reply
from .._nats import HEADROOM, fits, too_large
from .._routing import Policy, explain_miss, fan_out
from .._telemetry import ATTR
from ..errors import CapabilityNotFound, ConfigurationError, NotStarted, ReachError, RemoteError
from ..wire import Priority
from .attempts import Requester, check_request_id, priority_of, reap
from .call import Call

__all__ = ["GATHER", "Gathered", "gather"]

#: the policy label of a gather's requests in metrics and spans
GATHER = "gather"


@dataclass(frozen=True, slots=True)
class Gathered(Mapping[str, Reply | ReachError]):
    """What a gather got: agent id -> its :class:`Reply`, or the ``ReachError`` that
    request would have raised (``RequestTimeout``, ``AgentUnavailable`` for an instance
    nobody listens for any more, ``HandlerFailed``, ...), in agent id order.

    It holds every instance asked except those in ``unanswered``: asked, but not waited
    for, because ``min_replies`` answers came first. ``skipped`` names the instances that
    serve the capability but were not asked, with why (``"is PAUSED"``)."""

    capability: str
    outcomes: dict[str, Reply | ReachError]
    unanswered: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, agent_id: str) -> Reply | ReachError:
        return self.outcomes[agent_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.outcomes)

    def __len__(self) -> int:
        return len(self.outcomes)

    @property
    def replies(self) -> dict[str, Reply]:
        """The instances that answered, with their answers."""
        return {a: o for a, o in self.outcomes.items() if isinstance(o, Reply)}

    @property
    def errors(self) -> dict[str, ReachError]:
        """The instances that failed, with their errors."""
        return {a: o for a, o in self.outcomes.items() if isinstance(o, ReachError)}


async def gather(
    requests: Requester,
    capability: str,
    payload: Any,
    *,
    timeout: float | None,
    min_replies: int | None,
    priority: Priority | str,
    version: str | None,
    required_tags: Sequence[str],
    response_type: Any,
    request_id: str | None,
) -> Gathered:
    """``Client.gather``: arguments are checked before anything is sent."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    wait = requests.wait_of(timeout)
    if min_replies is not None and min_replies < 1:
        raise ConfigurationError(f"min_replies must be at least 1, got {min_replies}")
    tags = tuple(required_tags)
    table, capability = await requests.table_for(
        capability, wait, "a gather asks the instances it lists"
    )
    assert table is not None  # needed: it raised instead
    requests.check_capability(capability)
    prio = priority_of(priority)
    check_request_id(request_id)
    data = encode_payload(payload)
    offering = table.offering(capability)
    asked, skipped = fan_out(offering, capability, version, tags, prio)
    if not asked:
        raise CapabilityNotFound(
            explain_miss(offering, capability, version, tags, prio), capability=capability
        )
    nc = requests.inbox.nc
    if nc is None or nc.is_closed:
        raise NotStarted("client is not connected; use 'async with Client(...)' first")
    metrics = requests.metrics
    cells = metrics.cap(capability) if metrics is not None else None
    # each request goes to one named instance, as a direct call does
    call = Call(
        capability,
        data,
        request_id,
        response_type,
        None,
        version,
        tags,
        prio,
        Policy.DIRECT,
        table,
        cells,
    )
    deadline = began + wait
    headers = requests.headers(deadline - loop.time(), prio, request_id)
    if len(data) > nc.max_payload - HEADROOM and not fits(nc, data, headers):
        raise too_large(nc, len(data), f"{capability!r} (with its headers)")

    async def ask(agent_id: str) -> Reply:
        """One instance's request, counted as a request of its own (policy ``gather``);
        one not waited for has no outcome to count."""
        started = loop.time()
        outcome: str | None = None
        if cells is not None:
            cells.inflight += 1
        try:
            reply = await requests.attempt(call, agent_id, headers, deadline - started)
            outcome = "ok"
            return reply
        except RemoteError as exc:
            outcome = exc.outcome
            raise
        except Exception:
            outcome = "error"  # the connection, not the instance (as in a request)
            raise
        finally:
            if cells is not None:
                if outcome is None:
                    cells.inflight -= 1
                else:
                    cells.finished(GATHER, outcome, loop.time() - started)

    need = len(asked) if min_replies is None else min(min_replies, len(asked))
    if requests.tracer is None:
        tasks = await _wait(ask, asked, need)
    else:
        tasks = await _traced(requests.tracer, capability, ask, asked, need)
    return _result(capability, tasks, skipped)


Ask = Callable[[str], Coroutine[Any, Any, Reply]]


async def _wait(ask: Ask, asked: list[str], need: int) -> dict[str, asyncio.Task[Reply]]:
    """Send to every instance at once; return when ``need`` have answered or every request
    has ended (each ends by the deadline). The rest are cancelled and awaited first, so
    none outlives the gather, also when the gather itself is cancelled."""
    loop = asyncio.get_running_loop()
    tasks: dict[str, asyncio.Task[Reply]] = {a: loop.create_task(ask(a)) for a in asked}
    pending: set[asyncio.Task[Reply]] = set(tasks.values())
    answered = 0
    try:
        while pending and answered < need:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            answered += sum(1 for t in done if not t.cancelled() and t.exception() is None)
    finally:
        await reap(list(tasks.values()))
    return tasks


async def _traced(
    tracer: Tracer, capability: str, ask: Ask, asked: list[str], need: int
) -> dict[str, asyncio.Task[Reply]]:
    """``_wait`` in a span of its own: each request's span is its child."""
    with tracer.start_as_current_span(
        f"gather {capability}",
        kind=SpanKind.INTERNAL,  # its requests are the CLIENT spans, one per instance
        attributes={
            ATTR.SYSTEM: "nats",
            ATTR.OPERATION: "send",
            ATTR.CAPABILITY: capability,
            ATTR.POLICY: GATHER,
            ATTR.ASKED: len(asked),
        },
    ) as span:
        tasks = await _wait(ask, asked, need)
        answered = sum(1 for t in tasks.values() if not t.cancelled() and t.exception() is None)
        span.set_attribute(ATTR.ANSWERED, answered)
        span.set_attribute(ATTR.OUTCOME, "ok" if answered >= need else "incomplete")
        return tasks


def _result(
    capability: str, tasks: dict[str, asyncio.Task[Reply]], skipped: dict[str, str]
) -> Gathered:
    outcomes: dict[str, Reply | ReachError] = {}
    unanswered: list[str] = []
    for agent_id, task in tasks.items():
        if task.cancelled():
            unanswered.append(agent_id)
            continue
        exc = task.exception()
        if exc is None:
            outcomes[agent_id] = task.result()
        elif isinstance(exc, ReachError):
            outcomes[agent_id] = exc
        else:
            raise exc  # not an outcome of the instance: a fault of ours, not to be hidden
    return Gathered(capability, outcomes, tuple(unanswered), skipped)
