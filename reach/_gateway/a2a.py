"""The A2A (Agent2Agent) endpoint: every agent name in the routing table is an A2A agent.

    GET  {prefix}/                                   every card: {"agents": [card, ...]}
    GET  {prefix}/{name}/.well-known/agent-card.json the card of agent name {name}
    POST {prefix}/{name}                             its JSON-RPC endpoint (A2A 1.0, and 0.3)

One SDK JSON-RPC dispatcher (``create_jsonrpc_routes``) serves every name: the URL's
``{name}`` goes into the SDK's call context, and one ``ReachRequestHandler`` reads it. So
no app is built per name and nothing needs evicting when a name leaves the table; cards are
built per request from the client's live routing table (``a2a_cards``). Nothing runs in the
background: streams live as long as their HTTP request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.server.routes import DefaultServerCallContextBuilder, create_jsonrpc_routes
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from .._client import Client
from .a2a_cards import Named, card_of, fleet
from .a2a_handler import AGENT_NAME, CALLER, SCOPES, ReachRequestHandler
from .auth import OPEN_CALLER, caller_id
from .streams import StreamSlots

__all__ = ["ScopesOf", "a2a_routes"]

#: the scopes an ``Authorization`` header grants (``call``, ``submit``, ``admin``); raises
#: the gateway's own 401 error for a missing or unknown token
ScopesOf = Callable[[str | None], Collection[str]]


class _NamedContext(DefaultServerCallContextBuilder):
    """The SDK's call context, plus the agent name the URL addresses and the scopes the
    request's token was found to grant (None: no authentication)."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state[AGENT_NAME] = request.path_params.get("name", "")
        context.state[SCOPES] = getattr(request.state, "reach_scopes", None)
        context.state[CALLER] = getattr(request.state, "reach_caller", OPEN_CALLER)
        return context


def a2a_routes(
    client: Client,
    base_url: str = "",
    *,
    prefix: str = "/a2a",
    scopes_of: ScopesOf | None = None,
    task_wait: float = 30.0,
    cancel_wait: float = 10.0,
    max_timeout: float = 300.0,
    streams: StreamSlots | None = None,
) -> APIRouter:
    """The A2A endpoint as a FastAPI router (``app.include_router(a2a_routes(client))``).

    ``base_url`` is where clients reach the gateway (``https://gw.example``), written into
    the cards; empty: the URL each request came in on. ``scopes_of`` turns on bearer
    tokens: every request needs a valid one (the cards say so), a call needs ``call``, a
    durable task (submit, get, cancel, follow, list) ``submit``; ``admin`` may do all.
    None: no authentication. ``task_wait``, ``cancel_wait`` and ``max_timeout`` (the
    longest call timeout a message may ask for) and ``streams`` (the bound on open
    streams, shared with the gateway's): see ``ReachRequestHandler``.
    """
    handler = ReachRequestHandler(
        client,
        task_wait=task_wait,
        cancel_wait=cancel_wait,
        max_timeout=max_timeout,
        streams=streams,
    )
    [route] = create_jsonrpc_routes(
        handler, rpc_url="/{name}", context_builder=_NamedContext(), enable_v0_3_compat=True
    )
    dispatch: Callable[[Request], Awaitable[Response]] = route.endpoint
    router = APIRouter(prefix=prefix, tags=["A2A"])

    def granted(request: Request) -> Collection[str] | None:
        """The token's scopes; the gateway's 401 without a valid one."""
        if scopes_of is None:
            return None
        return scopes_of(request.headers.get("authorization"))

    def card(named: Named, request: Request) -> dict[str, Any]:
        base = base_url.rstrip("/") or str(request.base_url).rstrip("/")
        url = f"{base}{prefix}/{named.name}"
        return agent_card_to_dict(card_of(named, url, bearer=scopes_of is not None))

    @router.get("/", summary="The A2A agent cards of every agent name in the routing table")
    async def index(request: Request) -> JSONResponse:
        granted(request)
        names = fleet(await client.agents())
        return JSONResponse({"agents": [card(names[n], request) for n in sorted(names)]})

    @router.get(
        "/{name}/.well-known/agent-card.json",
        summary="The A2A agent card of agent name {name}: its capabilities as skills",
    )
    async def agent_card(name: str, request: Request) -> JSONResponse:
        granted(request)
        named = fleet(await client.agents()).get(name)
        if named is None:
            raise HTTPException(404, f"no agent named {name!r} in the routing table")
        return JSONResponse(card(named, request))

    async def rpc(name: str, request: Request) -> Response:
        """A2A JSON-RPC (SendMessage, SendStreamingMessage, GetTask, CancelTask,
        SubscribeToTask, ListTasks; and the v0.3 names message/send, tasks/get, ...)."""
        request.state.reach_scopes = granted(request)  # per method: ReachRequestHandler
        if scopes_of is not None:
            request.state.reach_caller = caller_id(request.headers.get("authorization"))
        return await dispatch(request)

    for path in ("/{name}", "/{name}/"):
        router.add_api_route(
            path,
            rpc,
            methods=["POST"],
            summary="A2A JSON-RPC endpoint of agent name {name}",
            include_in_schema=path == "/{name}",
        )
    return router
