"""``reach mcp``: the live fleet as an MCP server, on the official ``mcp`` SDK's low-level
``Server`` (tools whose schemas come from the routing table at run time).

- Every capability served by request is a tool named after it, whose input schema is its
  payload schema (an object payload is the arguments themselves; any other payload is the
  argument ``payload``). A call routes like ``client.request`` (to the newest version's
  major when the fleet serves several), and a Reach error comes back as a tool error
  (``isError``) naming its code, with ``{"error": {"code", "message", "retryable"}}`` as
  structured content.
- Every durable task capability is a tool taking ``payload`` and ``wait``: with ``wait``
  (the default) it submits and waits, sending MCP progress notifications from
  ``ctx.progress``, for at most ``task_wait`` seconds; without, it answers with the task id
  at once. Either way the task is the resource ``reach://tasks/<task_id>``.
- The list follows the routing table: when a change of it changes the tools, clients hear
  ``notifications/tools/list_changed`` (handshake-era connections that listed the tools)
  or a tools event on their ``subscriptions/listen`` stream (2026-07-28 connections).
- Over HTTP, the gateway's bearer tokens (``REACH_GATEWAY_TOKENS``): any valid token lists,
  ``call`` calls capabilities, ``submit`` runs and reads tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import TracebackType
from typing import Any, Self, cast

import mcp_types as types
import msgspec
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.session import ServerSession
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Receive, Scope, Send

from .._background import Background
from .._cli_common import json_or_text
from .._client import Client
from .._subjects import validate_capability
from .._tokens import Scope as TokenScope
from .._tokens import Tokens, bearer
from ..errors import CapabilityNotFound, ReachError, TaskNotFound, Unauthorized
from ..wire import AgentRecord, Status, TaskRecord, TaskState
from .catalogue import Catalogue, Offer, catalogue
from .schemas import RAW_BYTES

__all__ = ["TASK_URI", "BearerAuth", "FleetServer"]

log = logging.getLogger("reach.mcp")

#: where a durable task is read, as an MCP resource
TASK_URI = "reach://tasks/{task_id}"
_TASK_PREFIX = TASK_URI.partition("{")[0]
#: handshake-era connections remembered for list_changed, at most (oldest dropped)
_MAX_SESSIONS = 10_000
#: a connection silent for longer is forgotten (the SDK's HTTP session idle timeout)
_SESSION_IDLE = 30 * 60.0
#: seconds one connection may take to accept a list_changed notice
_NOTICE_TIMEOUT = 1.0
_WAIT: dict[str, Any] = {
    "type": "boolean",
    "default": True,
    "description": "true: wait for the result (progress notifications meanwhile);"
    " false: answer at once with the task id (read reach://tasks/<task_id> later)",
}
_canonical = msgspec.json.Encoder(order="sorted").encode


@dataclass(frozen=True, slots=True)
class _Tool:
    """How one tool's call reaches the fleet."""

    kind: str  # "request" or "task"
    capability: str
    wrapped: bool  # the payload is the argument "payload", not the arguments
    raw: bool  # the payload is raw bytes (sent as the UTF-8 text given)
    version: str | None  # route to this major (the fleet serves several)
    tool: types.Tool

    def payload(self, arguments: Mapping[str, Any]) -> Any:
        value = arguments.get("payload") if self.wrapped else dict(arguments)
        if self.raw and isinstance(value, str):
            return value.encode()
        return value


def tool_of(offer: Offer) -> tuple[types.Tool, _Tool]:
    """The MCP tool of a capability or task capability, and how its calls go."""
    newest = offer.newest
    payload = newest.payload
    raw = payload is not None and payload.get("contentMediaType") == RAW_BYTES["contentMediaType"]
    wrapped = offer.kind == "task" or payload is None or raw or payload.get("type") != "object"
    if not wrapped:
        assert payload is not None
        input_schema = payload
    else:
        inner = dict(payload) if payload is not None else {}
        defs = inner.pop("$defs", None)
        if payload is None:
            inner = {"description": "the payload (JSON); the agent does not describe it"}
        elif raw:
            inner = {"type": "string", "description": "the payload, sent as raw UTF-8 bytes"}
        input_schema = {"type": "object", "properties": {"payload": inner}}
        if payload is not None and payload != {}:
            input_schema["required"] = ["payload"]
        if offer.kind == "task":
            input_schema["properties"]["wait"] = _WAIT
        if defs:
            input_schema["$defs"] = defs  # "#/$defs/..." resolves from the root
    majors = {v.version.partition(".")[0] for v in offer.variants}
    version = newest.version if len(majors) > 1 else None
    result = newest.result
    output = (
        result if offer.kind == "request" and result and result.get("type") == "object" else None
    )
    tool = types.Tool(
        name=offer.name,
        title=offer.name,
        description=_description(offer),
        input_schema=input_schema,
        output_schema=output,
        _meta={"reach/kind": offer.kind, "reach/version": newest.version},
    )
    return tool, _Tool(offer.kind, offer.name, wrapped, raw, version, tool)


def _description(offer: Offer) -> str:
    text = offer.description or f"The Agent-Reach capability {offer.name}."
    if offer.kind == "task":
        text += (
            "\n\nA durable task: it runs to the end even if this call goes away. Pass the"
            " payload as `payload`; `wait: false` answers with the task id at once."
        )
    others = [v.version for v in offer.variants[1:] if v.version != offer.newest.version]
    if others:
        text += f"\n\nVersion {offer.newest.version}; also served: {', '.join(others)}."
    return text


class _Server(Server[Any]):
    """The SDK's server, announcing ``tools.listChanged`` whoever builds its options (the
    streamable HTTP manager builds them without asking us)."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities,
            extensions,
        )


class FleetServer:
    """The fleet's MCP server over a connected ``Client``: its tools, their calls, and
    following the routing table (``follow``, run beside the transport)."""

    def __init__(
        self,
        client: Client,
        *,
        names: Sequence[str] = (),
        tags: Sequence[str] = (),
        timeout: float | None = None,
        task_wait: float = 300.0,
        version: str = "",
    ) -> None:
        self.client = client
        self.names = tuple(names)
        self.tags = tuple(tags)
        self.timeout = timeout
        self.task_wait = task_wait
        self.bus = InMemorySubscriptionBus()
        self.tools: list[types.Tool] = []
        self._calls: dict[str, _Tool] = {}
        self._shapes: dict[str, bytes] = {}  # agent id -> what of it makes the tools
        self._sessions: dict[str, tuple[ServerSession, float]] = {}
        self.notices = 0  # times the tool list changed and clients were told
        self._work = Background("mcp server")
        self.server = _Server(
            "reach",
            version=version,
            title="Agent-Reach fleet",
            instructions=(
                "Each tool is a capability of a live Agent-Reach fleet: a call is routed to"
                " an instance that serves it. Task tools run durable tasks (read them as"
                " reach://tasks/<task_id>). The list changes as agents come and go."
            ),
            get_tool_input_schema=self._input_schema,  # Mcp-Param-* checks (2026-07-28)
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_subscriptions_listen=ListenHandler(self.bus),
            on_list_resource_templates=self._list_templates,
            on_read_resource=self._read_resource,
        )

    async def __aenter__(self) -> Self:
        """The tools as of now, then follow the routing table until the block ends."""
        await self.refresh()
        self._work.reopen()
        self._work.keep(self.follow, "follow the routing table")
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._work.close(timeout=5.0)

    # -- the tool list, following the routing table -----------------------------------

    async def refresh(self) -> bool:
        """Rebuild the tools from the routing table; True when they changed."""
        records = await self.client.agents()
        self._shapes = {r.info.agent_id: _shape(r) for r in records}
        tools, calls = self._tools(catalogue(records, names=self.names, tags=self.tags))
        changed = [t.model_dump() for t in tools] != [t.model_dump() for t in self.tools]
        self.tools, self._calls = tools, calls
        return changed

    @staticmethod
    def _tools(cat: Catalogue) -> tuple[list[types.Tool], dict[str, _Tool]]:
        tools: list[types.Tool] = []
        calls: dict[str, _Tool] = {}
        for offer in (*cat.capabilities, *cat.tasks):
            if offer.name in calls:
                continue  # served by request and as a task: the request wins the name
            tool, call = tool_of(offer)
            tools.append(tool)
            calls[offer.name] = call
        return tools, calls

    async def follow(self) -> None:
        """Keep the tools in step with the routing table, and tell clients of each change.
        Runs until cancelled (restarted after a crash: what changed meanwhile is told)."""
        if await self.refresh():
            await self.tools_changed()
        async for change in self.client.changes():
            if isinstance(change, str):
                moved = self._shapes.get(change) is not None
            else:
                moved = self._shapes.get(change.info.agent_id) != _shape(change)
            if moved and await self.refresh():
                await self.tools_changed()

    async def tools_changed(self) -> None:
        """Tell every client that listens: subscribers of the 2026-07-28 listen streams, and
        the handshake-era connections that listed the tools."""
        self.notices += 1
        log.info("mcp: the tools changed: %s", ", ".join(t.name for t in self.tools) or "none")
        await self.bus.publish(ToolsListChanged())
        now = time.monotonic()
        for key, (session, seen) in list(self._sessions.items()):
            if now - seen > _SESSION_IDLE:
                del self._sessions[key]
                continue
            with contextlib.suppress(TimeoutError):  # best effort: one slow client
                async with asyncio.timeout(_NOTICE_TIMEOUT):  # does not hold the others
                    await session.send_tool_list_changed()

    def _remember(self, ctx: ServerRequestContext[Any, Any]) -> None:
        """A handshake-era connection listed the tools: it hears when they change."""
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return  # these listen with subscriptions/listen
        request = ctx.request
        key = "stdio"
        if request is not None:
            key = request.headers.get("mcp-session-id", "")
            if not key:
                return  # stateless HTTP: no stream to tell it on
        self._sessions.pop(key, None)
        self._sessions[key] = (ctx.session, time.monotonic())
        while len(self._sessions) > _MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]

    # -- handlers ----------------------------------------------------------------------

    def _input_schema(self, name: str) -> dict[str, Any] | None:
        """A tool's input schema, without building the list (None: not a tool now)."""
        call = self._calls.get(name)
        return call.tool.input_schema if call is not None else None

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        self._remember(ctx)
        return types.ListToolsResult(tools=list(self.tools))

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        call = self._calls.get(params.name)
        if call is None:
            if not self._chosen(params.name):
                raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}")
            return _error(  # it was listed, and has left since
                CapabilityNotFound(
                    f"no live agent offers {params.name!r} now (the tool list has changed)",
                    capability=params.name,
                )
            )
        arguments = params.arguments or {}
        try:
            _allow(ctx, TokenScope.SUBMIT if call.kind == "task" else TokenScope.CALL)
            if call.kind == "task":
                return await self._run_task(ctx, call, arguments)
            reply = await self.client.call(
                call.capability,
                call.payload(arguments),
                timeout=self.timeout,
                version=call.version,
                required_tags=self.tags,
            )
        except ReachError as exc:
            return _error(exc)
        return _success(reply.data)

    def _chosen(self, name: str) -> bool:
        """A name this server exposes when it is served: a capability name the globs take."""
        try:
            validate_capability(name)
        except ValueError:
            return False
        return not self.names or any(fnmatchcase(name, g) for g in self.names)

    async def _run_task(
        self, ctx: ServerRequestContext[Any, Any], call: _Tool, arguments: Mapping[str, Any]
    ) -> types.CallToolResult:
        ref = await self.client.submit(
            call.capability,
            call.payload(arguments),
            version=call.version,
            required_tags=self.tags,
            require_agent=True,
        )
        uri = _TASK_PREFIX + ref.task_id
        if not arguments.get("wait", True):
            return _task_answer(ref.task_id, TaskState.PENDING.value, uri)

        async def report(done: float, note: str) -> None:
            await ctx.session.report_progress(done, 1.0, note)  # no-op without a token

        await report(0.0, f"task {ref.task_id} submitted")
        record: TaskRecord | None = None
        seen: tuple[float, str, str] | None = None
        # a generator: closed here, so its KV watch stops however the wait ends
        watch = cast(AsyncGenerator[TaskRecord, None], ref.watch())
        try:
            async with asyncio.timeout(self.task_wait), aclosing(watch) as changes:
                async for record in changes:
                    if record.final:
                        break
                    now = (record.progress, record.progress_note, record.state.value)
                    if now != seen:
                        await report(record.progress, record.progress_note or record.state.value)
                    seen = now
        except TimeoutError:
            state = record.state.value if record is not None else TaskState.PENDING.value
            return _task_answer(ref.task_id, state, uri, waited=self.task_wait)
        if record is None or record.state is not TaskState.SUCCEEDED:
            await ref.result(timeout=self.task_wait)  # the task's error, raised
            record = await self.client.task_record(ref.task_id)
        return _success(record.result or b"")

    async def _list_templates(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(
            resource_templates=[
                types.ResourceTemplate(
                    name="task",
                    title="Durable task",
                    uri_template=TASK_URI,
                    description="A durable task's record: state, progress, result or error.",
                    mime_type="application/json",
                )
            ]
        )

    async def _read_resource(
        self, ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        task_id = params.uri.removeprefix(_TASK_PREFIX)
        if not params.uri.startswith(_TASK_PREFIX) or not task_id:
            raise MCPError(types.INVALID_PARAMS, f"no such resource: {params.uri!r}")
        try:
            _allow(ctx, TokenScope.SUBMIT)
            record = await self.client.task_record(task_id)
        except TaskNotFound:
            raise MCPError(types.INVALID_PARAMS, f"no task {task_id!r}") from None
        except ReachError as exc:
            raise MCPError(types.INTERNAL_ERROR, f"{exc.code}: {exc.message}") from None
        text = msgspec.json.encode(task_view(record)).decode()
        return types.ReadResourceResult(
            contents=[
                types.TextResourceContents(uri=params.uri, mime_type="application/json", text=text)
            ]
        )


def _shape(record: AgentRecord) -> bytes:
    """What of a record the tools depend on (not its load, not its heartbeat)."""
    info = record.info
    return _canonical((record.status is Status.DOWN, info.tags, info.capabilities, info.tasks))


def _allow(ctx: ServerRequestContext[Any, Any], scope: TokenScope) -> None:
    """Over HTTP with tokens, the caller's token must grant ``scope`` (``admin``: all)."""
    request = ctx.request
    scopes = getattr(getattr(request, "state", None), "reach_scopes", None)
    if scopes is None or scope in scopes or TokenScope.ADMIN in scopes:
        return
    raise Unauthorized(f"this token lacks the {scope.value!r} scope")


def _success(data: bytes) -> types.CallToolResult:
    value = json_or_text(data)
    text = data.decode("utf-8", "replace") if data else "null"
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=value if isinstance(value, dict) else None,
    )


def _error(exc: ReachError) -> types.CallToolResult:
    return types.CallToolResult(
        is_error=True,
        content=[types.TextContent(text=f"{exc.code}: {exc.message}")],
        structured_content={
            "error": {"code": exc.code, "message": exc.message, "retryable": exc.retryable}
        },
    )


def _task_answer(
    task_id: str, state: str, uri: str, *, waited: float | None = None
) -> types.CallToolResult:
    said = f"task {task_id} is {state}"
    if waited is not None:
        said += f" after {waited:g}s; it goes on"
    return types.CallToolResult(
        content=[
            types.TextContent(text=f"{said}: read {uri} for its state and result"),
            types.ResourceLink(name=f"task {task_id}", uri=uri, mime_type="application/json"),
        ],
        structured_content={"task_id": task_id, "state": state, "uri": uri},
    )


def task_view(record: TaskRecord) -> dict[str, Any]:
    """A task's record as a reader wants it: the result and payload as JSON (or text)."""
    return {
        "task_id": record.task_id,
        "capability": record.capability,
        "state": record.state.value,
        "attempt": record.attempt,
        "progress": record.progress,
        "progress_note": record.progress_note,
        "agent_id": record.agent_id,
        "payload": json_or_text(record.payload),
        "result": json_or_text(record.result) if record.result is not None else None,
        "error": msgspec.to_builtins(record.error) if record.error is not None else None,
        "submitted_ms": record.submitted_ms,
        "updated_ms": record.updated_ms,
    }


class BearerAuth:
    """ASGI middleware: with tokens configured, a request needs a known bearer token (401
    otherwise); its scopes go in ``scope["state"]["reach_scopes"]`` for the handlers."""

    def __init__(self, app: ASGIApp, tokens: Tokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.tokens.open:
            headers = dict(scope.get("headers") or [])
            token = bearer(headers.get(b"authorization", b"").decode("latin-1"))
            scopes = self.tokens.scopes(token) if token else None
            if scopes is None:
                await _refuse(send, "a known bearer token is required")
                return
            scope.setdefault("state", {})["reach_scopes"] = scopes
        await self.app(scope, receive, send)


async def _refuse(send: Send, message: str) -> None:
    body = msgspec.json.encode({"error": {"code": "unauthorized", "message": message}})
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", b'Bearer realm="reach"'),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
