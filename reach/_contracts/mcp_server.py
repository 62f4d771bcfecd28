"""``reach mcp``: the live fleet as an MCP server, on the official ``mcp`` SDK's low-level
``Server`` (tools whose schemas come from the routing table at run time).

- Every capability served by request is a tool named after it, whose input schema is its
  payload schema (an object payload is the arguments themselves; any other payload is the
  argument ``payload``). A call routes like ``client.request`` (to the newest version's
  major when the fleet serves several), and a Reach error comes back as a tool error
  (``isError``) naming its code, with ``{"error": {"code", "message", "retryable"}}`` as
  structured content.
- A capability that streams its answer is called with ``client.stream``: each chunk is a
  progress notification (its text the message) as it comes, and the result is the chunks
  joined as one text when every chunk is a string, else their list (``{"chunks": [...]}``).
- Every durable task capability is a tool taking ``payload`` and ``wait``: with ``wait``
  (the default) it submits and waits, sending MCP progress notifications from
  ``ctx.progress``, for at most ``task_wait`` seconds; without, it answers with the task id
  at once. Either way the task is the resource ``reach://tasks/<task_id>``.
- Progress values only increase, as MCP requires: a report not above the last one sent
  (a retry starting again from 0) is not sent.
- The list follows the routing table: when a change of it changes the tools, clients hear
  ``notifications/tools/list_changed`` (handshake-era connections that listed the tools)
  or a tools event on their ``subscriptions/listen`` stream (2026-07-28 connections). The
  stdio connection hears for as long as it lasts; an HTTP session until the SDK closes it
  (ended by its client, or with no request in flight for ``session_idle`` seconds).
- Over HTTP, the gateway's bearer tokens (``REACH_GATEWAY_TOKENS``): any valid token lists
  the tools it may call, ``call`` calls capabilities, ``submit`` runs and reads tasks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Hashable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, cast

import anyio
import mcp_types as types
import msgspec
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.session import ServerSession
from mcp.server.streamable_http_manager import DEFAULT_SESSION_IDLE_TIMEOUT
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._background import Background
from .._cli_common import json_or_text
from .._client import Client
from .._codec import canonical
from .._subjects import validate_capability
from .._tokens import CHALLENGE, Tokens
from .._tokens import Scope as TokenScope
from ..errors import CapabilityNotFound, ReachError, TaskNotFound, Unauthorized
from ..wire import AgentRecord, Status, TaskRecord, TaskState
from .catalogue import Catalogue, Offer, catalogue, chosen
from .schemas import RAW_BYTES

__all__ = ["TASK_URI", "BearerAuth", "FleetServer", "record_key", "tool_of"]

log = logging.getLogger("reach.mcp")

#: where a durable task is read, as an MCP resource
TASK_URI = "reach://tasks/{task_id}"
_TASK_PREFIX = TASK_URI.partition("{")[0]
#: handshake-era connections remembered for list_changed, at most (oldest dropped)
_MAX_SESSIONS = 10_000
#: seconds all connections together may take to accept a list_changed notice
_NOTICE_TIMEOUT = 1.0
#: the one connection of a stdio server: heard for as long as the process serves
_STDIO = "stdio"
#: "resource not found" before 2026-07-28; that version (SEP-2164) says INVALID_PARAMS
_RESOURCE_NOT_FOUND = -32002
_WAIT: dict[str, Any] = {
    "type": "boolean",
    "default": True,
    "description": "true: wait for the result (progress notifications meanwhile);"
    " false: answer at once with the task id (read reach://tasks/<task_id> later)",
}


@dataclass(frozen=True, slots=True)
class _Tool:
    """How one tool's call reaches the fleet."""

    kind: str  # "request", "stream" (a request answered in chunks) or "task"
    capability: str
    wrapped: bool  # the payload is the argument "payload", not the arguments
    raw: bool  # the payload is raw bytes (sent as the UTF-8 text given)
    version: str | None  # route to this major (the fleet serves several)
    tool: types.Tool

    @property
    def scope(self) -> TokenScope:
        """What a token needs to call it (and to see it listed)."""
        return TokenScope.SUBMIT if self.kind == "task" else TokenScope.CALL

    def payload(self, arguments: Mapping[str, Any]) -> Any:
        value = arguments.get("payload") if self.wrapped else dict(arguments)
        if self.raw and isinstance(value, str):
            return value.encode()
        return value


def tool_of(offer: Offer) -> tuple[types.Tool, _Tool]:
    """The MCP tool of a capability or task capability, and how its calls go."""
    newest = offer.newest
    kind = "stream" if offer.kind == "request" and newest.streams else offer.kind
    payload = newest.payload
    raw = payload is not None and payload.get("contentMediaType") == RAW_BYTES["contentMediaType"]
    wrapped = kind == "task" or payload is None or raw or payload.get("type") != "object"
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
        if kind == "task":
            input_schema["properties"]["wait"] = _WAIT
        if defs:
            input_schema["$defs"] = defs  # "#/$defs/..." resolves from the root
    majors = {_major(v.version) for v in offer.variants}
    version = newest.version if len(majors) > 1 else None
    tool = types.Tool(
        name=offer.name,
        title=offer.name,
        description=_description(offer, kind),
        input_schema=input_schema,
        output_schema=_output_schema(offer) if kind == "request" else None,
        _meta={"reach/kind": kind, "reach/version": newest.version},
    )
    return tool, _Tool(kind, offer.name, wrapped, raw, version, tool)


def _major(version: str) -> str:
    return version.partition(".")[0]


def _output_schema(offer: Offer) -> dict[str, Any] | None:
    """The schema of the structured content of a request tool's answers: a call may reach
    any variant of the newest's major. One result schema for all of them: that one; object
    schemas that differ: the open object schema ``{"type": "object"}`` (a union would mix
    the variants' ``$defs``); any of them not an object (or not described): none, and the
    answer is text alone."""
    major = _major(offer.newest.version)
    results = [v.result for v in offer.variants if _major(v.version) == major]
    if not all(r is not None and r.get("type") == "object" for r in results):
        return None
    first = results[0]
    if all(r == first for r in results[1:]):
        return first
    return {"type": "object"}


def _description(offer: Offer, kind: str) -> str:
    text = offer.description or f"The Agent-Reach capability {offer.name}."
    if kind == "task":
        text += (
            "\n\nA durable task: it runs to the end even if this call goes away. Pass the"
            " payload as `payload`; `wait: false` answers with the task id at once."
        )
    elif kind == "stream":
        text += (
            "\n\nIts answer comes in chunks, each as a progress notification as it comes;"
            " the result is the chunks joined as one text when every chunk is text, else"
            " their list."
        )
    others = [v.version for v in offer.variants[1:] if v.version != offer.newest.version]
    if others:
        text += f"\n\nVersion {offer.newest.version}; also served: {', '.join(others)}."
    return text


def record_key(record: AgentRecord) -> Hashable:
    """What of a record the tools depend on, found without encoding its schemas: its info
    changes only when the agent registers, which sets ``registered_ms`` (a heartbeat
    changes neither); only DOWN counts of its status. A record without ``registered_ms``
    (an older registry's) is compared by its encoded info."""
    down = record.status is Status.DOWN
    if record.registered_ms:
        return (down, record.registered_ms)
    info = record.info
    return (down, canonical((info.tags, info.capabilities, info.tasks)))


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


@dataclass(slots=True)
class _Peer:
    """A handshake-era connection: where it hears that the tools changed (once it listed
    them) and, over HTTP, its requests in flight and when the last one ended (the SDK
    keeps a session by the same two facts)."""

    session: ServerSession | None = None
    busy: int = 0
    seen: float = 0.0


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
        session_idle: float = DEFAULT_SESSION_IDLE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.clock = clock  # when connections were last seen (tests pass their own)
        self.names = tuple(names)
        self.tags = tuple(tags)
        self.timeout = timeout
        self.task_wait = task_wait
        #: an HTTP session with no request in flight for this long is closed (by the SDK)
        #: and forgotten (here)
        self.session_idle = session_idle
        self.bus = InMemorySubscriptionBus()
        self.tools: list[types.Tool] = []
        self._calls: dict[str, _Tool] = {}
        self._keys: dict[str, Hashable] = {}  # agent id -> record_key, as the tools saw it
        self._untold = False  # the tools changed and not every client was told yet
        self._peers: dict[str, _Peer] = {}  # session id (or _STDIO) -> the connection
        self._requests: set[anyio.CancelScope] = set()  # HTTP requests being served
        self._stopping = False
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
        self._untold = False  # nobody listens yet
        self._work.reopen()
        self._work.keep(self.follow, "follow the routing table")
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._work.close(timeout=5.0)

    @property
    def sessions(self) -> int:
        """Connections told when the tools change (handshake era: those that listed them)."""
        return sum(1 for p in self._peers.values() if p.session is not None)

    def http_app(self, *, host: str, tokens: Tokens) -> ASGIApp:
        """Streamable HTTP at ``/mcp``: the SDK's app, whose requests keep their sessions
        heard (``_Requests``), behind the bearer tokens (``BearerAuth``)."""
        app = self.server.streamable_http_app(host=host, session_idle_timeout=self.session_idle)
        return BearerAuth(_Requests(app, self), tokens)

    def stop_requests(self) -> None:
        """The HTTP server stops: end the requests in flight (each with a complete answer,
        so the server need not wait for event streams that never end) and refuse new ones."""
        self._stopping = True
        for scope in list(self._requests):
            scope.cancel()

    # -- the tool list, following the routing table -----------------------------------

    async def refresh(self) -> bool:
        """Rebuild the tools from the routing table; True when they changed."""
        records = await self.client.agents()
        self._keys = {r.info.agent_id: record_key(r) for r in records}
        tools, calls = self._tools(catalogue(records, names=self.names, tags=self.tags))
        changed = [t.model_dump() for t in tools] != [t.model_dump() for t in self.tools]
        self.tools, self._calls = tools, calls
        if changed:
            self._untold = True
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
        Runs until cancelled; restarted after a crash, it tells what was not told yet. A
        heartbeat is judged by ``record_key`` alone; changes this listener lost (it fell
        behind) make it read the whole table again."""
        await self._sync()
        lost = self.client.stats.changes_dropped
        async for change in self.client.changes():
            dropped = self.client.stats.changes_dropped
            if dropped != lost or self._moved(change):
                lost = dropped
                await self._sync()

    def _moved(self, change: AgentRecord | str) -> bool:
        if isinstance(change, str):
            return change in self._keys
        return self._keys.get(change.info.agent_id) != record_key(change)

    async def _sync(self) -> None:
        await self.refresh()
        if self._untold:
            await self.tools_changed()

    async def tools_changed(self) -> None:
        """Tell every client that listens: subscribers of the 2026-07-28 listen streams, and
        the handshake-era connections that listed the tools, all at once and within
        ``_NOTICE_TIMEOUT`` together. A connection that fails to take it is forgotten."""
        self.notices += 1
        log.info("mcp: the tools changed: %s", ", ".join(t.name for t in self.tools) or "none")
        await self.bus.publish(ToolsListChanged())
        self._forget_idle()
        deadline = asyncio.get_running_loop().time() + _NOTICE_TIMEOUT
        async with asyncio.TaskGroup() as tg:
            for key, peer in list(self._peers.items()):
                if peer.session is not None:
                    tg.create_task(self._tell(key, peer.session, deadline))
        self._untold = False

    async def _tell(self, key: str, session: ServerSession, deadline: float) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                await session.send_tool_list_changed()
        except TimeoutError:  # slow, not gone: it hears of the next change
            log.info("mcp: connection %s did not take the tools notice in time", key)
        except Exception:
            log.warning("mcp: telling connection %s failed; forgotten", key, exc_info=True)
            peer = self._peers.get(key)
            if peer is not None and peer.session is session:
                del self._peers[key]

    # -- the connections that hear of changes ------------------------------------------

    def _peer(self, key: str) -> _Peer:
        peer = self._peers.get(key)
        if peer is None:
            if len(self._peers) >= _MAX_SESSIONS:
                self._forget_idle()
            while len(self._peers) >= _MAX_SESSIONS:
                del self._peers[next(iter(self._peers))]  # the oldest
            peer = self._peers[key] = _Peer(seen=self.clock())
        return peer

    def _forget_idle(self) -> None:
        """HTTP sessions the SDK has closed for idleness (none in flight for
        ``session_idle`` seconds). The stdio connection is never idle: it lasts as long as
        the process serves it."""
        now = self.clock()
        for key, peer in list(self._peers.items()):
            if key != _STDIO and not peer.busy and now - peer.seen > self.session_idle:
                del self._peers[key]

    def _remember(self, ctx: ServerRequestContext[Any, Any]) -> None:
        """A handshake-era connection listed the tools: it hears when they change."""
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return  # these listen with subscriptions/listen
        request = ctx.request
        key = _STDIO
        if request is not None:
            key = request.headers.get("mcp-session-id", "")
            if not key:
                return  # stateless HTTP: no stream to tell it on
        self._peer(key).session = ctx.session

    def _began(self, key: str) -> _Peer:
        peer = self._peer(key)
        peer.busy += 1
        return peer

    def _ended(self, key: str, peer: _Peer, method: str, status: int | None) -> None:
        peer.busy -= 1
        peer.seen = self.clock()
        ended = status == 404 or (method == "DELETE" and status is not None and status < 300)
        if ended and self._peers.get(key) is peer:
            del self._peers[key]  # ended by its client, or unknown to the SDK (closed)

    # -- handlers ----------------------------------------------------------------------

    def _input_schema(self, name: str) -> dict[str, Any] | None:
        """A tool's input schema, without building the list (None: not a tool now)."""
        call = self._calls.get(name)
        return call.tool.input_schema if call is not None else None

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        self._remember(ctx)
        scopes = _scopes(ctx)
        if scopes is None:
            return types.ListToolsResult(tools=list(self.tools))
        calls = self._calls
        return types.ListToolsResult(
            tools=[t for t in self.tools if _grants(scopes, calls[t.name].scope)]
        )

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
            _allow(ctx, call.scope)
            if call.kind == "task":
                return await self._run_task(ctx, call, arguments)
            if call.kind == "stream":
                return await self._run_stream(ctx, call, arguments)
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
        return chosen(name, self.names)

    async def _run_stream(
        self, ctx: ServerRequestContext[Any, Any], call: _Tool, arguments: Mapping[str, Any]
    ) -> types.CallToolResult:
        """``client.stream``: each chunk a progress notification (1, 2, ...; its text the
        message), the result all of them (``_chunks``)."""
        progress = _Progress(ctx.session)
        chunks: list[Any] = []
        async with self.client.stream(
            call.capability,
            call.payload(arguments),
            timeout=self.timeout,
            version=call.version,
            required_tags=self.tags,
            response_type=bytes,
        ) as stream:
            async for data in stream:
                value = json_or_text(data)
                chunks.append(value)
                text = value if isinstance(value, str) else data.decode("utf-8", "replace")
                await progress(float(len(chunks)), text)
        return _chunks(chunks)

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
        progress = _Progress(ctx.session, total=1.0)
        await progress(0.0, f"task {ref.task_id} submitted")
        record: TaskRecord | None = None
        # a generator: closed here, so its KV watch stops however the wait ends
        watch = cast(AsyncGenerator[TaskRecord, None], ref.watch())
        try:
            async with asyncio.timeout(self.task_wait), aclosing(watch) as changes:
                async for record in changes:
                    if record.final:
                        break
                    await progress(record.progress, record.progress_note or record.state.value)
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
        scopes = _scopes(ctx)
        if scopes is not None and not _grants(scopes, TokenScope.SUBMIT):
            return types.ListResourceTemplatesResult(resource_templates=[])
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
        uri = params.uri
        task_id = uri.removeprefix(_TASK_PREFIX)
        if not uri.startswith(_TASK_PREFIX) or not task_id:
            raise _not_found(ctx, uri, f"no such resource: {uri!r}")
        try:
            _allow(ctx, TokenScope.SUBMIT)
            record = await self.client.task_record(task_id)
        except TaskNotFound:
            raise _not_found(ctx, uri, f"no task {task_id!r}") from None
        except Unauthorized as exc:  # the caller may not: not an error of ours
            raise MCPError(types.INVALID_REQUEST, _said(exc), data=_error_body(exc)) from None
        except ReachError as exc:
            raise MCPError(types.INTERNAL_ERROR, _said(exc), data=_error_body(exc)) from None
        text = msgspec.json.encode(task_view(record)).decode()
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=uri, mime_type="application/json", text=text)]
        )


class _Progress:
    """One call's progress notifications, whose values must increase (MCP): a report not
    above the last one sent (a retry starting again from 0) is not sent."""

    def __init__(self, session: ServerSession, total: float | None = None) -> None:
        self._session = session
        self._total = total
        self._last: float | None = None

    async def __call__(self, value: float, message: str) -> None:
        if self._last is not None and value <= self._last:
            return
        self._last = value
        await self._session.report_progress(value, self._total, message)  # no-op untokened


def _scopes(ctx: ServerRequestContext[Any, Any]) -> frozenset[TokenScope] | None:
    """What the caller's token grants over HTTP with tokens; None: everything (stdio, or
    no tokens)."""
    state = getattr(ctx.request, "state", None)
    return cast(frozenset[TokenScope] | None, getattr(state, "reach_scopes", None))


def _grants(scopes: frozenset[TokenScope], scope: TokenScope) -> bool:
    return scope in scopes or TokenScope.ADMIN in scopes


def _allow(ctx: ServerRequestContext[Any, Any], scope: TokenScope) -> None:
    """Over HTTP with tokens, the caller's token must grant ``scope`` (``admin``: all)."""
    scopes = _scopes(ctx)
    if scopes is not None and not _grants(scopes, scope):
        raise Unauthorized(f"this token lacks the {scope.value!r} scope")


def _not_found(ctx: ServerRequestContext[Any, Any], uri: str, message: str) -> MCPError:
    """A resource that is not there, with the code of the connection's protocol version."""
    modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
    code = types.INVALID_PARAMS if modern else _RESOURCE_NOT_FOUND
    return MCPError(code, message, data={"uri": uri})


def _said(exc: ReachError) -> str:
    return f"{exc.code}: {exc.message}"


def _error_body(exc: ReachError) -> dict[str, Any]:
    return {"code": exc.code, "message": exc.message, "retryable": exc.retryable}


def _success(data: bytes) -> types.CallToolResult:
    value = json_or_text(data)
    text = data.decode("utf-8", "replace") if data else "null"
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=value if isinstance(value, dict) else None,
    )


def _chunks(chunks: list[Any]) -> types.CallToolResult:
    """A streamed answer: one text when every chunk is text (the pieces of a text, as a
    model's tokens), else the list, also as ``{"chunks": [...]}``."""
    if all(isinstance(c, str) for c in chunks):
        return types.CallToolResult(content=[types.TextContent(text="".join(chunks))])
    return types.CallToolResult(
        content=[types.TextContent(text=msgspec.json.encode(chunks).decode())],
        structured_content={"chunks": chunks},
    )


def _error(exc: ReachError) -> types.CallToolResult:
    return types.CallToolResult(
        is_error=True,
        content=[types.TextContent(text=_said(exc))],
        structured_content={"error": _error_body(exc)},
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


class _Requests:
    """ASGI middleware before the SDK's app: each request counts for its session (the
    session id header), so a session with requests in flight or recent ones keeps hearing
    of changes, and one its client ended (DELETE) or the SDK no longer knows (404) is
    forgotten at once. On ``stop_requests`` the requests in flight end with a complete
    answer: an event stream ends, a request not yet answered gets a 503."""

    def __init__(self, app: ASGIApp, fleet: FleetServer) -> None:
        self.app = app
        self.fleet = fleet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        fleet = self.fleet
        if fleet._stopping:
            await _answer(send, 503, _stopping_body())
            return
        key = dict(scope.get("headers") or []).get(b"mcp-session-id", b"").decode("latin-1")
        peer = fleet._began(key) if key else None
        status: int | None = None
        complete = False

        async def watched(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        cancel = anyio.CancelScope()
        fleet._requests.add(cancel)
        try:
            with cancel:
                await self.app(scope, receive, watched)
        finally:
            fleet._requests.discard(cancel)
            if peer is not None:
                fleet._ended(key, peer, scope["method"], status)
        if cancel.cancelled_caught and not complete:  # stop_requests
            if status is None:
                await _answer(send, 503, _stopping_body())
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


def _stopping_body() -> bytes:
    error = {"code": types.INTERNAL_ERROR, "message": "the server is stopping"}
    return msgspec.json.encode({"jsonrpc": "2.0", "id": None, "error": error})


async def _answer(
    send: Send, status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> None:
    """A whole JSON answer."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BearerAuth:
    """ASGI middleware: with tokens configured, a request needs a known bearer token (401
    otherwise); its scopes go in ``scope["state"]["reach_scopes"]`` for the handlers."""

    def __init__(self, app: ASGIApp, tokens: Tokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.tokens.open:
            headers = dict(scope.get("headers") or [])
            try:
                scopes = self.tokens.admit(headers.get(b"authorization", b"").decode("latin-1"))
            except Unauthorized as exc:
                body = msgspec.json.encode({"error": {"code": exc.code, "message": exc.message}})
                await _answer(send, 401, body, CHALLENGE)
                return
            scope.setdefault("state", {})["reach_scopes"] = scopes
        await self.app(scope, receive, send)
