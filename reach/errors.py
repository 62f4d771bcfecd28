"""Every error Agent-Reach raises, rooted at :class:`ReachError`.

    ReachError
    ├── ConfigurationError         bad settings or arguments found before anything is sent
    │   ├── PayloadTooLarge        payload_too_large: a payload NATS or a task record cannot hold
    │   └── NotReplayable          a dead letter that cannot run again (it stays in the DLQ)
    ├── ConnectionFailed           connection_failed: the NATS server cannot be reached
    ├── NotStarted                 an agent or client used before start / after close
    ├── TaskNotFound               no task has this id (never had, or its record expired)
    ├── CorruptRecord              corrupt_record: a stored task record that does not decode
    ├── DeadLetterNotFound         no dead letter at this DLQ sequence
    ├── NotStored                  not_stored: a durable publish the server did not confirm
    ├── RetryLater                 raised by a task handler: run this task again after a delay
    └── RemoteError                an answer (or lack of one) from the other side, by wire code
        ├── BadRequest             bad_request: the payload or headers were invalid
        ├── Unauthorized           unauthorized
        ├── CapabilityNotFound     capability_not_found: nobody offers it
        ├── AgentUnavailable       agent_unavailable: the chosen agent is not there
        ├── RequestTimeout         timeout (also a TimeoutError)
        ├── ResourceExhausted      resource_exhausted: the agent's queue is full
        ├── CircuitOpen            circuit_open
        ├── HandlerFailed          failed: the handler raised; not retried
        ├── InvalidReply           the answer did not decode as the type asked for
        ├── Cancelled              cancelled
        └── StreamBroken           stream_broken: a stream ended after its first chunk
                                   without its end (no failover then); ``chunks`` says
                                   how many arrived

Each error keeps its structured fields (``code``, ``retryable``, ``capability``,
``agent_id``, ``request_id``) so callers branch on data, not on message text.

Application codes. A handler may refuse with an error class of its own::

    class Busy(reach.RemoteError):
        code = "busy_now"   # snake_case: [a-z][a-z0-9_]*, at most 64 characters
        status = 503        # Nats-Service-Error-Code, 400..599; 500 when absent or invalid
        retryable = True    # sent in the error body; the client still fails over only on
                            # the protocol's own retryable codes

The code crosses the wire unchanged (error body ``code``, header ``Nats-Service-Error-Code``
= ``status``) and reaches the caller as a ``HandlerFailed`` whose ``code`` and ``outcome``
are ``"busy_now"``. A code that breaks the rule is sent as ``failed`` (and logged). For the
protocol's own codes above, the status and retryability are fixed by the protocol table.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._urls import redact
from .wire import ERROR_CODES
from .wire.tasks import MAX_WAIT

# The protocol's codes (section 3.2); any other code is the handler's own refusal.
#: the codes of the protocol; any other is an application's own
PROTOCOL_CODES = frozenset(str(code) for code in ERROR_CODES)

__all__ = [
    "AgentUnavailable",
    "Attempt",
    "BadRequest",
    "Cancelled",
    "CapabilityNotFound",
    "CircuitOpen",
    "ConfigurationError",
    "ConnectionFailed",
    "CorruptRecord",
    "DeadLetterNotFound",
    "HandlerFailed",
    "InvalidReply",
    "NotReplayable",
    "NotStarted",
    "NotStored",
    "PayloadTooLarge",
    "ReachError",
    "RemoteError",
    "RequestTimeout",
    "ResourceExhausted",
    "RetryLater",
    "StreamBroken",
    "TaskNotFound",
    "Unauthorized",
    "error_for_code",
]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a request: which instance, what happened, how long it took."""

    agent_id: str
    outcome: str
    duration_ms: float


class ReachError(Exception):
    """Root of every Agent-Reach error."""

    code: str = "failed"
    retryable: bool = False

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class ConfigurationError(ReachError, ValueError):
    """A setting or argument is invalid; nothing was sent."""

    code = "bad_request"


class ConnectionFailed(ReachError, ConnectionError):
    """The NATS server could not be reached (or its URL is unusable). A fact about our
    connection, not about an agent: its code is not ``agent_unavailable``."""

    code = "connection_failed"
    retryable = True

    def __init__(self, message: str, *, url: str = "") -> None:
        self.url = redact(url)  # here, once for every caller: a password never leaves
        super().__init__(message)


class PayloadTooLarge(ConfigurationError):
    """A payload too large to send: over the server's ``max_payload`` (a request or a
    publish), or over what a task record can hold (a submit). Nothing was sent. ``size``
    is the payload's length in bytes, ``limit`` the most that fits. A client-side code, as
    ``connection_failed`` is: no agent answers with it."""

    code = "payload_too_large"

    def __init__(self, message: str, *, size: int = 0, limit: int = 0) -> None:
        self.size = size
        self.limit = limit
        super().__init__(message)


class NotStarted(ReachError, RuntimeError):
    """An Agent or Client was used while not running."""


class TaskNotFound(ReachError, LookupError):
    """No record for this task id: it never existed, or its retention ran out. Never
    reported as PENDING."""

    code = "not_found"

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(f"no task {task_id!r} (unknown id, or its record expired)")


class CorruptRecord(ReachError):
    """A task's stored record does not decode: junk (a bug, a write by hand, a disk fault),
    or a state or field that a newer version of Reach wrote. The task is not lost: the next
    agent or registry that handles it replaces the record with a FAILED one (error code
    ``undecodable``) and stores its message as a dead letter with reason ``undecodable``,
    from which it can be replayed. ``detail`` says what did not decode; ``revision`` is
    the record's, for a compare-and-set that replaces exactly what was read."""

    code = "corrupt_record"

    def __init__(self, task_id: str, detail: str, *, revision: int = 0) -> None:
        self.task_id = task_id
        self.detail = detail
        self.revision = revision
        super().__init__(
            f"the record of task {task_id} does not decode ({detail}): junk, or written by"
            " a newer version of Reach; the next agent or registry to handle the task"
            " replaces it with a FAILED record and moves the task to the dead-letter stream"
            " (reason undecodable), from where 'reach dlq replay' runs it again"
        )


class DeadLetterNotFound(ReachError, LookupError):
    """No dead letter at this sequence: replayed already, expired (``dlq_retention``), or
    never there."""

    code = "not_found"

    def __init__(self, seq: int, stream: str) -> None:
        self.seq = seq
        self.stream = stream
        super().__init__(
            f"no dead letter {seq} in stream {stream} (replayed already, expired, or never)"
        )


class NotReplayable(ConfigurationError):
    """A dead letter that cannot become a task again (an undelivered callback, or a message
    that never decoded); it stays in the DLQ."""


class NotStored(ReachError):
    """A durable publish (``publish(..., durable=True)``) the server did not confirm,
    topic history that is not there, or a topics stream that cannot be made (also at an
    agent's start). ``reason`` says which, each with its own fix:

    - ``no_stream``: no stream stores the topic (``REACH_TOPICS`` missing, or made by hand
      without this topic's subject);
    - ``jetstream_unavailable``: JetStream did not answer (off, or between leaders for
      longer than ``task_patience``);
    - ``timeout``: no acknowledgement in time: the message **may** be stored; publishing it
      again may store it twice (durable subscribers are at-least-once anyway);
    - ``refused``: the stream refused it (a limit);
    - ``overlap``: the stream cannot be made, another stream of the account already
      captures its subjects (the message names it);
    - ``disconnected``: not connected to NATS.
    """

    code = "not_stored"
    retryable = True

    def __init__(self, message: str, *, topic: str = "", reason: str = "") -> None:
        self.topic = topic
        self.reason = reason
        if reason in ("refused", "overlap"):
            self.retryable = False
        super().__init__(message)


class RetryLater(ReachError):
    """Raised by a durable task's handler: end this attempt as RETRYING and run the task
    again after ``after`` seconds (a rate limit, a resource not ready yet). The task waits
    as a schedule the server holds, not as a message redelivered later, so waiting spends
    none of its deliveries. The attempt counts against ``max_attempts`` unless
    ``count=False``; with none left the task fails (code ``retry_later``). Only task
    handlers take it; a request handler that raises it answers ``failed``."""

    code = "retry_later"
    retryable = True

    def __init__(self, after: float, reason: str = "", *, count: bool = True) -> None:
        if not 0 <= after <= MAX_WAIT:
            raise ConfigurationError(
                f"RetryLater: after must be 0 to {MAX_WAIT} seconds (five years), not {after!r}"
            )
        self.after = float(after)
        self.reason = reason
        self.count = count
        super().__init__(f"retry in {self.after:g}s" + (f": {reason}" if reason else ""))


class RemoteError(ReachError):
    """An error reported by (or on behalf of) the other side of a request."""

    #: the numeric ``Nats-Service-Error-Code`` an application code is sent with (400..599)
    status: int = 500

    def __init__(
        self,
        message: str,
        *,
        capability: str = "",
        agent_id: str = "",
        request_id: str = "",
        retryable: bool | None = None,
        attempts: list[Attempt] | None = None,
        code: str | None = None,
    ) -> None:
        if code is not None and code != self.code:
            self.code = code  # an application code this class stands in for
        self.capability = capability
        self.agent_id = agent_id
        self.request_id = request_id
        self.attempts: list[Attempt] = list(attempts or [])
        #: what happened, finer than ``code``: e.g. "no_responders" for a NATS 503; an
        #: application code is always "refused", so it can never pose as a client outcome
        self.outcome: str = self.code if self.code in PROTOCOL_CODES else "refused"
        if retryable is not None:
            self.retryable = retryable
        super().__init__(message)


class BadRequest(RemoteError, ValueError):
    code = "bad_request"
    status = 400


class Unauthorized(RemoteError):
    """The other side refused us: an agent answered ``unauthorized``, the NATS server
    refused the credentials, or it refused this user a subject (nats-server.conf's
    permissions), which ``subject`` then names (lowercased, as the server reports it)."""

    code = "unauthorized"
    status = 401
    subject: str = ""


class CapabilityNotFound(RemoteError, LookupError):
    code = "capability_not_found"
    status = 404


class AgentUnavailable(RemoteError):
    code = "agent_unavailable"
    retryable = True
    status = 503


class RequestTimeout(RemoteError, TimeoutError):
    code = "timeout"
    retryable = True
    status = 408


class ResourceExhausted(RemoteError):
    code = "resource_exhausted"
    retryable = True
    status = 429


class CircuitOpen(RemoteError):
    code = "circuit_open"
    retryable = True
    status = 503


class HandlerFailed(RemoteError):
    code = "failed"


class InvalidReply(RemoteError):
    """The reply arrived but did not match ``response_type``."""

    code = "failed"


class Cancelled(RemoteError):
    code = "cancelled"
    status = 499


class StreamBroken(RemoteError):
    """A stream that had started (its first chunk arrived) ended without its end frame:
    no frame within the caller's idle timeout, a chunk lost on the way, the connection to
    NATS lost, or the agent stopping (``agent_unavailable``). A started stream is never
    failed over silently: the caller decides whether to ask again. ``chunks`` is how many
    chunks the caller received; ``reason`` is the code of what broke it (``timeout``,
    ``lost``, ``connection_lost``, ``agent_unavailable``, ``overrun``, ``silent``: the
    agent heard nothing from this caller for its patience). A client-side
    code, as ``connection_failed`` is: no agent sends it."""

    code = "stream_broken"
    retryable = True
    status = 502

    def __init__(
        self,
        message: str,
        *,
        chunks: int,
        reason: str,
        capability: str = "",
        agent_id: str = "",
        request_id: str = "",
    ) -> None:
        self.chunks = chunks
        self.reason = reason
        super().__init__(message, capability=capability, agent_id=agent_id, request_id=request_id)
        self.outcome = self.code


_BY_CODE: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        Unauthorized,
        CapabilityNotFound,
        AgentUnavailable,
        RequestTimeout,
        ResourceExhausted,
        CircuitOpen,
        HandlerFailed,
        Cancelled,
    )
}


def error_for_code(code: str) -> type[RemoteError]:
    """The exception class for a wire error code; unknown (application) codes map to
    HandlerFailed, raised with ``code=`` set to the application code."""
    return _BY_CODE.get(code, HandlerFailed)
