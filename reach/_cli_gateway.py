"""``reach gateway``: the HTTP gateway on uvicorn (uvloop and httptools when installed)
until SIGINT or SIGTERM.

One ``Client`` serves every request: connected before the server listens (so a NATS
that cannot be reached is a plain ``error:`` line, not a traceback), closed after the
server has stopped taking requests and finished (or cut, past the grace period) the ones
in flight. FastAPI and uvicorn are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ._client import Client
from ._nats import redact
from ._runtime import on_stop_signals
from ._settings_errors import load_settings
from ._supervisor import (
    READY,
    Supervisor,
    bind_port,
    bind_reuseport,
    reuseport_sockets,
    watch_lifeline,
)
from ._telemetry import configure_logging
from .errors import ConfigurationError
from .settings import ReachSettings

__all__ = ["add_gateway_commands"]

if TYPE_CHECKING:
    from ._gateway.settings import GatewaySettings

log = logging.getLogger("reach.gateway")


async def _gateway(args: argparse.Namespace, settings: ReachSettings) -> int:
    if args.lifeline_fd is None:
        return await _serve(args, settings, [])
    # A worker: it leaves when its supervisor does, serving or still starting.
    main = asyncio.current_task()
    assert main is not None
    servers: list[Any] = []
    lost = False

    def gone() -> None:
        nonlocal lost
        lost = True
        if servers:
            servers[0].handle_exit(signal.SIGTERM, None)
        else:
            main.cancel()

    unwatch = watch_lifeline(args.lifeline_fd, gone)
    try:
        return await _serve(args, settings, servers)
    except asyncio.CancelledError:
        if not lost:
            raise
        log.error("gateway worker: the supervisor is gone; leaving before serving")
        return 1
    finally:
        unwatch()


async def _serve(args: argparse.Namespace, settings: ReachSettings, servers: list[Any]) -> int:
    """The gateway in this process (``servers`` gets its uvicorn server once made)."""
    try:
        import uvicorn

        from ._gateway import EdgeDeps, GatewaySettings, build_edge
    except ImportError as exc:
        raise ConfigurationError(
            f"the gateway needs the 'edge' extra: pip install 'agent-reach-nats[edge]' ({exc})"
        ) from None
    if not logging.getLogger().handlers:
        configure_logging(settings.log_format, settings.log_level)
    gateway = load_settings(GatewaySettings, **_overrides(args))
    worker = args.listen_fd is not None
    if gateway.open and not worker:
        log.warning("no REACH_GATEWAY_TOKENS: every caller of %s may do everything", gateway.host)
    if gateway.workers > 1 and not worker:
        return await _supervise(args, settings, gateway)

    edge: Any = None
    grace = math.ceil(gateway.shutdown_grace)  # uvicorn's is whole seconds

    class Server(uvicorn.Server):
        """Stops on SIGINT/SIGTERM through the event loop, and does not raise the signal
        again after a graceful stop (uvicorn's default), so the command exits 0; ends the
        status page's event streams first (uvicorn waits for open responses). A second
        Ctrl-C while it drains ends the process at once (status 130)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if edge is not None:
                edge.shutdown()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # A worker's supervisor says it for every worker: the worker says nothing.
            draining = None if worker else f"finishing in-flight requests for up to {grace}s"
            with on_stop_signals(lambda sig: self.handle_exit(sig, None), draining=draining):
                yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if args.ready_fd is not None and self.started and not self.should_exit:
                with contextlib.suppress(BrokenPipeError):  # the supervisor left meanwhile
                    os.write(args.ready_fd, READY)  # to the supervisor: this worker serves

    async with Client(settings=settings, name="reach-gateway") as client:
        metrics = None
        if args.metrics_port is not None or settings.metrics_port is not None:
            port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
            metrics = await client.telemetry.serve(port or 0, settings.metrics_host)
        try:
            edge = build_edge(EdgeDeps(client, gateway))
            config = uvicorn.Config(
                edge.app,
                host=gateway.host,
                port=gateway.port,
                lifespan="on",
                http="httptools",  # uvicorn's own protocol, as configured in public
                log_config=None,  # our handlers (configure_logging) print uvicorn's records
                access_log=args.access_log,
                timeout_graceful_shutdown=grace,
                server_header=False,
                proxy_headers=False,  # client addresses are not used; one layer less per request
            )
            server = Server(config)
            servers.append(server)
            if worker:
                sock = socket.socket(fileno=args.listen_fd)  # bound; uvicorn listens on it
            else:
                sock = bind_port(gateway.host, gateway.port)  # the port (also 0) known here
                sock.listen(config.backlog)  # connections queue from now on: say so below
                host, port = sock.getsockname()[:2]
                extra = f", metrics {metrics.url}/metrics" if metrics is not None else ""
                _banner(host, port, client.url, gateway, extra)
            # Everything built so far lives as long as the process: keep the collector from
            # scanning it again and again (full collections of FastAPI's and pydantic's
            # objects showed as tens of milliseconds in the latency tail)
            gc.collect()
            gc.freeze()
            await server.serve(sockets=[sock])
        finally:
            if metrics is not None:
                await metrics.close()
    return 0


def _banner(host: str, port: int, url: str, gateway: GatewaySettings, extra: str = "") -> None:
    print(
        f"# gateway on http://{host}:{port} (OpenAPI at /docs), NATS {redact(url)}"
        + (", no tokens (open)" if gateway.open else f", {len(gateway.tokens)} tokens")
        + extra,
        file=sys.stderr,
        flush=True,
    )


async def _supervise(
    args: argparse.Namespace, settings: ReachSettings, gateway: GatewaySettings
) -> int:
    """``--workers N``: N gateway processes on one port (``reach._supervisor``)."""
    sockets = reuseport_sockets(gateway.host, gateway.port, gateway.workers)
    host, port = sockets[0].getsockname()[:2]

    def rebind() -> socket.socket:
        return bind_reuseport(gateway.host, port)  # the host as given (an IPv6 scope too)

    metrics_port = args.metrics_port if args.metrics_port is not None else settings.metrics_port

    def command(index: int) -> list[str]:
        return _worker_argv(args, gateway.host, port, metrics_port, index)

    extra = f", {gateway.workers} workers"
    if metrics_port:
        extra += f", metrics on ports {metrics_port}-{metrics_port + gateway.workers - 1}"
    supervisor = Supervisor(command, sockets, rebind, grace=gateway.shutdown_grace)
    return await supervisor.run(lambda: _banner(host, port, settings.nats_url, gateway, extra))


def _worker_argv(
    args: argparse.Namespace, host: str, port: int, metrics_port: int | None, index: int
) -> list[str]:
    """Worker ``index``'s command line: the supervisor's host and bound port (its Host
    guard and banner go by them), settings file, URL, access log, and a metrics port of its
    own."""
    argv = [sys.executable, "-m", "reach.cli"]
    if getattr(args, "settings_file", None):  # reach --config FILE gateway
        argv += ["--config", args.settings_file]
    argv += ["gateway", "--workers", "1"]
    argv += ["--host", host, "--port", str(port)]
    if args.url:
        argv += ["--url", args.url]
    if args.access_log:
        argv.append("--access-log")
    if metrics_port is not None:  # one port each: P, P+1, ... (0: any)
        argv += ["--metrics-port", str(metrics_port + index if metrics_port else 0)]
    return argv


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The gateway settings given as options (over ``REACH_GATEWAY_*``)."""
    given = (("host", args.host), ("port", args.port), ("workers", args.workers))
    return {k: v for k, v in given if v is not None}


def _check_settings(args: argparse.Namespace) -> None:
    """The gateway's settings, read before anything starts: a bad one is a usage error."""
    try:
        from ._gateway.settings import GatewaySettings
    except ImportError:
        return  # the command says what to install
    load_settings(GatewaySettings, **_overrides(args))


def add_gateway_commands(
    sub: Any, with_url: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Add ``gateway`` to the ``reach`` parser's subcommands."""
    p = with_url(
        sub.add_parser(
            "gateway",
            help="serve the HTTP gateway (OpenAPI at /docs) until Ctrl-C; REACH_GATEWAY_*",
        )
    )
    p.add_argument("--host", default=None, help="default $REACH_GATEWAY_HOST or 127.0.0.1")
    p.add_argument(
        "--port", type=int, default=None, help="default $REACH_GATEWAY_PORT or 8080; 0: any"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve /metrics and /healthz on this port (default REACH_METRICS_PORT)",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes serving on the port, one per core to use (default"
        " $REACH_GATEWAY_WORKERS or 1)",
    )
    for fd in ("--listen-fd", "--ready-fd", "--lifeline-fd"):  # from the supervisor only
        p.add_argument(fd, type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(run=_gateway, is_async=True, check_settings=_check_settings)
