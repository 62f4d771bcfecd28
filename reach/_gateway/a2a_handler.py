"""The A2A request handler over a Reach client: the SDK's ``RequestHandler`` interface, which
the SDK's JSON-RPC dispatcher calls (it does the JSON-RPC, SSE, v0.3 compatibility and the
error bodies).

Why not the SDK's ``DefaultRequestHandler`` with an ``AgentExecutor`` and a ``TaskStore``:
that stack runs the agent inside the server process (an ``ActiveTask`` with its own queues
per task, writing every state to its store). Here the work runs in Reach agents and its state
is the Reach task record, written by them; the gateway only relays. So each method maps
straight onto the client: a message is a call or a submit, ``GetTask`` reads the record,
``CancelTask`` cancels it, and streams follow the record's KV watch. Nothing is kept in the
gateway, so any gateway process answers for any task.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing, nullcontext
from dataclasses import dataclass
from typing import Any, cast

from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event
from a2a.server.request_handlers import validate_request_params
from a2a.types import (
    Artifact,
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    Part,
    Role,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.constants import DEFAULT_LIST_TASKS_PAGE_SIZE
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.task import apply_history_length, validate_history_length, validate_page_size
from starlette.exceptions import HTTPException

from .._client import Client, Stream
from .._tasks import TaskRecord, TaskRef
from ..errors import ReachError, RequestTimeout
from ..wire import Priority
from ..wire.tasks import TaskState as S
from .a2a_cards import CALL, MODES, TASK, NotOffered, fleet
from .a2a_convert import (
    STATES,
    a2a_errors,
    chunk_status,
    events_of,
    payload_of,
    result_part,
    stream_meta,
    task_of,
)
from .auth import OPEN_CALLER, scoped_key
from .errors import EdgeError
from .inputs import check_timeout, is_task_id
from .streams import StreamSlots

__all__ = [
    "AGENT_NAME",
    "CALLER",
    "MAX_CALL_BYTES",
    "MAX_CALL_CHUNKS",
    "SCOPES",
    "Plan",
    "ReachRequestHandler",
]

#: key of the agent name (the URL's ``{name}``) in the SDK's ``ServerCallContext.state``
AGENT_NAME = "reach.agent_name"
#: key of the scopes the request's token grants (None: no authentication)
SCOPES = "reach.scopes"
#: key of who is asking (``auth.caller_id``): idempotency keys are theirs
CALLER = "reach.caller"
#: the most of a streaming skill's answer ``SendMessage`` gathers into one message (chunks,
#: bytes): past either, the stream is cancelled and the client is told to stream it
MAX_CALL_CHUNKS = 1000
MAX_CALL_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Plan:
    """What a message asks for, checked before anything is sent."""

    capability: str
    mode: str
    payload: Any
    timeout: float | None
    priority: Priority
    idempotency_key: str | None
    context_id: str
    #: a call whose answer comes in chunks (the skill streams)
    streams: bool = False


def _options(params: SendMessageRequest) -> dict[str, Any]:
    """The request's metadata, then the message's over it."""
    opts: dict[str, Any] = dict(params.metadata.items())
    opts.update(params.message.metadata.items())
    return opts


def _watch_key(rec: TaskRecord) -> tuple[Any, ...]:
    """What a client can see change; the watch repeats a record around its start."""
    return (rec.state, rec.attempt, rec.progress, rec.progress_note, rec.cancel_requested)


class ReachRequestHandler(NotOffered):
    """Serves the A2A methods of every agent name from one Reach client.

    ``task_wait``: how long a blocking ``SendMessage`` waits for a durable task to end
    before it answers with the task as it is (the caller goes on with ``GetTask`` or
    ``SubscribeToTask``); ``cancel_wait``: how long ``CancelTask`` waits for a running
    task's agent to stop it; ``max_timeout``: the longest call timeout a message may ask
    for, and the longest a streaming skill's whole answer may take in ``SendMessage``;
    ``streams``: the bound on streams following a task (None: none); ``max_call_chunks``
    and ``max_call_bytes``: the most of a streaming skill's answer ``SendMessage`` gathers
    before it gives up and tells the client to use ``SendStreamingMessage``.
    """

    def __init__(
        self,
        client: Client,
        *,
        task_wait: float = 30.0,
        cancel_wait: float = 10.0,
        max_timeout: float = 300.0,
        streams: StreamSlots | None = None,
        max_call_chunks: int = MAX_CALL_CHUNKS,
        max_call_bytes: int = MAX_CALL_BYTES,
    ) -> None:
        self.client = client
        self.max_call_chunks = max_call_chunks
        self.max_call_bytes = max_call_bytes
        self.streams = streams
        self.task_wait = task_wait
        self.cancel_wait = cancel_wait
        self.max_timeout = max_timeout

    # -- messages --------------------------------------------------------------------

    def room(self) -> None:
        """HTTP 503 (``Retry-After``) when every stream slot is taken: checked before a
        stream starts, since the SDK's dispatcher passes on what comes before the first
        event."""
        if self.streams is not None and self.streams.full():
            err = self.streams.refusal()
            raise HTTPException(503, err.message, headers=err.headers)

    @staticmethod
    def allow(context: ServerCallContext, scope: str) -> None:
        """HTTP 403 unless the token has ``scope`` (or ``admin``). The SDK's 1.0 dispatcher
        passes an ``HTTPException`` on; its v0.3 adapter makes it an ``InternalError``."""
        granted = context.state.get(SCOPES)
        if granted is not None and scope not in granted and "admin" not in granted:
            raise HTTPException(403, f"this token lacks the {scope!r} scope")

    async def plan(self, params: SendMessageRequest, context: ServerCallContext) -> Plan:
        """Which skill, how, and with what payload (see the README's A2A section)."""
        msg = params.message
        if msg.task_id:
            self.allow(context, "submit")
            await self._ref(msg.task_id)  # TaskNotFoundError for an unknown one
            raise UnsupportedOperationError(
                "a Reach task takes no further input; send a new message without a taskId"
            )
        name = str(context.state.get(AGENT_NAME, ""))
        with a2a_errors():
            named = fleet(await self.client.agents()).get(name)
        if named is None:
            raise InvalidParamsError(f"no agent named {name!r} in the routing table")
        opts = _options(params)
        cap = opts.get("capability", opts.get("skill"))
        if cap is None:
            if len(named.skills) != 1:
                raise InvalidParamsError(
                    f"agent {name!r} has {len(named.skills)} skills ({', '.join(named.skills)});"
                    " name one in the message metadata as 'capability'"
                )
            cap = next(iter(named.skills))
        skill = named.skills.get(str(cap))
        if skill is None:
            raise InvalidParamsError(
                f"agent {name!r} has no skill {cap!r}; it has: {', '.join(named.skills)}"
            )
        modes = [m for m in MODES if m in skill.modes]
        mode = opts.get("mode", modes[0])
        if not isinstance(mode, str) or mode not in skill.modes:
            raise InvalidParamsError(
                f"skill {skill.capability!r} runs as {' or '.join(modes)}, not {mode!r}"
            )
        timeout = self._timeout(opts.get("timeout"), mode)
        try:
            priority = Priority(opts.get("priority", "normal"))
        except ValueError:
            raise InvalidParamsError("metadata 'priority' must be high, normal or low") from None
        self.allow(context, "call" if mode == CALL else "submit")
        return Plan(
            capability=skill.capability,
            mode=mode,
            payload=payload_of(msg),
            timeout=timeout,
            priority=priority,
            # a message sent again (same id, same caller) is the same task
            idempotency_key=(
                scoped_key(
                    str(context.state.get(CALLER, OPEN_CALLER)),
                    f"a2a:{skill.capability}:{msg.message_id}",
                )
                if msg.message_id
                else None
            ),
            context_id=msg.context_id,
            streams=skill.streams and mode == CALL,
        )

    def _timeout(self, value: Any, mode: str) -> float | None:
        """The metadata's timeout, finite and bounded like the gateway's: a call's by
        ``max_timeout``, a task's (per attempt) by how long its record is kept."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidParamsError("metadata 'timeout' must be a number of seconds > 0")
        limit = self.max_timeout if mode == CALL else self.client.settings.task_retention
        try:
            return check_timeout(float(value), limit, "metadata 'timeout'")
        except EdgeError as exc:
            raise InvalidParamsError(exc.message) from None

    async def call(self, plan: Plan) -> Message:
        """A request/reply call: the answer is one agent message (a streaming skill's
        chunks are its parts, in order)."""
        if plan.streams:
            with a2a_errors():
                # the whole answer in one message: bounded in time, chunks and bytes
                stream = self.open(plan, total_timeout=self.max_timeout)
                async with stream:
                    parts = await self._gather(plan, stream)
                agent_id, request_id, latency = (
                    stream.agent_id,
                    stream.request_id,
                    stream.latency_ms,
                )
        else:
            with a2a_errors():
                reply = await self.client.call(
                    plan.capability,
                    plan.payload,
                    timeout=plan.timeout,
                    priority=plan.priority,
                    response_type=bytes,
                )
            parts = [result_part(reply.data)]
            agent_id, request_id, latency = reply.agent_id, reply.request_id, reply.latency_ms
        meta = {
            "reach": {
                "capability": plan.capability,
                "agent_id": agent_id,
                "request_id": request_id,
                "latency_ms": round(latency, 3),
            }
        }
        return Message(
            role=Role.ROLE_AGENT,
            message_id=str(uuid.uuid4()),
            context_id=plan.context_id,
            parts=parts,
            metadata=meta,
        )

    async def _gather(self, plan: Plan, stream: Stream) -> list[Part]:
        """A streaming skill's chunks as the parts of one message, up to
        ``max_call_chunks`` chunks and ``max_call_bytes`` bytes; past either, the stream
        is cancelled (the caller's ``async with`` leaves) and the client told to stream."""
        parts: list[Part] = []
        size = 0
        async for chunk in stream:
            size += len(chunk)
            if stream.chunks > self.max_call_chunks or size > self.max_call_bytes:
                raise UnsupportedOperationError(
                    f"skill {plan.capability!r} answered more than SendMessage gathers into"
                    f" one message ({self.max_call_chunks} chunks or {self.max_call_bytes}"
                    " bytes); call it with SendStreamingMessage (message/stream in A2A 0.3)"
                    " to get its answer as it comes"
                )
            parts.append(result_part(chunk))
        return parts

    def open(self, plan: Plan, *, total_timeout: float | None = None) -> Stream:
        return self.client.stream(
            plan.capability,
            plan.payload,
            timeout=plan.timeout,
            total_timeout=total_timeout,
            priority=plan.priority,
            response_type=bytes,
        )

    async def chunks(self, plan: Plan) -> AsyncGenerator[Event, None]:
        """A streaming skill's call as a task of the moment: the task (working), one
        artifact update per chunk as it comes (all appended to the artifact ``result``),
        then its end: completed, or failed with the error. Nothing is kept: the task id
        is not one ``GetTask`` knows. An error before the first chunk is the call's own
        A2A error."""
        slot = self.streams.slot() if self.streams is not None else nullcontext()
        stream = self.open(plan)
        with slot:
            with a2a_errors():
                await stream.__aenter__()  # the first frame: until then, a call
            try:
                task_id = str(uuid.uuid4())
                context_id = plan.context_id or task_id
                yield Task(
                    id=task_id,
                    context_id=context_id,
                    status=chunk_status(TaskState.TASK_STATE_WORKING),
                    metadata=stream_meta(plan.capability, stream),
                )
                try:
                    async for chunk in stream:
                        yield TaskArtifactUpdateEvent(
                            task_id=task_id,
                            context_id=context_id,
                            artifact=Artifact(
                                artifact_id="result", name="result", parts=[result_part(chunk)]
                            ),
                            append=stream.chunks > 1,
                        )
                except ReachError as exc:
                    state, note = TaskState.TASK_STATE_FAILED, f"{exc.code}: {exc.message}"
                else:
                    state, note = TaskState.TASK_STATE_COMPLETED, ""
                yield TaskStatusUpdateEvent(
                    task_id=task_id,
                    context_id=context_id,
                    status=chunk_status(state, note, task_id, context_id),
                    metadata=stream_meta(plan.capability, stream),
                )
            finally:
                await stream.aclose()  # a client gone: the agent stops the handler

    async def submit(self, plan: Plan) -> TaskRef:
        with a2a_errors():
            return await self.client.submit(
                plan.capability,
                plan.payload,
                priority=plan.priority,
                timeout=plan.timeout,
                idempotency_key=plan.idempotency_key,
            )

    @validate_request_params
    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Task | Message:
        validate_history_length(params.configuration)
        plan = await self.plan(params, context)
        if plan.mode == CALL:
            return await self.call(plan)
        ref = await self.submit(plan)
        with a2a_errors():
            if params.configuration.return_immediately:
                rec = await ref.status()
            else:
                try:
                    rec = await ref.wait(self.task_wait)
                except RequestTimeout:
                    rec = await ref.status()  # still running: the caller follows it
        return apply_history_length(task_of(rec), params.configuration)

    @validate_request_params
    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event, None]:
        validate_history_length(params.configuration)
        plan = await self.plan(params, context)
        if plan.streams:
            self.room()
            async for event in self.chunks(plan):
                yield event
            return
        if plan.mode == CALL:
            yield await self.call(plan)
            return
        self.room()
        ref = await self.submit(plan)
        with a2a_errors():
            first = await ref.status()
        async for event in self._follow(ref, first):
            yield event

    async def _follow(self, ref: TaskRef, first: TaskRecord) -> AsyncGenerator[Event, None]:
        """The task, then an event per change of its record, until it is final."""
        yield task_of(first)
        seen = _watch_key(first)
        if first.final:
            return
        slot = self.streams.slot() if self.streams is not None else nullcontext()
        with a2a_errors(), slot:
            # a generator: closed here, so its KV watch stops when the client goes away
            watch = cast(AsyncGenerator[TaskRecord, None], ref.watch())
            async with aclosing(watch) as changes:
                async for rec in changes:
                    if _watch_key(rec) == seen:
                        continue
                    seen = _watch_key(rec)
                    for event in events_of(rec):
                        yield event
                    if rec.final:
                        return

    # -- tasks -----------------------------------------------------------------------

    async def _ref(self, task_id: str) -> TaskRef:
        if not is_task_id(task_id):
            raise TaskNotFoundError(f"no task {task_id!r}")
        with a2a_errors():
            return await self.client.task(task_id)

    @validate_request_params
    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task:
        self.allow(context, "submit")
        validate_history_length(params)
        ref = await self._ref(params.id)
        with a2a_errors():
            rec = await ref.status()
        return apply_history_length(task_of(rec), params)

    @validate_request_params
    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task:
        self.allow(context, "submit")
        ref = await self._ref(params.id)
        with a2a_errors():
            rec = await ref.status()
            if not rec.final:
                rec = await ref.cancel()
            if not rec.final:  # running: its agent stops it
                try:
                    rec = await ref.wait(self.cancel_wait)
                except RequestTimeout:
                    rec = await ref.status()
        if rec.final and rec.state is not S.CANCELLED:
            raise TaskNotCancelableError(f"task {params.id} already ended {rec.state.lower()}")
        return task_of(rec)

    @validate_request_params
    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event, None]:
        self.allow(context, "submit")
        self.room()
        ref = await self._ref(params.id)
        with a2a_errors():
            rec = await ref.status()
        if rec.final:
            raise UnsupportedOperationError(
                f"task {params.id} already ended {rec.state.lower()}; read it with GetTask"
            )
        async for event in self._follow(ref, rec):
            yield event

    @validate_request_params
    async def on_list_tasks(
        self, params: ListTasksRequest, context: ServerCallContext
    ) -> ListTasksResponse:
        """The newest tasks of this agent name's durable skills (one page: no page token)."""
        self.allow(context, "submit")
        validate_history_length(params)
        if params.HasField("page_size"):
            validate_page_size(params.page_size)
        limit = params.page_size or DEFAULT_LIST_TASKS_PAGE_SIZE
        states = [s for s, a in STATES.items() if a == params.status] if params.status else [None]
        with a2a_errors():
            named = fleet(await self.client.agents()).get(str(context.state.get(AGENT_NAME)))
            caps = [c for c, s in named.skills.items() if TASK in s.modes] if named else []
            records = [
                rec
                for cap in caps
                for state in states
                for rec in await self.client.list_tasks(state, cap, limit)
            ]
        after = params.status_timestamp_after.ToMilliseconds()
        records = [
            r
            for r in records
            if r.updated_ms >= after and (not params.context_id or params.context_id == r.task_id)
        ]
        records.sort(key=lambda r: r.updated_ms, reverse=True)
        tasks = [apply_history_length(task_of(r), params) for r in records[:limit]]
        return ListTasksResponse(tasks=tasks, page_size=limit, total_size=len(tasks))
