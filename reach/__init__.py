"""Agent-Reach: get every task to the agent that can take it now, over NATS."""

from ._agent import Agent as Agent
from ._agent import AgentStats as AgentStats
from ._agent import Context as Context
from ._client import Client as Client
from ._client import ClientStats as ClientStats
from ._client import Gathered as Gathered
from ._client import Reply as Reply
from ._client import Stream as Stream
from ._client import TopicMessage as TopicMessage
from ._client import TopicSubscription as TopicSubscription
from ._handlers import TaskContext as TaskContext
from ._registry import Registry as Registry
from ._registry import RegistryStats as RegistryStats
from ._tasks import Batch as Batch
from ._tasks import BatchProgress as BatchProgress
from ._tasks import DeadLetter as DeadLetter
from ._tasks import ScheduleInfo as ScheduleInfo
from ._tasks import TaskAttempt as TaskAttempt
from ._tasks import TaskRecord as TaskRecord
from ._tasks import TaskRef as TaskRef
from ._tasks import TaskState as TaskState
from ._tasks import TaskStats as TaskStats
from .errors import (
    AgentUnavailable,
    BadRequest,
    Cancelled,
    CapabilityNotFound,
    CircuitOpen,
    ConfigurationError,
    ConnectionFailed,
    CorruptRecord,
    DeadLetterNotFound,
    HandlerFailed,
    InvalidReply,
    NotReplayable,
    NotStarted,
    NotStored,
    PayloadTooLarge,
    ReachError,
    RemoteError,
    RequestTimeout,
    ResourceExhausted,
    RetryLater,
    StreamBroken,
    TaskNotFound,
    Unauthorized,
)
from .settings import ReachSettings as ReachSettings
from .telemetry import Telemetry as Telemetry
from .wire import AgentEvent as AgentEvent
from .wire import AgentRecord as AgentRecord
from .wire import Priority as Priority
from .wire import Status as Status

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "AgentEvent",
    "AgentRecord",
    "AgentStats",
    "AgentUnavailable",
    "BadRequest",
    "Batch",
    "BatchProgress",
    "Cancelled",
    "CapabilityNotFound",
    "CircuitOpen",
    "Client",
    "ClientStats",
    "ConfigurationError",
    "ConnectionFailed",
    "Context",
    "CorruptRecord",
    "DeadLetter",
    "DeadLetterNotFound",
    "Gathered",
    "HandlerFailed",
    "InvalidReply",
    "NotReplayable",
    "NotStarted",
    "NotStored",
    "PayloadTooLarge",
    "Priority",
    "ReachError",
    "ReachSettings",
    "Registry",
    "RegistryStats",
    "RemoteError",
    "Reply",
    "RequestTimeout",
    "ResourceExhausted",
    "RetryLater",
    "ScheduleInfo",
    "Status",
    "Stream",
    "StreamBroken",
    "TaskAttempt",
    "TaskContext",
    "TaskNotFound",
    "TaskRecord",
    "TaskRef",
    "TaskState",
    "TaskStats",
    "Telemetry",
    "TopicMessage",
    "TopicSubscription",
    "Unauthorized",
    "__version__",
]
