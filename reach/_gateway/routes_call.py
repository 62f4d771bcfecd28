"""``POST /v1/capabilities/{capability}``: one request/reply call through the client.

The hot path: options are read from the query and headers by hand (``inputs``), the
body goes to NATS as it came (checked to be JSON unless sent as octet-stream), and the
answer's bytes, once checked to be JSON, are embedded in the response as they came.
"""

from __future__ import annotations

import base64
from typing import Any
from urllib.parse import parse_qsl

import msgspec
from starlette.routing import Match, Route
from starlette.types import Receive, Send
from starlette.types import Scope as AsgiScope

from ..errors import ReachError
from .deps import EdgeDeps
from .errors import EdgeError, reach_error_response
from .inputs import HEADERS, call_options, check_body, check_capability
from .middleware import EdgeMiddleware
from .settings import Scope

__all__ = ["OPENAPI_PATHS", "PATH", "CallEndpoint", "CallRoute", "FastPath", "call_route"]

PATH = "/v1/capabilities/{capability}"
_PREFIX = "/v1/capabilities/"
_JSON_HEADERS = [(b"content-type", b"application/json")]
_WANTED = frozenset({b"authorization", b"content-type", *(h.encode() for h in HEADERS.values())})

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

_PATH_PARAMETER = {
    "name": "capability",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "lowercase tokens [a-z0-9_-] joined by dots, e.g. text.translate",
}
_OPERATION: dict[str, Any] = {
    "tags": ["capabilities"],
    "summary": "Call a capability (request/reply)",
    "description": "Needs the `call` scope when tokens are configured.",
    "operationId": "call_capability",
    "parameters": [_PATH_PARAMETER, *_PARAMETERS],
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
#: merged into the app's OpenAPI schema (the route is plain ASGI, which FastAPI skips)
OPENAPI_PATHS: dict[str, Any] = {PATH: {"post": _OPERATION}}


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
        # as the agent's header said it, rounded the same (another SDK's may be long)
        "duration_ms": round(duration, 3) if isinstance(duration, float) else duration,
    }
    if encoding:
        body["encoding"] = encoding
    return _encode.encode(body)


class CallEndpoint:
    """The route's ASGI app. Plain ASGI, not a FastAPI endpoint: FastAPI's per-request
    dependency solving cost more than the call itself (it is documented in the OpenAPI
    schema by ``OPENAPI_PATHS``). Same rules as every route: the token's scope, the JSON
    error shape, the body limit (``EdgeMiddleware`` counts what ``receive`` gives)."""

    def __init__(self, deps: EdgeDeps) -> None:
        self.deps = deps
        self.client = deps.client
        self.auth = deps.auth
        self.max_timeout = deps.settings.max_timeout

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        try:
            content = await self._serve(scope, receive)
        except ReachError as exc:
            await reach_error_response(exc)(scope, receive, send)
            return
        headers = [*_JSON_HEADERS, (b"content-length", str(len(content)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def _serve(self, scope: AsgiScope, receive: Receive) -> bytes:
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name in _WANTED:
                headers[name.decode()] = value.decode("latin-1")
        if not self.auth.open:
            self.auth.check(headers.get("authorization"), Scope.CALL)
        capability = check_capability(scope["path_params"]["capability"])
        qs = scope["query_string"]
        query = dict(parse_qsl(qs.decode("latin-1"))) if qs else {}
        opts = call_options(query, headers, self.max_timeout)
        body = await _read_body(receive)
        check_body(body, headers.get("content-type", ""))
        reply = await self.client.call(
            capability,
            body,
            timeout=self.deps.timeout(opts.timeout),
            response_type=bytes,
            **opts.routed(),
        )
        return answer_body(
            reply.data, reply.agent_id, reply.request_id, reply.latency_ms, reply.duration_ms
        )


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise EdgeError(400, "bad_request", "the client went away before its body came")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class FastPath:
    """``POST /v1/capabilities/<cap>`` straight to its ``CallEndpoint``, around Starlette's
    middleware and router, which cost as much as the rest of the gateway's work on a call.
    It keeps what they give this route: the body limit, the HTTP metrics and a 500 in the
    JSON shape for an unexpected error (``EdgeMiddleware`` with ``outermost``). A request
    it does not take (another path, a ``root_path``) goes the usual way, to the same
    endpoint."""

    def __init__(self, route: Route, deps: EdgeDeps) -> None:
        self.route = route
        self.app = EdgeMiddleware(
            route.app, metrics=deps.metrics, settings=deps.settings, outermost=True
        )

    def takes(self, scope: AsgiScope) -> bool:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return False
        path: str = scope["path"]
        return path.startswith(_PREFIX) and "/" not in path[len(_PREFIX) :]

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        scope["route"] = self.route
        scope["path_params"] = {"capability": scope["path"][len(_PREFIX) :]}
        await self.app(scope, receive, send)


class CallRoute(Route):
    """A plain Starlette route that names itself in the scope when it matches, as
    FastAPI's own routes do: ``EdgeMiddleware`` labels its metrics by ``scope["route"]``."""

    def matches(self, scope: AsgiScope) -> tuple[Match, AsgiScope]:
        match, child = super().matches(scope)
        if match is not Match.NONE:
            child["route"] = self
        return match, child


def call_route(deps: EdgeDeps) -> Route:
    return CallRoute(PATH, CallEndpoint(deps), methods=["POST"], name="call_capability")
