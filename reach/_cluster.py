"""A JetStream cluster of nats-servers on loopback: tests, benches and ``reach up --cluster``.

Each node is a ``NatsServer`` with its own client port, cluster port, monitoring port, store
dir and ``server_name``, and a config whose ``cluster { name, listen, routes }`` block routes
to every node (itself included: the server ignores a route to itself). nats-server refuses a
JetStream cluster without routes, so the cluster ports are chosen before the nodes start
(a free port from the OS; a start that loses the port to another process is retried with new
ones). The cluster is ready when every running node's ``/healthz`` answers 200, which it does
only once JetStream has a meta leader and the node's streams are current.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Self

from ._server import NatsServer, config_with_store
from .errors import ConnectionFailed, ReachError

__all__ = ["NatsCluster"]

_POLL = 0.05  # seconds between looks at the nodes' /healthz
_STARTS = 3  # tries with fresh cluster ports when a node could not start


def _free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports the OS says are free now (held together, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _get(url: str) -> tuple[int, bytes]:
    """Status and body of a GET on the loopback monitoring port; (0, b"") if it failed."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except OSError:
        return 0, b""


_OWN_PORTS = re.compile(r"(?m)^(?:http|http_port|https|https_port|monitor_port)\s*[:=].*$")


class NatsCluster:
    """``n`` nats-servers on loopback forming one JetStream cluster, stopped by their PIDs.

    ``urls`` is the comma-separated list of client URLs that ``ReachSettings.nats_url``
    takes. ``port``/``monitor_port`` of -1 let each node pick free ports; a fixed ``port``
    gives the nodes ``port``, ``port + 1``, ... With ``config_file`` (the shipped
    ``nats-server.conf``, say) each node runs a copy with its own store and the cluster block.

    ``kill_node(i)`` / ``start_node(i)`` (and their ``a`` twins) SIGKILL one node and bring it
    back on the same ports and store, for failure tests. Sync methods block (fixtures, the
    CLI); the ``a`` ones poll with ``asyncio.sleep`` and never block the event loop.
    """

    def __init__(
        self,
        n: int = 3,
        *,
        name: str = "reach",
        host: str = "127.0.0.1",
        port: int = -1,
        monitor_port: int = -1,
        data_dir: str | Path | None = None,
        config_file: str | Path | None = None,
        binary: str = "",
    ) -> None:
        if n < 1:
            raise ValueError("a cluster needs at least one node")
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="reach-cluster-")
        self.data_dir = Path(data_dir) if data_dir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.name = name
        self.host = host
        self.config_file = config_file
        self.monitor_port = monitor_port
        #: server names, one per node: ``<name>-1`` ...
        self.names = [f"{name}-{i + 1}" for i in range(n)]
        self.nodes = [
            NatsServer(
                store_dir=self.data_dir / node / "jetstream",
                port=port if port < 0 else port + i,
                host=host,
                config_file=self.data_dir / node / "node.conf",
                binary=binary,
                log_file=self.data_dir / node / "nats-server.log",
            )
            for i, node in enumerate(self.names)
        ]
        #: the route (cluster) port of each node, chosen at the first start
        self.cluster_ports: list[int] = []

    # -- addresses --------------------------------------------------------------------

    @property
    def urls(self) -> str:
        """Client URLs of every node, comma-separated (what ``nats_url`` takes)."""
        return ",".join(node.url for node in self.nodes if node.url)

    @property
    def url(self) -> str:
        """Same as ``urls``, so a cluster stands where a ``NatsServer`` did."""
        return self.urls

    def node(self, server_name: str) -> NatsServer:
        """The node whose ``server_name`` this is (as stream infos and ``/jsz`` name it)."""
        return self.nodes[self.names.index(server_name)]

    # -- config -------------------------------------------------------------------------

    def _write_config(self, i: int) -> None:
        node_dir = self.data_dir / self.names[i]
        node_dir.mkdir(parents=True, exist_ok=True)
        if self.config_file:
            path = config_with_store(self.config_file, node_dir)
            # Ports are this cluster's own: a monitoring port in the base config (http,
            # http_port) would be taken by whichever node starts first.
            text = _OWN_PORTS.sub("", path.read_text())
        else:
            text = f'jetstream {{\n  store_dir: "{node_dir / "jetstream"}"\n}}\n'
        monitor = self.monitor_port if self.monitor_port < 0 else self.monitor_port + i
        routes = ", ".join(f"nats://{self.host}:{p}" for p in self.cluster_ports)
        text += (
            f"\n# written by reach for cluster {self.name!r}, node {i + 1}\n"
            f"server_name: {self.names[i]}\n"
            f"http: {self.host}:{monitor}\n"
            f"cluster {{\n"
            f"  name: {self.name}\n"
            f"  listen: {self.host}:{self.cluster_ports[i]}\n"
            f"  routes: [{routes}]\n"
            f"}}\n"
        )
        (node_dir / "node.conf").write_text(text)

    def _prepare(self, attempt: int) -> None:
        """Choose cluster ports (new ones on a retry) and write every node's config."""
        if not self.cluster_ports or attempt > 0:
            self.cluster_ports = _free_ports(self.host, len(self.nodes))
        for i in range(len(self.nodes)):
            self._write_config(i)

    # -- readiness ----------------------------------------------------------------------

    def _running(self) -> list[NatsServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def _healthy(self, every: bool = False) -> bool:
        """Every running node answers ``/healthz`` with 200 (meta leader known, current);
        with ``every``, all nodes must be running too (a node that died at start is not
        a healthy cluster)."""
        running = self._running()
        if every and len(running) != len(self.nodes):
            return False
        return bool(running) and all(
            n.monitor_url and _get(n.monitor_url + "/healthz")[0] == 200 for n in running
        )

    def _not_ready(self, timeout: float) -> ConnectionFailed:
        logs = ", ".join(str(n.log_file) for n in self.nodes)
        return ConnectionFailed(
            f"nats cluster {self.name!r} not healthy within {timeout}s (JetStream elects no "
            f"meta leader, or a node is behind); see {logs}"
        )

    def wait_ready(self, timeout: float = 30.0, *, every: bool = False) -> None:
        """Block until every running node (with ``every``: every node) is healthy."""
        deadline = time.monotonic() + timeout
        while not self._healthy(every):
            if time.monotonic() > deadline:
                raise self._not_ready(timeout)
            time.sleep(_POLL)

    async def await_ready(self, timeout: float = 30.0, *, every: bool = False) -> None:
        """``wait_ready`` for async code (the HTTP looks run in a thread)."""
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(self._healthy, every):
            if time.monotonic() > deadline:
                raise self._not_ready(timeout)
            await asyncio.sleep(_POLL)

    def jsz(self, i: int = 0) -> dict[str, Any]:
        """Node ``i``'s ``/jsz`` (JetStream state as that node sees it); {} if it is down."""
        status, body = _get(self.nodes[i].monitor_url + "/jsz")
        if status != 200:
            return {}
        doc: dict[str, Any] = json.loads(body)
        return doc

    def meta_leader(self) -> str:
        """Server name of the JetStream meta leader as the first running node sees it."""
        running = self._running()
        for i, node in enumerate(self.nodes):
            if node in running:
                leader = self.jsz(i).get("meta_cluster", {}).get("leader", "")
                if leader:
                    return str(leader)
        return ""

    # -- start and stop -----------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> Self:
        """Start every node and block until the cluster is healthy."""
        for attempt in range(_STARTS):
            self._prepare(attempt)
            try:
                for node in self.nodes:
                    node.start(timeout)
                break
            except ConnectionFailed:
                for node in self.nodes:
                    node.kill()
                if attempt == _STARTS - 1:
                    raise
        try:
            self.wait_ready(timeout, every=True)
        except ConnectionFailed:
            self.stop()  # nothing half-started outlives a failed start
            raise
        return self

    async def astart(self, timeout: float = 30.0) -> Self:
        """``start()`` for async code."""
        for attempt in range(_STARTS):
            self._prepare(attempt)
            try:
                for node in self.nodes:
                    await node.astart(timeout)
                break
            except ConnectionFailed:
                for node in self.nodes:
                    await node.akill()
                if attempt == _STARTS - 1:
                    raise
        try:
            await self.await_ready(timeout, every=True)
        except ConnectionFailed:
            await self.astop()
            raise
        return self

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` (by its PID): a crash, with no goodbye to its peers."""
        self.nodes[i].kill()

    async def akill_node(self, i: int) -> None:
        await self.nodes[i].akill()

    def start_node(self, i: int, timeout: float = 30.0) -> None:
        """Start node ``i`` again on its ports and store; block until the cluster is healthy."""
        self.nodes[i].start(timeout)
        self.wait_ready(timeout)

    async def astart_node(self, i: int, timeout: float = 30.0) -> None:
        await self.nodes[i].astart(timeout)
        await self.await_ready(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL if one lingers)."""
        for node in self.nodes:
            node.stop(timeout)

    async def astop(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(node.astop(timeout) for node in self.nodes))

    def close(self) -> None:
        """Stop, then remove the temporary dirs (a given ``data_dir`` is kept)."""
        errors: list[ReachError] = []
        for node in self.nodes:
            try:
                node.close()
            except ReachError as exc:  # one unkillable node must not leave the others running
                errors.append(exc)
        if self._tmp is not None:
            self._tmp.cleanup()
        if errors:
            raise errors[0]

    async def aclose(self) -> None:
        await self.astop()
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
