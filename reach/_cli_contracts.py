"""``reach asyncapi`` (the live fleet as an AsyncAPI 3.0 document) and ``reach mcp`` (the
live fleet as an MCP server, the ``mcp`` extra): the contracts of ``reach._contracts``."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from ._client import Client
from ._contracts.asyncapi import fleet_document
from ._contracts.catalogue import catalogue
from ._settings_errors import load_settings
from ._telemetry import configure_logging
from ._tokens import Tokens, TokenSettings
from .errors import ConfigurationError
from .settings import ReachSettings
from .wire import AgentRecord

if TYPE_CHECKING:
    from ._contracts.mcp_server import FleetServer

log = logging.getLogger("reach.mcp")

__all__ = ["add_contract_commands"]


async def _asyncapi(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name="reach-cli") as client:
        records = await client.agents()
        doc = fleet_document(
            records,
            subjects=client.subjects,
            url=client.url,
            names=args.capability,
            tags=args.tag,
        )
    _write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", args.output)
    if not doc["operations"]:
        print(f"warning: {_nothing(args, records)}; the document is empty", file=sys.stderr)
    elif args.output not in (None, "-"):
        print(f"# wrote {args.output}: {len(doc['operations'])} operations", file=sys.stderr)
    return 0


def _nothing(args: argparse.Namespace, records: Sequence[AgentRecord]) -> str:
    """Why a document is empty: the selection matches nothing, or nothing is served. Still
    rc 0: the empty document is a true answer, and scripts may read it."""
    served = len(catalogue(records).offers())
    fleet = (
        f"the fleet serves {served} capabilities, tasks and topics"
        if served
        else "the fleet serves nothing now"
    )
    chosen = [f"--capability {shlex.quote(g)}" for g in args.capability]
    chosen += [f"--tag {shlex.quote(t)}" for t in args.tag]
    if not chosen:
        return fleet
    return f"nothing matches {' '.join(chosen)} ({fleet}: `reach asyncapi` alone shows them)"


def _write(text: str, output: str | None) -> None:
    if output in (None, "-"):
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text)
    except OSError as exc:
        raise ConfigurationError(f"cannot write {output!r}: {exc.strerror or exc}") from None


def _check_settings(args: argparse.Namespace) -> None:
    """The HTTP server's tokens, read before anything starts: a bad one is a usage error."""
    if args.http:
        load_settings(TokenSettings)


async def _mcp(args: argparse.Namespace, settings: ReachSettings) -> int:
    try:
        from mcp.server.stdio import stdio_server

        from ._contracts.mcp_server import FleetServer
    except ImportError as exc:
        raise ConfigurationError(
            f"reach mcp needs the 'mcp' extra: pip install 'agent-reach-nats[mcp]' ({exc})"
        ) from None
    if not logging.getLogger().handlers:
        configure_logging(settings.log_format, settings.log_level)  # stderr: stdout is MCP's
    tokens = load_settings(TokenSettings) if args.http else None
    if tokens is not None:
        tokens.check_host(args.host)
    async with (
        Client(settings=settings, name="reach-mcp") as client,
        FleetServer(
            client,
            names=args.capability,
            tags=args.tag,
            timeout=args.timeout,
            task_wait=args.task_wait,
            version=__version__,
        ) as fleet,
    ):
        names = ", ".join(t.name for t in fleet.tools) or "none yet"
        if tokens is not None:
            return await _serve_http(fleet, args, tokens, names)
        log.info("mcp server on stdio; tools: %s", names)
        async with stdio_server() as (read, write):
            await fleet.server.run(read, write, fleet.server.create_initialization_options())
    return 0


async def _serve_http(
    fleet: FleetServer, args: argparse.Namespace, tokens: TokenSettings, names: str
) -> int:
    """Streamable HTTP at ``/mcp`` on uvicorn until SIGINT or SIGTERM."""
    import uvicorn

    from ._contracts.mcp_server import BearerAuth

    app = BearerAuth(fleet.server.streamable_http_app(host=args.host), Tokens(tokens.tokens))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        lifespan="on",
        log_config=None,  # our handlers print uvicorn's records
        access_log=False,
        server_header=False,
    )
    server = uvicorn.Server(config)
    sock = config.bind_socket()  # bound here, so the port (also with 0) is known
    host, port = sock.getsockname()[:2]
    auth = "no tokens (open)" if tokens.open else f"{len(tokens.tokens)} tokens"
    print(
        f"# mcp server on http://{host}:{port}/mcp, {auth}; tools: {names}",
        file=sys.stderr,
        flush=True,
    )
    await server.serve(sockets=[sock])
    return 0


def _selection(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--capability",
        action="append",
        default=[],
        metavar="GLOB",
        help=f"only names matching GLOB ({what}); repeat for more",
    )
    p.add_argument(
        "--tag",
        action="append",
        default=[],
        help="only instances with this tag; repeat: with every one of them",
    )


def add_contract_commands(
    sub: Any, with_url: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Add ``asyncapi`` and ``mcp`` to the ``reach`` parser's subcommands."""
    p = with_url(
        sub.add_parser("asyncapi", help="write an AsyncAPI 3.0 document of the live fleet (JSON)")
    )
    _selection(p, "capabilities, task capabilities and topic patterns")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="default: stdout")
    p.set_defaults(run=_asyncapi, is_async=True)

    p = with_url(
        sub.add_parser(
            "mcp",
            help="serve the live fleet as MCP tools, over stdio (default) or streamable HTTP",
        )
    )
    _selection(p, "capabilities and task capabilities")
    p.add_argument("--http", action="store_true", help="streamable HTTP at /mcp, not stdio")
    p.add_argument("--host", default="127.0.0.1", help="with --http (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="with --http (default 8765; 0: any)")
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds per call (default REACH_TIMEOUT_MS)"
    )
    p.add_argument(
        "--task-wait",
        type=float,
        default=300.0,
        help="seconds a task tool waits for the end before answering with the task id",
    )
    p.set_defaults(run=_mcp, is_async=True, check_settings=_check_settings)
