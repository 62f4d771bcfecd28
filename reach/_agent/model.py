"""The agent's records: what it serves, the requests it holds, and its counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from .._handlers import Context, HandlerSpec
from .._telemetry import LATENCY_BUCKETS, Histogram
from ..errors import PROTOCOL_CODES
from ..wire import CapabilityInfo, Header, Priority

if TYPE_CHECKING:
    from .._client import Client

__all__ = ["AgentCells", "AgentStats", "Job", "Served", "TopicSpec"]

_PRIORITIES = tuple(Priority)


class AgentCells:
    """Answers of one capability: successes by priority, errors by (priority, code), and
    the handler time of successes."""

    __slots__ = ("errors", "latency", "ok")

    def __init__(self) -> None:
        self.ok: dict[Priority, int] = dict.fromkeys(_PRIORITIES, 0)
        self.errors: dict[tuple[Priority, str], int] = {}
        self.latency = Histogram(LATENCY_BUCKETS)

    def error(self, priority: Priority, code: str) -> None:
        """Protocol codes as they are; a handler's own code (it may hold anything, a tenant
        id say) is "refused", as callers see it, so the label stays bounded."""
        key = (priority, code if code in PROTOCOL_CODES else "refused")
        self.errors[key] = self.errors.get(key, 0) + 1


@dataclass(slots=True)
class Served:
    """One capability this agent serves, with its $SRV counters."""

    info: CapabilityInfo
    spec: HandlerSpec
    direct: str = ""
    handler: Callable[[Msg], None] | None = None  # its subscriptions deliver to it
    requests: int = 0
    errors: int = 0
    processing_ns: int = 0
    last_error: str = ""
    cells: AgentCells | None = None  # metrics; None when they are off

    def failed(self, reason: str) -> None:
        self.errors += 1
        self.last_error = reason


@dataclass(slots=True)
class Job:
    """One accepted request, from the queue to its reply."""

    msg: Msg
    cap: Served
    priority: Priority
    deadline_ms: int | None
    request_id: str
    #: the agent cancelled its handler: past its deadline (the deadline watch), or for its
    #: stream's caller (``cut`` says why); one flag, so a request's run reads one
    cancelled: bool = False
    abandoned: bool = False  # ...which ignored that; answered, and its worker replaced
    answered: bool = False  # a reply went out (a stop arriving during it adds none)
    #: a streaming request: the caller's first window (0: not a stream)
    window: int = 0
    #: chunks sent (-1: no stream started); the last frame says how many
    chunks: int = -1
    #: the stream's subject: every frame's reply-to, where its caller speaks
    via: str = ""
    #: why the stream's handler was cancelled: its caller's cancel, its silence, or
    #: its frames refused ("": not for its stream)
    cut: str = ""
    #: seconds of a stream's caller's silence that stop it (0: the agent's default)
    patience: float = 0.0

    def context(self, agent_id: str, client: Client) -> Context:
        """What the handler sees of this request (built only for handlers that ask)."""
        hdrs = self.msg.headers or {}
        try:
            attempt = int(hdrs.get(Header.ATTEMPT, "1"))
        except ValueError:
            attempt = 1
        return Context(
            agent_id=agent_id,
            client=client,
            capability=self.cap.info.name,
            request_id=self.request_id,
            priority=self.priority,
            deadline_ms=self.deadline_ms,
            caller=hdrs.get(Header.CALLER, ""),
            attempt=attempt,
            headers=dict(hdrs),
        )


@dataclass(slots=True)
class TopicSpec:
    pattern: str
    spec: HandlerSpec


@dataclass(slots=True)
class AgentStats:
    """Counters an agent keeps about itself (also reported in heartbeats and $SRV.STATS)."""

    served: int = 0
    failed: int = 0
    rejected: int = 0
    expired: int = 0
    invalid: int = 0
    inflight: int = 0
    latency_ewma_ms: float = 0.0
    #: bugs of ours caught around a worker or a subscription: logged, answered ``failed``
    internal_errors: int = 0
    #: handlers that ignored their deadline's cancellation; their workers were replaced
    abandoned: int = 0
    #: abandoned handlers still running now; past max_concurrency their workers are not
    #: replaced (the agent is DEGRADED) until they end
    stuck: int = 0
    #: topic handlers that raised (logged; the topic keeps being delivered)
    topic_errors: int = 0
    #: requests refused at intake, by reason (full, degraded, paused, stopping,
    #: bad_header, no_reply_subject)
    refusals: dict[str, int] = field(default_factory=dict)
    #: refusals never sent (past the sending queue's bound under a flood, or still queued
    #: when the agent stopped): their callers wait for their timeout
    unsent_refusals: int = 0
    #: streaming replies started; stopped by their caller's cancel; stopped because their
    #: caller went silent; stopped because NATS refused their frames to the caller (the
    #: user's ``allow_responses`` lets one through); times a handler waited at ``yield``
    #: for its caller's credit; credit messages heard (keepalives included)
    streams: int = 0
    streams_cancelled: int = 0
    streams_silent: int = 0
    streams_refused: int = 0
    stream_waits: int = 0
    stream_credits: int = 0
