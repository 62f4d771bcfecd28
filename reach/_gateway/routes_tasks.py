"""Durable tasks over HTTP: submit (``Idempotency-Key`` honoured), read, cancel, and follow
a task's state changes as Server-Sent Events until it ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import Field

from .._cli_common import json_or_text
from ..wire import Priority
from ..wire.tasks import MAX_WAIT, TaskRecord
from .auth import CALLER_DIGITS, scoped_key
from .deps import EdgeDeps
from .events import task_events
from .inputs import Selection, check_task_id, check_timeout
from .settings import Scope

__all__ = ["SubmitBody", "record_json", "router"]

#: what a submit takes, less the caller's prefix (``scoped_key``)
_MAX_KEY = 256 - CALLER_DIGITS - 1

_encode = msgspec.json.Encoder()


class SubmitBody(Selection):
    """``POST /v1/tasks``."""

    capability: str = Field(description="the capability declared with @agent.task")
    payload: Any = Field(default=None, description="any JSON value")
    priority: Priority = Priority.NORMAL
    timeout: float | None = Field(default=None, gt=0, description="seconds per attempt")
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    delay: float | None = Field(
        default=None,
        ge=0,
        le=MAX_WAIT,
        description="seconds to hold the task back: SCHEDULED until then, due_ms in its record",
    )


def record_json(rec: TaskRecord) -> dict[str, Any]:
    """A task record as JSON, its payload and result decoded when they are JSON."""
    out: dict[str, Any] = msgspec.to_builtins(rec)
    out["payload"] = json_or_text(rec.payload)
    out["result"] = json_or_text(rec.result)
    out["final"] = rec.final
    return out


def links(task_id: str) -> dict[str, str]:
    base = f"/v1/tasks/{task_id}"
    return {"self": base, "events": f"{base}/events", "cancel": f"{base}/cancel"}


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode.encode(value), status, headers, media_type="application/json")


def router(deps: EdgeDeps) -> APIRouter:
    api = APIRouter(prefix="/v1/tasks", tags=["tasks"])
    client = deps.client
    guard = [deps.guard(Scope.SUBMIT)]
    retention = client.settings.task_retention

    @api.post(
        "",
        status_code=202,
        dependencies=guard,
        summary="Submit a durable task",
        response_description="The task id and where to follow it",
    )
    async def submit_task(
        body: SubmitBody,
        request: Request,
        idempotency_key: Annotated[str | None, Header(max_length=_MAX_KEY)] = None,
    ) -> Response:
        """The ``Idempotency-Key`` is the caller's: stored as ``<caller>:<key>``, the
        caller a digest of the token (``open`` without tokens)."""
        if body.timeout is not None:
            check_timeout(body.timeout, retention, "timeout (per attempt)")
        key = idempotency_key
        if key is not None:
            key = scoped_key(deps.auth.caller(request.headers.get("authorization")), key)
        ref = await client.submit(
            body.capability,
            body.payload,
            priority=body.priority,
            timeout=body.timeout,
            max_attempts=body.max_attempts,
            idempotency_key=key,
            required_tags=body.tags,
            version=body.version,
            delay=body.delay,
        )
        out = {"task_id": ref.task_id, "capability": body.capability, "links": links(ref.task_id)}
        return _json(out, 202, {"Location": f"/v1/tasks/{ref.task_id}"})

    @api.get("/{task_id}", dependencies=guard, summary="A task's record now")
    async def get_task(task_id: str) -> Response:
        rec = await client.task_record(check_task_id(task_id))
        return _json(record_json(rec))

    @api.post("/{task_id}/cancel", dependencies=guard, summary="Cancel a task")
    async def cancel_task(task_id: str) -> Response:
        ref = await client.task(check_task_id(task_id))
        return _json(record_json(await ref.cancel()))

    @api.get(
        "/{task_id}/events",
        dependencies=guard,
        summary="Follow a task: Server-Sent Events of its changes until it ends",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def task_events_stream(task_id: str, request: Request) -> StreamingResponse:
        ref = await client.task(check_task_id(task_id))  # 404 before the stream starts
        if deps.streams.full():
            raise deps.streams.refusal()
        stream: AsyncIterator[str] = task_events(
            ref, deps.settings.sse_ping, record_json, deps.streams
        )
        return StreamingResponse(
            stream,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return api
