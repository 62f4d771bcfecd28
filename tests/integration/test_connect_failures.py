"""Bad input at the connection boundary: an empty, malformed or unreachable NATS URL ends
within connect_timeout, as ``connection_failed``, with one line that names the URL (never
its password), what is wrong and what to do: from the ``reach`` command, from
``agent.run()`` and from the library. And a connection lost later is logged once per
outage, not once per reconnect attempt."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

import reach
from reach import Client, ReachSettings
from reach._nats import close_nats, connect_nats
from reach._urls import redact
from reach.testing import NatsServer, eventually

ROOT = Path(__file__).parents[2]
CONNECT_TIMEOUT = 1.0
#: how much longer than connect_timeout a failing connect may take (a bound, not a speed test)
SLACK = 5.0
#: a hang guard for a whole process: Python's start-up and reach's imports are in it, and
#: they take seconds on a loaded machine
HANG_GUARD = 60.0
SECRET = "s3cret-pw"


def refused_url() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"nats://u:{SECRET}@127.0.0.1:{port}"


BAD = {
    "empty": lambda: "",
    "no host": lambda: f"nats://u:{SECRET}@",
    "port not a number": lambda: f"nats://u:{SECRET}@127.0.0.1:abc",
    "wrong scheme": lambda: f"http://u:{SECRET}@127.0.0.1:4222",
    "unresolvable host": lambda: f"nats://u:{SECRET}@nohost.invalid:4222",
    "refused port": refused_url,
}

AGENT = """
from reach import Agent
agent = Agent("probe")

@agent.capability("probe.echo")
async def echo(payload):
    return payload

agent.run()
"""

LIBRARY = """
import asyncio, json, time
from reach import Agent, Client, ReachError, Registry

async def main():
    for what in ("client", "agent", "registry"):
        start = time.monotonic()
        try:
            if what == "client":
                await Client(name="probe").connect()
            elif what == "agent":
                await Agent("probe").start()
            else:
                await Registry().start()
            said = {"type": None}
        except ReachError as exc:
            said = {"type": type(exc).__name__, "code": exc.code, "message": exc.message}
        print(json.dumps({"what": what, "seconds": time.monotonic() - start, **said}))

asyncio.run(main())
"""


async def run(tmp_path, url: str, *argv: str) -> tuple[int | None, str, str]:
    """Run ``python argv`` with ``url`` as REACH_NATS_URL; killed if it outlives the guard
    (an empty URL made nats-py spin forever, deaf to Ctrl-C)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env |= {"REACH_NATS_URL": url, "REACH_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    try:
        async with asyncio.timeout(HANG_GUARD):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"{argv} with REACH_NATS_URL={url!r} still ran after the guard")
    return proc.returncode, out.decode(), err.decode()


def check_one_line(code: int | None, err: str, url: str) -> None:
    assert code not in (0, None)
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2, err
    assert "connection_failed" in err, err
    assert "agent_unavailable" not in err
    assert "Traceback" not in err
    assert SECRET not in err
    if url:
        assert redact(url) in err, err  # it names the URL it could not use


@pytest.mark.parametrize("bad", BAD)
async def test_reach_agents_ends_at_once_with_one_line(tmp_path, bad):
    url = BAD[bad]()
    code, _, err = await run(tmp_path, url, "-m", "reach.cli", "agents")
    check_one_line(code, err, url)


@pytest.mark.parametrize("command", [["call", "probe.echo", "{}"], ["listen", "t"], ["registry"]])
@pytest.mark.parametrize("bad", ["empty", "port not a number", "refused port"])
async def test_every_command_that_connects_says_so_in_one_line(tmp_path, command, bad):
    url = BAD[bad]()
    code, _, err = await run(tmp_path, url, "-m", "reach.cli", *command)
    check_one_line(code, err, url)


@pytest.mark.parametrize("bad", ["empty", "port not a number", "refused port"])
async def test_agent_run_prints_one_line_and_exits_non_zero(tmp_path, bad):
    (tmp_path / "probe.py").write_text(AGENT)
    url = BAD[bad]()
    code, _, err = await run(tmp_path, url, "probe.py")
    check_one_line(code, err, url)


@pytest.mark.parametrize("bad", ["empty", "refused port"])
async def test_the_registry_service_entry_point_prints_one_line(bad):
    url = BAD[bad]()
    code, _, err = await run(ROOT, url, "-m", "services.registry")
    check_one_line(code, err, url)


@pytest.mark.parametrize("bad", BAD)
async def test_library_calls_raise_connection_failed_in_time(tmp_path, bad):
    url = BAD[bad]()
    code, out, err = await run(tmp_path, url, "-c", LIBRARY)
    assert code == 0, err
    assert err == ""  # a first connect that fails logs nothing: its error says it all
    said = [json.loads(line) for line in out.splitlines()]
    assert [s["what"] for s in said] == ["client", "agent", "registry"]
    for s in said:
        assert (s["type"], s["code"]) == ("ConnectionFailed", "connection_failed"), s
        assert s["seconds"] < CONNECT_TIMEOUT + SLACK  # measured in the process: no imports
        assert SECRET not in s["message"]
        assert "\n" not in s["message"]


def attempts(caplog: pytest.LogCaptureFixture) -> int:
    """Failed reconnect attempts reported so far, at whatever level."""
    return sum("[Errno 111]" in r.getMessage() for r in caplog.records)  # ECONNREFUSED


async def test_a_lost_connection_is_logged_once_until_it_is_back(caplog):
    server = NatsServer().start()
    try:
        settings = ReachSettings(nats_url=server.url)
        with caplog.at_level(logging.DEBUG, logger="reach.nats"):
            async with Client(settings=settings, name="episodes") as client:
                await server.akill()
                # nats-py retries every 0.25 s and reports each failure
                await eventually(lambda: attempts(caplog) >= 4, timeout=30)
                await server.astart()
                await eventually(lambda: client.connected, timeout=30)
                warnings = [
                    r.getMessage()
                    for r in caplog.records
                    if r.name == "reach.nats" and r.levelno >= logging.WARNING
                ]
                assert len(warnings) == 1, warnings
                assert f"lost {server.url}" in warnings[0]
                await eventually(
                    lambda: any("reconnected to" in r.getMessage() for r in caplog.records)
                )
    finally:
        server.close()


async def test_a_connection_the_server_closes_is_reported_a_close_of_ours_is_not(
    reach_settings, caplog
):
    """nats-py gives a connection up for good (no reconnect) when the server closes it for
    an error: that is logged once, naming the error, and ``closed`` is called. Closing a
    connection ourselves (any way: ``close``, ``drain``, ``async with``, ``close_nats``),
    even after a refused publish, is neither."""
    caplog.set_level(logging.DEBUG, logger="reach.nats")
    given_up: list[str] = []

    def connect(name: str) -> Any:
        async def closed() -> None:
            given_up.append(name)

        return connect_nats(reach_settings, reach_settings.nats_url, name, closed=closed)

    for name, close in (
        ("closed", lambda nc: nc.close()),
        ("drained", lambda nc: nc.drain()),
        ("exited", lambda nc: nc.__aexit__(None, None, None)),
        ("ours", close_nats),
    ):
        nc = await connect(name)
        await close(nc)
        assert nc.is_closed
    nc = await connect("over")
    headers = {"X-Pad": "p" * 64}  # within max_payload alone, over it with the header
    await nc.publish("nowhere", b"x" * (nc.max_payload - 16), headers=headers)
    await eventually(lambda: nc.is_closed)
    await eventually(lambda: given_up == ["over"])
    (warning,) = [r.getMessage() for r in caplog.records if "for good" in r.getMessage()]
    assert "nats connection over: closed by" in warning
    assert "maximum payload" in warning.lower()


async def test_an_empty_url_given_directly_is_refused_not_the_default(reach_settings):
    """``Client("")``, ``Agent(url="")`` and ``--url ''`` name the empty URL; none falls
    back to the settings' URL (a server is up there: it would connect)."""
    settings = reach_settings
    for make in (
        lambda: reach.Client("", settings=settings),
        lambda: reach.Agent("probe", url="", settings=settings),
        lambda: reach.Registry(url="", settings=settings),
    ):
        with pytest.raises(reach.ConnectionFailed, match="URL is empty"):
            async with make():
                pass
    env = {**os.environ, "REACH_NATS_URL": settings.nats_url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "agents",
        "--url",
        "",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    async with asyncio.timeout(HANG_GUARD):
        _, err = await proc.communicate()
    assert proc.returncode not in (0, None)
    assert "URL is empty" in err.decode()
