"""``reach up``: the wheel's nats-server (or ``--cluster N`` of them, one JetStream cluster on
loopback) and a registry, in the foreground until Ctrl-C or SIGTERM; everything it started
is stopped by PID, and a second Ctrl-C while they stop kills them at once.

One ``reach up`` per data dir and port: a lock file in the data dir and a look at the client
ports refuse a second one before its nats-server starts (a nats-server whose port is taken
has opened its JetStream store, and written to its log, by the time it finds out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

import nats.errors

from ._client import Client
from ._cluster import NatsCluster
from ._runtime import Stopping, run_async
from ._server import SHIPPED_CONFIG, NatsServer, config_with_store
from .errors import ConfigurationError
from .settings import ReachSettings

__all__ = ["up"]

_MAX_REPLICAS = 5  # JetStream's ceiling, and ReachSettings.replicas'
_STOP_WAIT = 10.0  # seconds the registry, then each nats-server, has to stop before SIGKILL
LOCK_FILE = "reach-up.lock"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def _wait_for_registry(settings: ReachSettings, timeout: float = 15.0) -> None:
    """So that the URL is printed only once a registry answers."""
    async with Client(settings=settings, name="reach-up") as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                await client.nc.request(client.subjects.registry("list"), b"{}", timeout=1)
                return
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
            except nats.errors.TimeoutError:
                continue
    _say("# registry did not answer yet; agents will register when it does")


def _start_registry(url: str, replicas: int, settings_file: str = "") -> subprocess.Popen[bytes]:
    env = {**os.environ, "REACH_REPLICAS": str(replicas)}
    if settings_file:  # `reach --config FILE up`: the registry reads the same file
        env["REACH_CONFIG"] = settings_file
    return subprocess.Popen(
        [sys.executable, "-m", "reach.cli", "registry", "--url", url],
        stdin=subprocess.DEVNULL,
        env=env,
    )


def _stop_registry(registry: subprocess.Popen[bytes] | None) -> None:
    if registry is None or registry.poll() is not None:
        return
    registry.terminate()  # by PID
    try:
        registry.wait(_STOP_WAIT)
    except subprocess.TimeoutExpired:
        registry.kill()
        registry.wait()


def _config(args: argparse.Namespace) -> Path:
    """``--config``, else ``./nats-server.conf`` when there is one, else the shipped one."""
    if args.config is not None:
        config = Path(args.config)
        if not config.is_file():
            raise ConfigurationError(
                f"--config {args.config}: no such file; give the path of a nats-server config"
            )
        return config
    local = Path("nats-server.conf")
    return local if local.is_file() else SHIPPED_CONFIG


def _lock(data_dir: Path) -> TextIO | None:
    """Hold ``data_dir``'s lock file (this process's PID in it) until the process ends;
    ConfigurationError when another ``reach up`` holds it. None where there is no flock."""
    if sys.platform == "win32":
        return None
    import fcntl

    held = (data_dir / LOCK_FILE).open("a+")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.seek(0)
        pid = held.read().strip() or "?"
        held.close()
        raise ConfigurationError(
            f"{data_dir} is in use by another 'reach up' (pid {pid}): stop it, or give this"
            " one a --data-dir of its own"
        ) from None
    held.truncate(0)
    held.write(f"{os.getpid()}\n")
    held.flush()
    return held


def _port_taken(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (a bind as nats-server's would fail)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server's
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _check_ports(nodes: list[NatsServer]) -> None:
    """ConfigurationError naming the first fixed client port that is taken."""
    for node in nodes:
        if node.port > 0 and _port_taken(node.host, node.port):
            raise ConfigurationError(
                f"port {node.port} on {node.host} is taken (another nats-server or 'reach up'"
                " runs?): stop it, or pass --port N (--port -1 picks a free port)"
            )


def up(args: argparse.Namespace, settings: ReachSettings) -> int:
    """Run the server(s) and a registry until Ctrl-C or SIGTERM; 1 if a server died."""
    stop = False
    nodes: list[NatsServer] = []
    registry: subprocess.Popen[bytes] | None = None

    def stopped(sig: signal.Signals) -> None:
        nonlocal stop
        stop = True

    def kill_all() -> None:  # Ctrl-C again: nothing it started outlives it
        for proc in [registry, *(node.proc for node in nodes)]:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    what = "the registry and the nats-server(s) stop"
    stopping = Stopping(
        stopped, draining=f"{what}, each given up to {_STOP_WAIT:g}s", abandon=kill_all
    )

    def on_signal(signum: int, frame: object) -> None:
        stopping(signal.Signals(signum))

    config = _config(args)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    servers: NatsCluster | NatsServer
    if args.cluster:
        servers = NatsCluster(
            args.cluster,
            port=args.port,
            monitor_port=-1 if args.monitor_port is None else args.monitor_port,
            data_dir=data_dir,
            config_file=config,
        )
        nodes, replicas = servers.nodes, min(args.cluster, _MAX_REPLICAS)
    else:
        # --port -1 (a free port) frees the monitoring port too: a fixed 8222 would collide
        # with the reach up it is meant to run beside
        monitor = -1 if args.monitor_port is None and args.port == -1 else args.monitor_port
        servers = NatsServer(
            store_dir=data_dir / "jetstream",
            port=args.port,
            config_file=config_with_store(config, data_dir),
            log_file=data_dir / "nats-server.log",
            extra_args=("-m", str(monitor)) if monitor is not None else (),
        )
        nodes, replicas = [servers], settings.replicas
    lock = _lock(data_dir)
    _check_ports(nodes)
    try:
        url = servers.start().url
        if not args.no_registry:
            registry = _start_registry(url, replicas, settings.config)
            reach = settings.model_copy(update={"nats_url": url, "replicas": replicas})
            run_async(_wait_for_registry(reach))
        print(url, flush=True)
        if isinstance(servers, NatsCluster):
            pids = ", ".join(str(n.pid) for n in nodes)
            _say(f"# {len(nodes)} nats-servers (pids {pids}), one JetStream cluster in {data_dir}")
            _say(f"# export REACH_NATS_URL={url} REACH_REPLICAS={replicas}")
        else:
            _say(
                f"# nats-server pid {servers.pid}, JetStream in {data_dir}, log {servers.log_file}"
            )
            _say(f"# export REACH_NATS_URL={url}")
        monitoring = ", ".join(n.monitor_url for n in nodes if n.monitor_url) or "off"
        _say(f"# config {config.resolve()}, monitoring {monitoring}")
        if registry is not None:
            _say(f"# registry pid {registry.pid} (REACH_REPLICAS={replicas})")
        while not stop:
            for node in nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    _say(f"nats-server exited with {node.proc.returncode}; see {node.log_file}")
                    return 1
            time.sleep(0.2)
    finally:
        _stop_registry(registry)
        servers.close()
        if lock is not None:
            lock.close()
    _say("# stopped")
    return 0
