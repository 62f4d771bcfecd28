"""Worker processes on one port: ``reach gateway --workers N``.

A gateway call is Python work on one core; a machine with more cores serves more calls
with more processes. The supervisor binds one listening socket per worker, all on the
same port with ``SO_REUSEPORT`` (the kernel spreads new connections over them), and
starts each worker with its socket (``--listen-fd``). It keeps every socket open for its
own life, so connections that reach a worker's socket while that worker restarts wait
in its backlog instead of being refused.

Each worker also gets a pipe to say it is serving (``--ready-fd``) and the read end of a
lifeline (``--lifeline-fd``): end of file on it means the supervisor is gone, however it
went, and the worker stops, so none outlives it. Workers run in a session of their own:
Ctrl-C reaches the supervisor only, which stops each worker once, with SIGTERM.

A worker that fails before it serves (NATS out of reach, say) stops the whole command
with its exit code, as one process would. One that exits later is logged and started
again after a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence

from ._runtime import on_stop_signals
from .errors import ConfigurationError

__all__ = [
    "READY",
    "Supervisor",
    "WorkerFailed",
    "reuseport_sockets",
    "serve_fds",
    "watch_lifeline",
]

log = logging.getLogger("reach.gateway")

BACKOFF = 0.5  # seconds before the first restart of a worker; doubles up to BACKOFF_MAX
BACKOFF_MAX = 10.0
STEADY = 30.0  # a worker that ran this long restarts after BACKOFF again
READY = b"r"


class WorkerFailed(Exception):
    """A worker ended (or hung) before it served: the command fails with its code."""

    def __init__(self, index: int, code: int | None) -> None:
        super().__init__(f"worker {index} failed before serving (exit code {code})")
        self.index = index
        self.code = code


def reuseport_sockets(host: str, port: int, count: int, backlog: int) -> list[socket.socket]:
    """``count`` listening sockets on one port (port 0: the first one's, chosen by the OS)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigurationError("several gateway workers need SO_REUSEPORT (Linux, BSD)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(backlog)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc}") from None
    return sockets


class Supervisor:
    """Runs ``command(index)`` once per socket, for as long as the supervisor runs."""

    def __init__(
        self,
        command: Callable[[int], Sequence[str]],
        sockets: Sequence[socket.socket],
        *,
        grace: float,
        ready_timeout: float = 60.0,
    ) -> None:
        self.command = command
        self.sockets = list(sockets)
        self.grace = grace  # seconds a worker has to stop after SIGTERM, before SIGKILL
        self.ready_timeout = ready_timeout
        #: worker index -> the pid of its current process
        self.pids: dict[int, int] = {}
        #: workers that exited after serving, and were started again
        self.restarts = 0
        self._ready = 0
        self._lifeline = -1

    async def run(self, on_ready: Callable[[], None]) -> int:
        """Serve until SIGINT or SIGTERM (0), or until a worker fails to start (its code);
        ``on_ready`` is called once every worker serves."""
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[None] = loop.create_future()
        read_end, self._lifeline = os.pipe()
        failed: WorkerFailed | None = None
        try:
            with on_stop_signals(lambda _sig: _settle(stop)):
                async with asyncio.TaskGroup() as group:
                    slots = [
                        group.create_task(self._slot(i, read_end, on_ready), name=f"worker-{i}")
                        for i in range(len(self.sockets))
                    ]
                    await stop
                    for slot in slots:
                        slot.cancel()
        except* WorkerFailed as group:
            first = group.exceptions[0]
            assert isinstance(first, WorkerFailed)
            failed = first
        finally:
            os.close(read_end)
            os.close(self._lifeline)
            for sock in self.sockets:
                sock.close()
        if failed is not None:
            log.error("gateway %s", failed)
            return failed.code or 1
        return 0

    async def _slot(self, index: int, lifeline: int, on_ready: Callable[[], None]) -> None:
        """One worker for the supervisor's life: started, and started again when it exits."""
        loop = asyncio.get_running_loop()
        delay, first = BACKOFF, True
        while True:
            proc, ready = await self._spawn(index, lifeline)
            began = loop.time()
            try:
                serving = await self._await_ready(ready)
                if not serving:
                    await self._stop(proc)
                    if first:
                        raise WorkerFailed(index, proc.returncode)
                else:
                    if first:
                        self._ready += 1
                        if self._ready == len(self.sockets):
                            on_ready()
                    first = False
                code = await proc.wait()
            except BaseException:
                await self._stop(proc)
                raise
            finally:
                self.pids.pop(index, None)
            if loop.time() - began >= STEADY:
                delay = BACKOFF
            self.restarts += 1
            log.error(
                "gateway worker %d (pid %d) exited with code %s; starting it again in %.1f s",
                index,
                proc.pid,
                code,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _spawn(self, index: int, lifeline: int) -> tuple[asyncio.subprocess.Process, int]:
        sock = self.sockets[index].fileno()
        ready_read, ready_write = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command(index),
                *serve_fds(sock, ready_write, lifeline),
                pass_fds=(sock, ready_write, lifeline),
                start_new_session=True,
            )
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            os.close(ready_write)
        self.pids[index] = proc.pid
        return proc, ready_read

    async def _await_ready(self, fd: int) -> bool:
        """True once the worker says it serves; False if it exits or hangs first."""
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _settle, readable)
        try:
            async with asyncio.timeout(self.ready_timeout):
                await readable
            return os.read(fd, 1) == READY  # b"": it exited without a word
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)
            os.close(fd)

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.grace + 5):
                await proc.wait()
                return
        except TimeoutError:
            log.error("gateway worker pid %d ignored SIGTERM; killed", proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def serve_fds(sock: int, ready: int, lifeline: int) -> list[str]:
    """The worker's side of the handshake, as command-line options."""
    return ["--listen-fd", str(sock), "--ready-fd", str(ready), "--lifeline-fd", str(lifeline)]


def watch_lifeline(fd: int, on_gone: Callable[[], None]) -> Callable[[], None]:
    """Call ``on_gone`` once the supervisor's end of the lifeline closes; returns the
    function that stops watching."""
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(fd, 1)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(fd)
            on_gone()

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)

    def unwatch() -> None:
        loop.remove_reader(fd)

    return unwatch


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
