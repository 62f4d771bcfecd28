"""Pure conversions between Reach and A2A: message parts to payloads, task records to A2A
tasks and events, Reach errors to A2A errors. No I/O, so the mapping is tested alone.

The state mapping is ``sdk/PROTOCOL.md`` section 8.7. A durable task's A2A ``contextId`` is
its task id: a Reach record keeps no A2A context, and any gateway process must answer the
same for the same task.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from a2a.helpers import get_data_parts, get_text_parts, new_data_part
from a2a.types import (
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import (
    A2AError,
    ContentTypeNotSupportedError,
    InternalError,
    InvalidParamsError,
    TaskNotFoundError,
)

from .._client import Stream
from .._codec import now_ms
from ..errors import BadRequest, ConfigurationError, ReachError, RemoteError, TaskNotFound
from ..wire.tasks import TaskRecord
from ..wire.tasks import TaskState as S

__all__ = [
    "STATES",
    "a2a_errors",
    "events_of",
    "payload_of",
    "result_part",
    "status_of",
    "task_of",
    "value_part",
]

#: Reach task state -> A2A task state (PROTOCOL.md 8.7)
STATES: dict[S, TaskState] = {
    S.SCHEDULED: TaskState.TASK_STATE_SUBMITTED,
    S.PENDING: TaskState.TASK_STATE_SUBMITTED,
    S.RUNNING: TaskState.TASK_STATE_WORKING,
    S.RETRYING: TaskState.TASK_STATE_WORKING,
    S.TIMEOUT: TaskState.TASK_STATE_WORKING,
    S.SUCCEEDED: TaskState.TASK_STATE_COMPLETED,
    S.FAILED: TaskState.TASK_STATE_FAILED,
    S.CANCELLED: TaskState.TASK_STATE_CANCELED,
}

_json = msgspec.json.Decoder()
_SAFE_INT = 2**53


def _whole(value: Any) -> Any:
    """Integral floats back to ints: an A2A data part is a protobuf ``Value``, which keeps
    every number as a double, and a handler that declares ``int`` refuses ``3.0``."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value) if abs(value) < _SAFE_INT else value
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def payload_of(message: Message) -> Any:
    """The payload a message carries: its data part's value, else ``{"text": ...}`` from
    its text parts (joined by newlines), else None. Several data parts, or file parts
    alone, are refused: a Reach payload is one JSON value."""
    data = get_data_parts(message.parts)
    if len(data) > 1:
        raise InvalidParamsError(
            f"the message has {len(data)} data parts; send one (it is the payload)"
        )
    if data:
        return _whole(data[0])
    texts = get_text_parts(message.parts)
    if texts:
        return {"text": "\n".join(texts)}
    if message.parts:
        raise ContentTypeNotSupportedError(
            "file and url parts cannot be a Reach payload; send a data or a text part"
        )
    return None


def value_part(value: Any) -> Part:
    """A result as a part: text for a string, data for any other JSON value."""
    if isinstance(value, str):
        return Part(text=value)
    return new_data_part(value)


def result_part(data: bytes) -> Part:
    """A Reach body (a result or a payload) as a part; bytes that are not JSON go raw."""
    try:
        value = _json.decode(data) if data else None
    except msgspec.DecodeError:
        return Part(raw=data, media_type="application/octet-stream")
    return value_part(value)


def _meta(rec: TaskRecord) -> dict[str, Any]:
    """Reach's own view, under ``reach`` in the task's metadata (RETRYING is ``working``
    to A2A; here it stays RETRYING)."""
    return {
        "reach": {
            "state": str(rec.state),
            "capability": rec.capability,
            "priority": str(rec.priority),
            "attempt": rec.attempt,
            "agent_id": rec.agent_id,
            "progress": rec.progress,
            "cancel_requested": rec.cancel_requested,
        }
    }


def _note(rec: TaskRecord) -> str:
    """What the status message says: the error of a failed or cancelled task, the progress
    note of a running one."""
    if rec.state in (S.FAILED, S.CANCELLED) and rec.error is not None:
        return f"{rec.error.code}: {rec.error.message}"
    if rec.state in (S.RETRYING, S.TIMEOUT) and rec.attempts:
        last = rec.attempts[-1]
        return f"attempt {last.n} ended {last.outcome}; retrying"
    return rec.progress_note


def status_of(rec: TaskRecord) -> TaskStatus:
    status = TaskStatus(state=STATES[rec.state])
    status.timestamp.FromMilliseconds(rec.updated_ms or rec.submitted_ms)
    note = _note(rec)
    if note:
        status.message.CopyFrom(
            Message(
                role=Role.ROLE_AGENT,
                message_id=f"{rec.task_id}.{rec.state.lower()}.{rec.attempt}",
                task_id=rec.task_id,
                context_id=rec.task_id,
                parts=[Part(text=note)],
            )
        )
    return status


def chunk_status(
    state: TaskState, note: str = "", task_id: str = "", context_id: str = ""
) -> TaskStatus:
    """The status of a streamed call (``ReachRequestHandler.chunks``), now; ``note`` the
    error of a failed one."""
    status = TaskStatus(state=state)
    status.timestamp.FromMilliseconds(now_ms())
    if note:
        status.message.CopyFrom(
            Message(
                role=Role.ROLE_AGENT,
                message_id=f"{task_id}.{TaskState.Name(state).lower()}",
                task_id=task_id,
                context_id=context_id,
                parts=[Part(text=note)],
            )
        )
    return status


def stream_meta(capability: str, stream: Stream) -> dict[str, Any]:
    """Reach's view of a streamed call, under ``reach``: who streams, how far it is."""
    return {
        "reach": {
            "capability": capability,
            "agent_id": stream.agent_id,
            "request_id": stream.request_id,
            "chunks": stream.chunks,
            "latency_ms": round(stream.latency_ms, 3),
        }
    }


def _artifact(rec: TaskRecord) -> Artifact:
    return Artifact(artifact_id="result", name="result", parts=[result_part(rec.result or b"")])


def task_of(rec: TaskRecord) -> Task:
    """A Reach task record as an A2A task: the payload as the user's message in the
    history, the result as the artifact ``result``, Reach's own state in metadata."""
    request = Message(
        role=Role.ROLE_USER,
        message_id=f"{rec.task_id}.request",
        task_id=rec.task_id,
        context_id=rec.task_id,
        parts=[result_part(rec.payload)],
    )
    task = Task(
        id=rec.task_id,
        context_id=rec.task_id,
        status=status_of(rec),
        history=[request],
        metadata=_meta(rec),
    )
    if rec.state is S.SUCCEEDED:
        task.artifacts.append(_artifact(rec))
    return task


def events_of(rec: TaskRecord) -> list[TaskStatusUpdateEvent | TaskArtifactUpdateEvent]:
    """The stream events for one record change: the result artifact (when it succeeded),
    then the status."""
    out: list[TaskStatusUpdateEvent | TaskArtifactUpdateEvent] = []
    if rec.state is S.SUCCEEDED:
        out.append(
            TaskArtifactUpdateEvent(
                task_id=rec.task_id,
                context_id=rec.task_id,
                artifact=_artifact(rec),
                last_chunk=True,
            )
        )
    out.append(
        TaskStatusUpdateEvent(
            task_id=rec.task_id, context_id=rec.task_id, status=status_of(rec), metadata=_meta(rec)
        )
    )
    return out


def _data(exc: ReachError) -> dict[str, str]:
    """Error details as strings: the SDK sends them as a ``google.rpc.ErrorInfo`` map."""
    out = {"code": str(exc.code), "retryable": str(exc.retryable is True).lower()}
    if isinstance(exc, RemoteError):
        if exc.agent_id:
            out["agent_id"] = exc.agent_id
        if exc.capability:
            out["capability"] = exc.capability
    return out


def _a2a_error(exc: ReachError) -> A2AError:
    if isinstance(exc, TaskNotFound):
        return TaskNotFoundError(str(exc))
    if isinstance(exc, BadRequest | ConfigurationError):
        return InvalidParamsError(str(exc), data=_data(exc))
    return InternalError(str(exc), data=_data(exc))


@contextmanager
def a2a_errors() -> Iterator[None]:
    """Raise a Reach error as the A2A error the SDK turns into a JSON-RPC error: bad input
    as ``InvalidParamsError``, an unknown task as ``TaskNotFoundError``, anything else as
    ``InternalError``; ``data`` holds the Reach code and whether a retry may help."""
    try:
        yield
    except ReachError as exc:
        raise _a2a_error(exc) from exc
