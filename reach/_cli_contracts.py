"""``reach asyncapi`` (the live fleet as an AsyncAPI 3.0 document) and ``reach mcp`` (the
live fleet as an MCP server, the ``mcp`` extra): the contracts of ``reach._contracts``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import shlex
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from ._client import Client
from ._contracts.asyncapi import fleet_document
from ._contracts.catalogue import catalogue, chosen
from ._runtime import exit_now, on_stop_signals
from ._settings_errors import load_settings
from ._supervisor import bind_port
from ._telemetry import configure_logging
from ._tokens import Tokens, TokenSettings
from .errors import ConfigurationError
from .settings import ReachSettings
from .wire import AgentRecord

if TYPE_CHECKING:
    from ._contracts.mcp_server import FleetServer

log = logging.getLogger("reach.mcp")

__all__ = ["add_contract_commands"]

#: seconds a stopping ``reach mcp`` gives what is in flight (then it ends all the same)
_STOP_GRACE = 2.0


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
    # bound first: a port that is taken is one line, before anything else is started
    sock = bind_port(args.host, args.port) if tokens is not None else None
    try:
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
            _say_unmatched(args, [t.name for t in fleet.tools])
            names = ", ".join(t.name for t in fleet.tools) or "none yet"
            if tokens is not None and sock is not None:
                return await _serve_http(fleet, args, tokens, names, sock)
            return await _serve_stdio(fleet, names)
    finally:
        if sock is not None:
            sock.close()


def _say_unmatched(args: argparse.Namespace, served: list[str]) -> None:
    """One line when the selection takes nothing served now: a glob that matches no tool
    (a typo?), or tags no instance of what is chosen has. It serves all the same: the
    fleet changes."""
    parts = [
        f"--capability '{g}'" for g in args.capability if not any(chosen(n, (g,)) for n in served)
    ]
    if not served:
        parts += [f"--tag '{t}'" for t in args.tag]
    if parts:
        print(
            f"# nothing served now matches {' '.join(parts)}: serving all the same (the"
            " tools follow the fleet)",
            file=sys.stderr,
            flush=True,
        )


def _stopped(sig: signal.Signals) -> int:
    """Say that a signal stopped the server; its exit status."""
    print(f"# mcp server stopped ({sig.name})", file=sys.stderr, flush=True)
    return 128 + sig


async def _serve_stdio(fleet: FleetServer, names: str) -> int:
    """MCP over stdin and stdout until stdin ends (0), or until SIGINT or SIGTERM (one
    line; 128 + the signal). The SDK reads stdin in a thread that no cancellation reaches:
    if it still holds the server ``_STOP_GRACE`` seconds after the signal, the process
    ends there (a second Ctrl-C ends it at once)."""
    from mcp.server.stdio import stdio_server

    async def serve() -> None:
        async with stdio_server() as (read, write):
            await fleet.server.run(read, write, fleet.server.create_initialization_options())

    loop = asyncio.get_running_loop()
    serving = loop.create_task(serve(), name="mcp over stdio")
    stopped: asyncio.Future[signal.Signals] = loop.create_future()

    def stop(sig: signal.Signals) -> None:
        if not stopped.done():  # (not when stdin ended first)
            stopped.set_result(sig)
            serving.cancel()

    with on_stop_signals(stop):
        log.info("mcp server on stdio; tools: %s", names)  # Ctrl-C is heard from here
        try:
            either: set[asyncio.Future[Any]] = {serving, stopped}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            serving.cancel()  # we were cancelled ourselves: it ends with us, within a bound
            await asyncio.wait({serving}, timeout=_STOP_GRACE)
            raise
        serving.cancel()
        if not stopped.done():
            stopped.cancel()
            await serving  # stdin ended: its error, if it failed
            return 0
        code = _stopped(stopped.result())
        await asyncio.wait({serving}, timeout=_STOP_GRACE)
        if not serving.done():
            exit_now(code)
        with contextlib.suppress(asyncio.CancelledError):
            serving.result()  # an error on the way out, if any
    return code


async def _serve_http(
    fleet: FleetServer,
    args: argparse.Namespace,
    tokens: TokenSettings,
    names: str,
    sock: socket.socket,
) -> int:
    """Streamable HTTP at ``/mcp`` on uvicorn, on ``sock``, until SIGINT or SIGTERM (one
    line; 128 + the signal)."""
    import uvicorn

    stopped: list[signal.Signals] = []

    class Server(uvicorn.Server):
        """Stops on SIGINT/SIGTERM through the event loop, ending the MCP requests in flight
        first (uvicorn waits for open responses, and a session's event stream never ends
        by itself), and does not raise the signal again after (uvicorn's default: a
        traceback). A second Ctrl-C ends the process at once (130)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            fleet.stop_requests()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            def stop(sig: signal.Signals) -> None:
                stopped.append(sig)
                self.handle_exit(sig, None)

            with on_stop_signals(stop):
                yield

    config = uvicorn.Config(
        fleet.http_app(host=args.host, tokens=Tokens(tokens.tokens)),
        host=args.host,
        port=args.port,
        lifespan="on",
        log_config=None,  # our handlers print uvicorn's records
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=math.ceil(_STOP_GRACE),
    )
    host, port = sock.getsockname()[:2]
    auth = "no tokens (open)" if tokens.open else f"{len(tokens.tokens)} tokens"
    print(
        f"# mcp server on http://{host}:{port}/mcp, {auth}; tools: {names}",
        file=sys.stderr,
        flush=True,
    )
    await Server(config).serve(sockets=[sock])
    return _stopped(stopped[0]) if stopped else 0


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
