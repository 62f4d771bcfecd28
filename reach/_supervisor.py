"""Worker processes on one port: ``reach gateway --workers N``.

A gateway call is Python work on one core; a machine with more cores serves more calls
with more processes. The supervisor binds one listening socket per worker, all on the
same port with ``SO_REUSEPORT``, hands each worker its socket (``--listen-fd``) and
closes its own copy. The worker's server listens on it once it is ready to serve, and
the kernel spreads new connections over the sockets listening: never to a worker that is
still starting, or gone (they would wait there, unanswered). A restarted worker gets a
new socket.

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
import errno
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
    "bind_port",
    "bind_reuseport",
    "reuseport_sockets",
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
        why = f"exit code {code}" if code is not None else "no word from it in time"
        super().__init__(f"worker {index} failed before serving ({why})")
        self.index = index
        self.code = code

    @property
    def exit_status(self) -> int:
        """What the command exits with: the worker's code, 128+N for its signal N."""
        if self.code is None or self.code == 0:
            return 1
        return 128 - self.code if self.code < 0 else self.code


def reuseport_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets bound to one port, not yet listening (port 0: the first one's,
    chosen by the OS).
    A port that something already listens on is refused, as it is for one process (with
    ``SO_REUSEPORT`` alone a second gateway would quietly take half the connections)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigurationError("several gateway workers need SO_REUSEPORT (Linux, BSD)")
    if port:
        bind_port(host, port).close()  # the probe: taken, it says so as for one process
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(bind_reuseport(host, port))
            port = sockets[0].getsockname()[1]
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise _refusal(host, port, exc) from None
    return sockets


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), for one server to listen on
    (``reach gateway``, ``reach mcp --http``); a port it cannot have is a one-line
    ``ConfigurationError`` that says what to do, never a server's own log line."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise _refusal(host, port, exc) from None
    except BaseException:
        sock.close()
        raise
    return sock


def _refusal(host: str, port: int, exc: OSError) -> ConfigurationError:
    if exc.errno == errno.EADDRINUSE:
        return ConfigurationError(
            f"cannot listen on {host}:{port}: the port is taken (another server runs"
            " there?): stop it, or pass --port 0 for a free port"
        )
    return ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}")


def bind_reuseport(host: str, port: int) -> socket.socket:
    """A socket bound to the port beside others; its worker's server listens on it."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Supervisor:
    """Runs ``command(index)`` once per socket, for as long as the supervisor runs;
    ``rebind()`` makes the socket of a worker started again."""

    def __init__(
        self,
        command: Callable[[int], Sequence[str]],
        sockets: Sequence[socket.socket],
        rebind: Callable[[], socket.socket],
        *,
        grace: float,
        ready_timeout: float = 60.0,
    ) -> None:
        self.command = command
        self.count = len(sockets)
        self._sockets: dict[int, socket.socket] = dict(enumerate(sockets))
        self.rebind = rebind
        self.grace = grace  # seconds a worker has to stop after SIGTERM, before SIGKILL
        self.ready_timeout = ready_timeout
        self._ready = 0
        self._procs: set[asyncio.subprocess.Process] = set()  # workers started, not reaped

    async def run(self, on_ready: Callable[[], None]) -> int:
        """Serve until SIGINT or SIGTERM (0), or until a worker fails to start (its code);
        ``on_ready`` is called once every worker serves."""
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[None] = loop.create_future()
        read_end, write_end = os.pipe()  # the lifeline: its end of file is ours
        failed: WorkerFailed | None = None
        try:
            draining = f"workers finish in-flight requests for up to {self.grace:g}s"
            with on_stop_signals(lambda _sig: _settle(stop), draining=draining, abandon=self.kill):
                async with asyncio.TaskGroup() as group:
                    slots = [
                        group.create_task(self._slot(i, read_end, on_ready), name=f"worker-{i}")
                        for i in range(self.count)
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
            os.close(write_end)
            for sock in self._sockets.values():  # not handed over (a start that failed)
                sock.close()
        if failed is not None:
            log.error("gateway %s", failed)
            return failed.exit_status
        return 0

    def kill(self) -> None:
        """SIGKILL every worker (Ctrl-C again: the supervisor ends at once, and they too)."""
        for proc in self._procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def _slot(self, index: int, lifeline: int, on_ready: Callable[[], None]) -> None:
        """One worker for the supervisor's life: started, and started again when it exits."""
        loop = asyncio.get_running_loop()
        delay, first = BACKOFF, True
        while True:
            spawned = await self._spawn(index, lifeline)
            if spawned is None:  # no socket or process for it now: try again later
                if first:
                    raise WorkerFailed(index, 1)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            proc, ready = spawned
            began = loop.time()
            self._procs.add(proc)
            try:
                serving = await self._await_ready(ready)
                if not serving:
                    await self._stop(proc)
                    if first:
                        raise WorkerFailed(index, None if serving is None else proc.returncode)
                else:
                    if first:
                        self._ready += 1
                        if self._ready == self.count:
                            on_ready()
                    first = False
                code = await proc.wait()
            except BaseException:
                await self._stop(proc)
                raise
            finally:
                if proc.returncode is not None:
                    self._procs.discard(proc)
            if loop.time() - began >= STEADY:
                delay = BACKOFF
            log.error(
                "gateway worker %d (pid %d) exited with code %s; starting it again in %.1f s",
                index,
                proc.pid,
                code,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _spawn(
        self, index: int, lifeline: int
    ) -> tuple[asyncio.subprocess.Process, int] | None:
        """Start worker ``index`` with its socket, which only the worker keeps open; None
        (logged) when the system refuses a socket, a pipe or a process for it."""
        sock = self._sockets.pop(index, None)
        try:
            if sock is None:
                sock = self.rebind()
            ready_read, ready_write = os.pipe()
        except OSError as exc:
            if sock is not None:
                sock.close()
            log.error("gateway worker %d: cannot start it: %s", index, exc)
            return None
        try:
            fd = sock.fileno()
            proc = await asyncio.create_subprocess_exec(
                *self.command(index),
                *_serve_fds(fd, ready_write, lifeline),
                pass_fds=(fd, ready_write, lifeline),
                start_new_session=True,
            )
        except OSError as exc:
            os.close(ready_read)
            log.error("gateway worker %d: cannot start it: %s", index, exc)
            return None
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            os.close(ready_write)
            sock.close()
        return proc, ready_read

    async def _await_ready(self, fd: int) -> bool | None:
        """True once the worker says it serves; False if it exits first, None if it says
        nothing within ``ready_timeout``."""
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _settle, readable)
        try:
            async with asyncio.timeout(self.ready_timeout):
                await readable
            return os.read(fd, 1) == READY  # b"": it exited without a word
        except TimeoutError:
            return None
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


def _serve_fds(sock: int, ready: int, lifeline: int) -> list[str]:
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
