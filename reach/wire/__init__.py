"""The v1 wire protocol: headers, enums and the msgspec structs that cross NATS.

Every struct carries an explicit tag in the ``type`` field so that renaming a class never
changes the wire. Unknown fields are ignored on decode, and new fields always get
defaults, so agents and clients of different versions run side by side.
``sdk/PROTOCOL.md`` is the normative description; ``sdk/schemas/`` is generated from here.
"""

from .messages import (
    ERROR_CODES,
    PROBE_NO_RESPONDERS,
    PROTOCOL_VERSION,
    AgentEvent,
    AgentInfo,
    AgentRecord,
    Candidate,
    CapabilityInfo,
    Control,
    ControlReply,
    Deregistration,
    ErrorBody,
    ErrorCode,
    Header,
    Heartbeat,
    ListQuery,
    ListReply,
    Priority,
    RegisterReply,
    Registration,
    RouteQuery,
    RouteReply,
    Status,
    TopicInfo,
    Transition,
)
from .tasks import TaskAttempt, TaskRecord, TaskState, TaskStep, TaskSubmit

__all__ = [
    "ERROR_CODES",
    "PROBE_NO_RESPONDERS",
    "PROTOCOL_VERSION",
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
    "TaskAttempt",
    "TaskRecord",
    "TaskState",
    "TaskStep",
    "TaskSubmit",
    "TopicInfo",
    "Transition",
]
