"""End to end through processes: `reach up`, `reach call|publish|listen`, `agent.run()`."""

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

import reach
from reach import Agent, Client, ReachSettings
from reach.examples import demo
from reach.testing import eventually

ROOT = Path(__file__).parents[2]


async def reach_cli(*args, url, timeout=30):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "REACH_NATS_URL": url},
    )
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def read_line_containing(stream, text, timeout=30):
    async with asyncio.timeout(timeout):
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise AssertionError(f"stream ended before {text!r}")
            if text in line:
                return line


async def test_reach_up_then_call_publish_listen(tmp_path):
    up = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "up",
        "--port",
        "-1",
        "--monitor-port",
        "-1",
        "--config",
        str(ROOT / "nats-server.conf"),
        "--data-dir",
        str(tmp_path / "data"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
    )
    try:
        url = (await read_line_containing(up.stdout, "nats://")).strip()
        pid_line = await read_line_containing(up.stderr, "nats-server pid")
        server_pid = int(pid_line.split("pid")[1].split(",")[0])
        settings = ReachSettings(nats_url=url)
        agent = Agent("calc", "calc-1", settings=settings)

        @agent.capability("math.add")
        async def add(req: dict) -> dict:
            return {"sum": req["a"] + req["b"]}

        async with agent:
            code, out, err = await reach_cli("call", "math.add", '{"a": 2, "b": 3}', url=url)
            assert (code, json.loads(out)) == (0, {"sum": 5}), err

            # `reach up` started a registry: the agent is in everyone's table.
            async def listed():
                code, out, _ = await reach_cli("agents", "--json", url=url)
                return code == 0 and [a["info"]["agent_id"] for a in json.loads(out)] == ["calc-1"]

            await eventually(listed, timeout=30)
            code, out, _ = await reach_cli("agents", "--capability", "math.add", url=url)
            assert "calc-1" in out
            assert "UP" in out
            assert "math.add@1.0" in out
            code, out, err = await reach_cli("agents", "--capability", "math.nobody", url=url)
            assert (code, out) == (0, "")
            assert err.strip() == "no agent offers 'math.nobody' (1 known)"
            watch = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "reach.cli",
                "watch",
                "--json",
                "--count",
                "2",
                "--url",
                url,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            await read_line_containing(watch.stderr, "watching")
            code, out, err = await reach_cli("pause", "calc-1", url=url)
            assert (code, json.loads(out)) == (0, {"agent_id": "calc-1", "status": "PAUSED"}), err
            code, out, err = await reach_cli("resume", "calc-1", url=url)
            assert json.loads(out)["status"] == "UP"
            async with asyncio.timeout(30):
                out, _ = await watch.communicate()
            seen = [json.loads(line) for line in out.decode().splitlines()]
            assert [(e["agent_id"], e["old"], e["new"]) for e in seen] == [
                ("calc-1", "UP", "PAUSED"),
                ("calc-1", "PAUSED", "UP"),
            ]
            code, out, err = await reach_cli("pause", "nobody-here", url=url)
            assert code == 1
            assert "agent_unavailable" in err
            code, out, err = await reach_cli(
                "call", "math.add", "{}", "--agent", "calc-1", "--priority", "high", url=url
            )
            assert code == 1
            assert "failed" in err
            code, out, err = await reach_cli("call", "math.nothing", "{}", url=url)
            assert code == 1
            assert "capability_not_found" in err
            code, out, err = await reach_cli("call", "math.add", "{not json", url=url)
            assert code == 1
            assert "bad_request" in err
            code, out, err = await reach_cli("call", "math.*", "{}", url=url)
            assert code == 2
            assert "wildcard" in err

            listen = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "reach.cli",
                "listen",
                "order.*",
                "--count",
                "1",
                "--url",
                url,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            await read_line_containing(listen.stderr, "listening")
            code, _, err = await reach_cli("publish", "order.status", '{"id": 7}', url=url)
            assert code == 0, err
            async with asyncio.timeout(30):
                out, _ = await listen.communicate()
            assert json.loads(out) == {"topic": "order.status", "data": {"id": 7}}
            assert listen.returncode == 0
        assert (tmp_path / "data" / "jetstream").is_dir()
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await up.wait()
    assert up.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)


async def test_reach_up_checks_settings_before_it_starts_anything(tmp_path):
    """Settings are built once, at the edge, before a server or registry is started: bad
    ``REACH_*`` values end the command with an error and leave no process behind."""
    up = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "up",
        "--port",
        "-1",
        "--data-dir",
        str(tmp_path / "data"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, "REACH_TIMEOUT_MS": "0"},
    )
    async with asyncio.timeout(60):
        _, err = await up.communicate()
    assert up.returncode == 2
    assert "timeout_ms" in err.decode()
    log = tmp_path / "data" / "nats-server.log"
    lines = log.read_text().splitlines() if log.exists() else []
    orphans = set()
    for pid in {int(line[1 : line.index("]")]) for line in lines}:  # "[pid] date [INF] ..."
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            orphans.add(pid)
    assert orphans == set()
    assert lines == []  # no server was even started


async def test_agent_run_drains_on_sigterm_without_losing_accepted_work(reach_settings):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.examples.logistics",
        "logistics-sigterm",
        stderr=asyncio.subprocess.PIPE,
        env={
            **os.environ,
            "REACH_NATS_URL": reach_settings.nats_url,
            "REACH_SUBJECT_PREFIX": reach_settings.subject_prefix,
            "REACH_DRAIN_TIMEOUT": "20",
        },
    )
    try:
        await read_line_containing(proc.stderr, "logistics-sigterm serving logistics.track")
        async with Client(settings=reach_settings) as client:
            calls = [
                asyncio.create_task(
                    client.request("logistics.track", {"order_id": f"o{i}"}, timeout=30)
                )
                for i in range(20)
            ]
            await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
            await client.flush()
            proc.send_signal(signal.SIGTERM)
            replies = await asyncio.gather(*calls)
            assert sorted(r["order_id"] for r in replies) == sorted(f"o{i}" for i in range(20))
            async with asyncio.timeout(30):
                assert await proc.wait() == 0
            with pytest.raises(reach.CapabilityNotFound):
                await client.request("logistics.track", {"order_id": "late"})
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# `reach demo` end to end, from the wheel and outside the checkout: test_packaging.py


async def test_demo_burst_reports_failures_when_every_request_fails(reach_client, capsys):
    await demo.burst(reach_client, "nobody serves logistics.track:")
    out = capsys.readouterr().out
    assert "nobody serves logistics.track:" in out
    assert "60 capability_not_found" in out
