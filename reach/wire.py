"""The v1 wire protocol: headers, enums and the msgspec structs that cross NATS.

Every struct carries an explicit tag in the ``type`` field so that renaming a class never
changes the wire. Unknown fields are ignored on decode, and new fields always get
defaults, so agents and clients of different versions run side by side.
``sdk/PROTOCOL.md`` is the normative description; ``sdk/schemas/`` is generated from here.
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec

__all__ = [
    "ERROR_CODES",
    "PROTOCOL_VERSION",
    "AgentInfo",
    "CapabilityInfo",
    "ErrorBody",
    "ErrorCode",
    "Header",
    "Heartbeat",
    "Priority",
    "Status",
]

PROTOCOL_VERSION: Final = "1"


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
    """Body of an error reply; headers ``Nats-Service-Error-Code``/``-Error`` mirror it."""

    code: ErrorCode
    message: str
    retryable: bool = False


class CapabilityInfo(_Wire, tag="reach.capability", frozen=True, kw_only=True):
    """One capability an agent serves."""

    name: str
    version: str = "1.0"
    description: str = ""


class AgentInfo(_Wire, tag="reach.agent.info", frozen=True, kw_only=True):
    """What an agent instance is and offers; sent at registration and in ``$ping``."""

    agent_id: str
    name: str
    version: str = "1.0.0"
    capabilities: list[CapabilityInfo] = msgspec.field(default_factory=list)
    tags: list[str] = msgspec.field(default_factory=list)
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
