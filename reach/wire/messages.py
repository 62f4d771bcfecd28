"""The v1 wire's core messages: headers, enums and the structs of requests, registration,
heartbeats, control and routing (``reach.wire`` re-exports them)."""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final

import msgspec

__all__ = [
    "ERROR_CODES",
    "PROBE_NO_RESPONDERS",
    "PROTOCOL_VERSION",
    "RECORD_ROOM",
    "AgentEvent",
    "AgentInfo",
    "AgentRecord",
    "Candidate",
    "CapabilityInfo",
    "Control",
    "ControlReply",
    "Deregistration",
    "ErrorBody",
    "ErrorCode",
    "Header",
    "Heartbeat",
    "ListQuery",
    "ListReply",
    "Priority",
    "RegisterReply",
    "Registration",
    "RouteQuery",
    "RouteReply",
    "Status",
    "StreamCancel",
    "StreamControl",
    "StreamCredit",
    "TopicInfo",
    "Transition",
]

PROTOCOL_VERSION: Final = "1"
#: the reason of a DOWN transition when nobody listens on the agent's subjects (its
#: connection is gone): callers may fail its pending requests over at once
PROBE_NO_RESPONDERS: Final = "probe failed: no responders"
#: bytes a registration leaves within the server's max_payload for the rest of the
#: registry's record of the agent: a heartbeat, the last 8 transitions and the KV headers
#: (each transition and the heartbeat may carry the agent's reason, up to 200 characters).
#: Registries refuse a larger registration (``bad_request``); agents leave schemas out
#: so as not to send one.
RECORD_ROOM: Final = 16 * 1024


class Header:
    """Header names used by the protocol (NATS headers are case-sensitive as sent)."""

    REQUEST_ID: Final = "Reach-Request-Id"
    CALLER: Final = "Reach-Caller"
    PRIORITY: Final = "Reach-Priority"
    DEADLINE: Final = "Reach-Deadline"
    IDEMPOTENCY_KEY: Final = "Reach-Idempotency-Key"
    ATTEMPT: Final = "Reach-Attempt"
    TRACEPARENT: Final = "traceparent"
    TRACESTATE: Final = "tracestate"
    AGENT: Final = "Reach-Agent"
    DURATION_MS: Final = "Reach-Duration-Ms"
    SERVICE_ERROR_CODE: Final = "Nats-Service-Error-Code"
    SERVICE_ERROR: Final = "Nats-Service-Error"
    #: streaming replies (PROTOCOL.md 3.3): the caller's first window, on the request
    STREAM_WINDOW: Final = "Reach-Stream-Window"
    #: ...and, optionally, how long (ms) the agent waits for a word from a silent caller
    STREAM_PATIENCE: Final = "Reach-Stream-Patience"
    #: on a chunk frame: its number, 1 for the first
    CHUNK: Final = "Reach-Chunk"
    #: on the last frame (end, or error): how many chunks the stream sent
    END: Final = "Reach-End"


class Status(enum.StrEnum):
    UP = "UP"
    DEGRADED = "DEGRADED"
    PAUSED = "PAUSED"
    UNKNOWN = "UNKNOWN"
    DOWN = "DOWN"


class Priority(enum.StrEnum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


class ErrorCode(enum.StrEnum):
    BAD_REQUEST = "bad_request"
    CAPABILITY_NOT_FOUND = "capability_not_found"
    AGENT_UNAVAILABLE = "agent_unavailable"
    TIMEOUT = "timeout"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    CIRCUIT_OPEN = "circuit_open"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNAUTHORIZED = "unauthorized"


#: Wire code -> (numeric ``Nats-Service-Error-Code``, retryable by default).
ERROR_CODES: Final[dict[ErrorCode, tuple[int, bool]]] = {
    ErrorCode.BAD_REQUEST: (400, False),
    ErrorCode.UNAUTHORIZED: (401, False),
    ErrorCode.CAPABILITY_NOT_FOUND: (404, False),
    ErrorCode.TIMEOUT: (408, True),
    ErrorCode.RESOURCE_EXHAUSTED: (429, True),
    ErrorCode.CANCELLED: (499, False),
    ErrorCode.FAILED: (500, False),
    ErrorCode.AGENT_UNAVAILABLE: (503, True),
    ErrorCode.CIRCUIT_OPEN: (503, True),
}


class _Wire(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every wire struct: immutable, keyword-only, tagged in ``type``."""


class ErrorBody(_Wire, tag="reach.error", frozen=True, kw_only=True):
    """Body of an error reply; headers ``Nats-Service-Error-Code``/``-Error`` mirror it.

    ``code`` is one of the protocol's codes (``ErrorCode``: bad_request, unauthorized,
    capability_not_found, timeout, resource_exhausted, cancelled, failed,
    agent_unavailable, circuit_open) or an application's own snake_case code
    (``[a-z][a-z0-9_]*``, at most 64 characters), which crosses the wire unchanged.
    """

    code: Annotated[
        str,
        msgspec.Meta(
            description=(
                "A protocol code (see ErrorCode) or an application's snake_case code,"
                " [a-z][a-z0-9_]*, at most 64 characters. Decoders accept any string."
            ),
            examples=[c.value for c in ErrorCode] + ["busy_now"],
        ),
    ]
    message: str
    retryable: bool = False


#: a JSON Schema (an object); on the wire only in registrations and records, never in heartbeats
JsonSchema = Annotated[
    dict[str, Any],
    msgspec.Meta(
        description=(
            "A JSON Schema (2020-12) derived from the handler's annotations; {} accepts any"
            " value. Absent or null: the agent does not describe it (older agents)."
        )
    ),
]


class CapabilityInfo(_Wire, tag="reach.capability", frozen=True, kw_only=True):
    """One capability an agent serves: its name, version, description and the JSON Schemas
    of its payload and result (the contract, sent once per registration)."""

    name: str
    #: semver; routing compares the major only, so "1.0" from older agents is the same 1.x
    version: str = "1.0.0"
    description: str = ""
    streams: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "The answer comes as a stream of chunks (PROTOCOL.md 3.3): call it with"
                " Reach-Stream-Window"
            )
        ),
    ] = False
    payload_schema: JsonSchema | None = None
    result_schema: JsonSchema | None = None


class TopicInfo(_Wire, tag="reach.topic", frozen=True, kw_only=True):
    """One topic pattern an agent subscribes to (``on_topic``), with its payload's schema."""

    pattern: str
    description: str = ""
    #: stored in stream ``<PREFIX>_TOPICS`` and delivered at least once per agent name
    durable: bool = False
    #: durable, one message at a time for the agent name
    ordered: bool = False
    payload_schema: JsonSchema | None = None


class AgentInfo(_Wire, tag="reach.agent.info", frozen=True, kw_only=True):
    """What an agent instance is and offers; sent at registration and in ``$ping``."""

    agent_id: str
    name: str
    version: str = "1.0.0"
    capabilities: list[CapabilityInfo] = msgspec.field(default_factory=list)
    #: durable capabilities (``@agent.task``), served from the task stream, not by request
    tasks: list[CapabilityInfo] = msgspec.field(default_factory=list)
    tags: list[str] = msgspec.field(default_factory=list)
    #: the topic patterns it subscribes to (section 6), for the fleet's contract
    topics: list[TopicInfo] = msgspec.field(default_factory=list)
    max_concurrency: int = 8
    max_queue: int = 64
    started_ms: int = 0
    protocol: str = PROTOCOL_VERSION
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class Heartbeat(_Wire, tag="reach.agent.heartbeat", frozen=True, kw_only=True):
    """Liveness and load of one instance, published on ``reach.hb.<agent_id>``."""

    agent_id: str
    status: Status = Status.UP
    seq: int = 0
    inflight: int = 0
    queue_len: int = 0
    load: float = 0.0
    latency_ms: float = 0.0
    served: int = 0
    failed: int = 0
    dropped: int = 0
    sent_ms: int = 0
    reason: Annotated[
        str,
        msgspec.Meta(
            description=(
                "Why the agent reports this status, for people; empty when UP."
                " Free text: display it, do not parse it."
            ),
            examples=["handler timeouts: 3 within 10s; UP again after 15s without one"],
        ),
    ] = ""


class Transition(_Wire, tag="reach.transition", frozen=True, kw_only=True):
    """One status change as the registry saw it: ``reason`` is the registry's (a short
    fixed phrase: "reported", "probe lost"...), ``detail`` the agent's own (its heartbeat's
    ``reason``) when the agent reported the change."""

    old: Status | None
    new: Status
    reason: str
    at_ms: int
    detail: Annotated[
        str, msgspec.Meta(description="The agent's reason (its heartbeat's), when it reported")
    ] = ""


class AgentRecord(_Wire, tag="reach.agent.record", frozen=True, kw_only=True):
    """The registry's record of one instance: the value of its key in ``reach_agents``."""

    info: AgentInfo
    status: Status
    heartbeat: Heartbeat | None = None
    registered_ms: int = 0
    last_seen_ms: int = 0
    transitions: list[Transition] = msgspec.field(default_factory=list)
    registry: str = ""


class AgentEvent(_Wire, tag="reach.agent.event", frozen=True, kw_only=True):
    """A status transition, published on ``reach.evt.agent.<agent_id>``."""

    agent_id: str
    old: Status | None
    new: Status
    reason: str
    at_ms: int
    removed: bool = False
    detail: Annotated[
        str, msgspec.Meta(description="The agent's reason (its heartbeat's), when it reported")
    ] = ""


class Registration(_Wire, tag="reach.registry.register", frozen=True, kw_only=True):
    """Body of ``reach.registry.register.<agent_id>``; ``info.agent_id`` must be that id.
    (The ``type`` tag keeps its old name: it names the body, not the subject.)"""

    info: AgentInfo
    status: Status = Status.UP


class RegisterReply(_Wire, tag="reach.registry.registered", frozen=True, kw_only=True):
    """The lease the registry grants: heartbeat at least every ``heartbeat_interval``."""

    lease_ttl: float
    heartbeat_interval: float
    registry: str = ""


class Deregistration(_Wire, tag="reach.registry.deregister", frozen=True, kw_only=True):
    """Body of ``reach.registry.deregister.<agent_id>``; ``agent_id`` must be that id."""

    agent_id: str


class Control(_Wire, tag="reach.agent.control", frozen=True, kw_only=True):
    """Body of ``reach.agent.<id>.$ctl``: pause, resume, drain, or register (again)."""

    command: str


class ControlReply(_Wire, tag="reach.agent.control.reply", frozen=True, kw_only=True):
    agent_id: str
    status: Status
    ok: bool = True


class ListQuery(_Wire, tag="reach.registry.list", frozen=True, kw_only=True):
    """Body of ``reach.registry.list``; every filter is optional. ``limit`` and ``after``
    (an agent id) ask for one page, in agent id order."""

    capability: str | None = None
    tag: str | None = None
    status: Status | None = None
    limit: int | None = None
    after: str | None = None


class ListReply(_Wire, tag="reach.registry.list.reply", frozen=True, kw_only=True):
    """``next_after``: more agents follow; ask again with it as ``after``."""

    agents: list[AgentRecord] = msgspec.field(default_factory=list)
    next_after: str | None = None


class RouteQuery(_Wire, tag="reach.registry.route", frozen=True, kw_only=True):
    """Body of ``reach.registry.route``: who should take this capability now?"""

    capability: str
    version: str | None = None
    tags: list[str] = msgspec.field(default_factory=list)
    priority: Priority = Priority.NORMAL


class Candidate(_Wire, tag="reach.registry.candidate", frozen=True, kw_only=True):
    agent_id: str
    subject: str
    status: Status
    score: float
    reason: str


class RouteReply(_Wire, tag="reach.registry.route.reply", frozen=True, kw_only=True):
    candidates: list[Candidate] = msgspec.field(default_factory=list)
    reason: str = ""


class StreamCredit(_Wire, tag="reach.stream.credit", frozen=True, kw_only=True):
    """From a streaming caller to the agent's stream subject: ``credit`` more chunks may
    come. 0 is a keepalive: the caller is still there (PROTOCOL.md 3.3)."""

    credit: int = 0


class StreamCancel(_Wire, tag="reach.stream.cancel", frozen=True, kw_only=True):
    """From a streaming caller to the agent's stream subject: stop now; nothing more is
    read."""


#: what a caller sends to an agent's stream subject
StreamControl = StreamCredit | StreamCancel
