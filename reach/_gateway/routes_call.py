"""``POST /v1/capabilities/{capability}``: one request/reply call through the client.

The hot path: options are read from the query and headers by hand (``inputs``), the
body goes to NATS as it came (checked to be JSON unless sent as octet-stream), and the
answer's bytes are embedded in the response without being decoded into Python objects.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from .deps import EdgeDeps
from .inputs import HEADERS, bad, call_options, check_capability
from .settings import Scope

__all__ = ["router"]

_validate = msgspec.json.Decoder()  # for checking: the decoded value is thrown away
_encode = msgspec.json.Encoder()

_PARAMETERS: list[dict[str, Any]] = [
    {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": f"{text} (or header {HEADERS[name].title()})",
    }
    for name, schema, text in (
        ("timeout", {"type": "number", "exclusiveMinimum": 0}, "seconds for the whole call"),
        ("priority", {"enum": ["high", "normal", "low"]}, "queue priority"),
        ("agent_id", {"type": "string"}, "call this instance only (never substituted)"),
        ("tags", {"type": "string"}, "comma-separated tags the instance must all have"),
        ("version", {"type": "string"}, "capability version; the major must match"),
        (
            "routing",
            {"enum": ["balanced", "scored", "queue", "affinity"]},
            "routing policy (default: the gateway client's)",
        ),
        ("affinity_key", {"type": "string"}, "session key of the affinity policy"),
    )
]

_OPENAPI: dict[str, Any] = {
    "parameters": _PARAMETERS,
    "requestBody": {
        "required": False,
        "description": "The payload: JSON (or raw bytes as application/octet-stream)",
        "content": {
            "application/json": {"schema": {}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "responses": {
        "200": {
            "description": "The answer and who served it",
            "content": {
                "application/json": {
                    "example": {
                        "result": {"text": "BONJOUR"},
                        "agent_id": "translator-1",
                        "request_id": "7Hk2...",
                        "latency_ms": 1.9,
                        "duration_ms": 0.4,
                    }
                }
            },
        },
        "400": {"description": "invalid capability name, option or payload"},
        "404": {"description": "capability_not_found"},
        "429": {"description": "resource_exhausted"},
        "502": {"description": "the handler failed (failed, or the application's code)"},
        "503": {"description": "agent_unavailable, circuit_open"},
        "504": {"description": "timeout"},
    },
}


def answer_body(
    data: bytes, agent_id: str, request_id: str, latency: float, duration: Any
) -> bytes:
    """The 200 body. A JSON answer is embedded as it came; anything else as base64."""
    result: Any
    encoding = None
    if not data:
        result = None
    else:
        try:
            _validate.decode(data)
            result = msgspec.Raw(data)
        except msgspec.DecodeError:
            result, encoding = base64.b64encode(data).decode(), "base64"
    body: dict[str, Any] = {
        "result": result,
        "agent_id": agent_id,
        "request_id": request_id,
        "latency_ms": round(latency, 3),
        "duration_ms": duration,
    }
    if encoding:
        body["encoding"] = encoding
    return _encode.encode(body)


def router(deps: EdgeDeps) -> APIRouter:
    api = APIRouter(tags=["capabilities"])
    client = deps.client
    settings = deps.settings

    @api.post(
        "/v1/capabilities/{capability}",
        dependencies=[deps.guard(Scope.CALL)],
        summary="Call a capability (request/reply)",
        response_class=Response,
        openapi_extra=_OPENAPI,
    )
    async def call_capability(capability: str, request: Request) -> Response:
        check_capability(capability)
        opts = call_options(request.query_params, request.headers, settings.max_timeout)
        body = await request.body()
        ctype = request.headers.get("content-type", "")
        if body and not ctype.startswith("application/octet-stream"):
            try:
                _validate.decode(body)
            except msgspec.DecodeError as exc:
                raise bad(
                    f"the body is not JSON ({exc}); send application/octet-stream for raw bytes"
                ) from None
        reply = await client.call(
            capability,
            body,
            timeout=deps.timeout(opts.timeout),
            priority=opts.priority,
            agent_id=opts.agent_id,
            response_type=bytes,
            version=opts.version,
            required_tags=opts.tags,
            routing=opts.routing,
            affinity_key=opts.affinity_key,
        )
        content = answer_body(
            reply.data, reply.agent_id, reply.request_id, reply.latency_ms, reply.duration_ms
        )
        return Response(content, media_type="application/json")

    return api
