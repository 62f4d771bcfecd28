"""``reach gateway --workers N``: N processes on one port behind a supervisor, as
processes on a real nats-server (``reach._supervisor``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from reach import ReachSettings
from reach._supervisor import WorkerFailed
from reach.testing import eventually

from .gateway_kit import echo_agent
from .test_gateway_http import start_gateway


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux /proc); none once it is gone."""
    found = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found |= {int(c) for c in (task / "children").read_text().split()}
    except (FileNotFoundError, ProcessLookupError):
        return set()
    return {c for c in found if alive(c)}


def listening(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on ``port`` (Linux /proc/net)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def sockets_of(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped as it was read
        return False
    return state != "Z"  # a zombie has exited


def env_of(settings: ReachSettings) -> dict[str, str]:
    return {
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        "REACH_GATEWAY_SHUTDOWN_GRACE": "1",
    }


@contextlib.asynccontextmanager
async def supervised(
    settings: ReachSettings, workers: int = 2
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, list[str]]]:
    """The command with ``workers`` workers: (its process, its URL, its stderr so far)."""
    proc = await start_gateway("--port", "0", "--workers", str(workers), env=env_of(settings))
    assert proc.stderr is not None
    lines: list[str] = []
    seen: set[int] = set()  # every worker pid: a failed test's leftovers are killed

    async def read_on() -> None:
        assert proc.stderr is not None
        while line := (await proc.stderr.readline()).decode():
            lines.append(line)
            if proc.returncode is None:
                seen.update(children(proc.pid))

    reader = asyncio.create_task(read_on())
    try:
        await eventually(lambda: any(x.startswith("# gateway on") for x in lines), timeout=60)
        line = next(x for x in lines if x.startswith("# gateway on"))
        assert f"{workers} workers" in line
        seen.update(children(proc.pid))
        yield proc, line.split()[3], lines
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await eventually(lambda: proc.returncode is not None, timeout=60)
    finally:
        if proc.returncode is None:
            seen.update(children(proc.pid))
            proc.kill()
        for pid in seen:
            if alive(pid):  # they would hold the stderr pipe open
                os.kill(pid, signal.SIGKILL)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        async with asyncio.timeout(60):
            await proc.wait()


async def pids_answering(url: str, calls: int) -> set[int]:
    """The processes that answered ``calls`` requests, each on a new connection."""
    pids = set()
    for _ in range(calls):
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.get("/healthz")
            assert r.status_code == 200, r.text
            pids.add(r.json()["pid"])
    return pids


async def test_every_worker_serves_calls_on_the_one_port(reach_settings: ReachSettings):
    async with (
        echo_agent(reach_settings, "echo-1"),
        supervised(reach_settings, workers=2) as (proc, url, _),
    ):
        workers = children(proc.pid)
        assert len(workers) == 2
        # the kernel spreads new connections over the workers' sockets
        assert await pids_answering(url, 40) == workers
        async with httpx.AsyncClient(base_url=url) as http:
            for n in range(10):
                r = await http.post("/v1/capabilities/demo.echo", json={"n": n})
                assert (r.status_code, r.json()["result"]["echo"]) == (200, {"n": n})
    assert proc.returncode == 0
    assert not any(alive(pid) for pid in workers)  # SIGTERM stopped them all


async def test_each_socket_is_held_by_its_worker_alone(reach_settings: ReachSettings):
    """The kernel sends connections to every socket listening on the port: one held by
    the supervisor too would keep taking them while its worker is down or stopping."""
    async with supervised(reach_settings, workers=2) as (proc, url, _):
        port = int(url.rsplit(":", 1)[1])
        workers = children(proc.pid)
        ports = listening(port)
        assert len(ports) == 2
        assert not ports & sockets_of(proc.pid)
        assert all(len(ports & sockets_of(pid)) == 1 for pid in workers)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: len(children(proc.pid)) == 2 and victim not in children(proc.pid))
        # the new worker listens on a socket of its own once it serves (the supervisor
        # holds none that listens), and the dead one's is gone
        await eventually(lambda: len(listening(port)) == 2)
        assert not listening(port) & sockets_of(proc.pid)
        (new,) = children(proc.pid) - workers
        assert len(listening(port) & sockets_of(new)) == 1


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_port_in_use_is_refused(reach_settings: ReachSettings, workers: str):
    """One line that says what to do, status 1: with one process as with workers (the same
    refusal as ``reach mcp --http``'s)."""
    with socket.socket() as taken:  # as another gateway's workers would: SO_REUSEPORT
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await start_gateway(
            "--port", str(port), "--workers", workers, env=env_of(reach_settings)
        )
        try:
            async with asyncio.timeout(60):
                _, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # it started after all: take it and its workers down
                for pid in children(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                proc.kill()
                await proc.wait()
    assert proc.returncode == 1
    assert err.decode().splitlines()[-1] == (
        f"error: bad_request: cannot listen on 127.0.0.1:{port}: the port is taken (another"
        " server runs there?): stop it, or pass --port 0 for a free port"
    )


def test_the_exit_status_of_a_worker_that_failed():
    assert WorkerFailed(0, 1).exit_status == 1
    assert WorkerFailed(0, 3).exit_status == 3
    assert WorkerFailed(0, -signal.SIGKILL).exit_status == 128 + signal.SIGKILL
    assert WorkerFailed(0, None).exit_status == 1  # hung: no word in time
    assert "no word from it in time" in str(WorkerFailed(1, None))


async def test_a_worker_that_dies_is_started_again(reach_settings: ReachSettings):
    async with supervised(reach_settings, workers=2) as (proc, url, lines):
        first = children(proc.pid)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: len(children(proc.pid)) == 2 and victim not in children(proc.pid))
        now = children(proc.pid)
        await eventually(lambda: any("starting it again" in line for line in lines))
        assert any(f"(pid {victim}) exited with code -9" in line for line in lines)
        # the new worker serves too
        answered: set[int] = set()

        async def both_answer() -> bool:
            answered.update(await pids_answering(url, 10))
            return now <= answered

        await eventually(both_answer, timeout=30)
    assert proc.returncode == 0


async def test_workers_leave_with_a_supervisor_that_was_killed(reach_settings: ReachSettings):
    async with supervised(reach_settings, workers=2) as (proc, _, _):
        workers = children(proc.pid)
        proc.kill()  # no chance to stop them: the lifeline's end of file does
        await eventually(lambda: proc.returncode is not None)
        await eventually(lambda: not any(alive(pid) for pid in workers), timeout=30)


async def test_a_worker_that_cannot_start_fails_the_command(reach_settings: ReachSettings):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"nats://127.0.0.1:{probe.getsockname()[1]}"
    env = env_of(reach_settings) | {"REACH_NATS_URL": dead, "REACH_CONNECT_TIMEOUT": "1"}
    proc = await start_gateway("--port", "0", "--workers", "2", env=env)
    async with asyncio.timeout(60):
        _, err = await proc.communicate()
    text = err.decode()
    assert proc.returncode == 1, text
    assert "cannot reach NATS" in text
    assert "# gateway on" not in text
    assert "failed before serving" in text


def test_workers_are_given_the_host_and_port_the_supervisor_bound():
    """A worker's Host guard and banner go by its settings: it must be told the host
    given to the supervisor (``--host``) and the port bound (0 becomes a real one)."""
    import argparse

    from reach._cli_gateway import _worker_argv

    args = argparse.Namespace(url="nats://127.0.0.1:4222", access_log=True)
    argv = _worker_argv(args, "::1", 8123, 9100, 2)
    assert argv[argv.index("--host") + 1] == "::1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--metrics-port") + 1] == "9102"
    assert argv[argv.index("--url") + 1] == "nats://127.0.0.1:4222"
    assert "--access-log" in argv
