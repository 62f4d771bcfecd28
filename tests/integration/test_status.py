"""`reach status` and `reach top` against a real server: a registry, two agents taking
traffic, a paused one, a task agent."""

import asyncio
import contextlib
import json
import os
import pty
import signal
import sys

import pytest

from reach import Agent, Client, HandlerFailed, Registry
from reach._status import summarize, take
from reach._tasks.counts import CapabilityTasks
from reach.testing import eventually

ECHO, LONELY, TASK = "text.echo", "cap.lonely", "report.build"


def echo_agent(settings, agent_id):
    agent = Agent("echo", agent_id, settings=settings)

    @agent.capability(ECHO)
    async def echo(req: dict) -> dict:
        if req.get("fail"):
            raise ValueError("asked to fail")
        return req

    return agent


def lonely_agent(settings):
    agent = Agent("solo", "solo-1", settings=settings)

    @agent.capability(LONELY)
    async def lonely(req: dict) -> dict:
        return req

    return agent


def task_agent(settings):
    agent = Agent("builder", "builder-1", settings=settings)

    @agent.task(TASK)
    async def build(payload: dict) -> dict:
        return {"n": payload["n"] * 2}

    return agent


@contextlib.asynccontextmanager
async def fleet(settings, *, tasks=False):
    """Two echo agents UP, the lonely one PAUSED (its capability has no live instance),
    optionally a task agent; and a client that sees all of them."""
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(Registry(settings=settings))
        agents = [echo_agent(settings, "echo-1"), echo_agent(settings, "echo-2")]
        agents.append(lonely_agent(settings))
        if tasks:
            agents.append(task_agent(settings))
        for agent in agents:
            await stack.enter_async_context(agent)
        client = await stack.enter_async_context(Client(settings=settings))
        await agents[2].pause()
        want = {"echo-1": "UP", "echo-2": "UP", "solo-1": "PAUSED"}
        if tasks:
            want["builder-1"] = "UP"

        async def seen():
            return {r.info.agent_id: r.status.value for r in await client.agents()} == want

        await eventually(seen)
        yield client


async def traffic(client, ok, failing):
    for i in range(failing):
        with pytest.raises(HandlerFailed):
            await client.call(ECHO, {"fail": True, "i": i})
    for i in range(ok):
        assert await client.call(ECHO, {"i": i}) is not None


async def test_summary_counts_instances_requests_errors_and_tasks(reach_settings):
    async with fleet(reach_settings, tasks=True) as client:
        refs = [await client.submit(TASK, {"n": n}) for n in range(3)]
        assert [await r.result(timeout=30) for r in refs] == [{"n": 0}, {"n": 2}, {"n": 4}]
        before = await take(client)
        await traffic(client, ok=20, failing=3)
        summary = summarize(before, await take(client))

    caps = {c.name: c for c in summary.capabilities}
    echo = caps[ECHO]
    assert (echo.instances["UP"], echo.live, echo.no_live) == (2, 2, False)
    assert (echo.traffic.requests, echo.traffic.errors) == (23, 3)
    assert echo.traffic.requests_per_s > 0
    assert echo.traffic.errors_per_s > 0
    assert echo.traffic.latency_ms is not None

    lonely = caps[LONELY]
    assert (lonely.instances["PAUSED"], lonely.live, lonely.no_live) == (1, 0, True)
    assert lonely.traffic.requests == 0
    assert summary.capabilities[0].name == LONELY  # flagged rows first

    fleet_ = summary.fleet
    assert (fleet_.agents, fleet_.instances["UP"], fleet_.instances["PAUSED"]) == (4, 3, 1)
    assert (fleet_.traffic.requests, fleet_.traffic.errors, fleet_.unmeasured) == (23, 3, 0)

    assert caps[TASK].kinds == ("task",)
    assert caps[TASK].tasks == CapabilityTasks(waiting=0, running=0, dead=0)
    assert summary.tasks is not None
    assert (summary.tasks.queued, summary.tasks.states, summary.tasks.capped) == (
        0,
        {"SUCCEEDED": 3},
        False,
    )


async def test_a_task_scan_stops_at_its_cap_and_says_so(reach_settings):
    async with fleet(reach_settings, tasks=True) as client:
        refs = [await client.submit(TASK, {"n": n}) for n in range(3)]
        for r in refs:
            await r.result(timeout=30)
        census = (await take(client, task_scan=2)).tasks
    assert census is not None
    assert (census.scanned, census.keys, census.capped, sum(census.states.values())) == (
        2,
        3,
        True,
        2,
    )


def cli_env(settings):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    return env | {
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
    }


async def start_cli(settings, *args):
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(settings),
    )


async def read_until(stream, text):
    async with asyncio.timeout(30):
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise AssertionError(f"output ended before {text!r}")
            if text in line:
                return line


async def test_reach_status_json_and_text(reach_settings):
    async with fleet(reach_settings) as client:
        proc = await start_cli(reach_settings, "status", "--json", "--interval", "3")
        await read_until(proc.stderr, "# sampling")  # the first sample is taken
        await traffic(client, ok=5, failing=2)
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        shown = json.loads(out)

        proc = await start_cli(reach_settings, "status", "--interval", "0")
        async with asyncio.timeout(30):
            text, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()

    caps = {c["name"]: c for c in shown["capabilities"]}
    echo = caps[ECHO]
    assert (echo["instances"]["UP"], echo["live"]) == (2, 2)
    assert echo["traffic"]["requests"] >= 1
    assert echo["traffic"]["requests_per_s"] > 0
    assert echo["traffic"]["errors"] >= 1  # the failing calls were made first
    assert (caps[LONELY]["instances"]["PAUSED"], caps[LONELY]["no_live"]) == (1, True)
    assert shown["fleet"]["agents"] == 3

    lines = text.decode().splitlines()
    assert "\033[" not in text.decode()  # no colours into a pipe
    assert "NO LIVE INSTANCE: cap.lonely" in lines
    assert any(line.split()[:3] == [ECHO, "req", "2"] for line in lines)
    assert any(line.startswith("agents 3: UP 2  DEGRADED 0  PAUSED 1") for line in lines)


async def test_reach_top_draws_frames_and_quits_on_ctrl_c(reach_settings):
    async with fleet(reach_settings):
        proc = await start_cli(reach_settings, "top", "--frames", "2", "--interval", "0.2")
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        frames = out.decode().split("reach top  prefix")[1:]
        assert len(frames) == 2
        assert "no rates yet" in frames[0]  # the first frame comes at once
        assert " over " in frames[1]  # the next one has rates
        assert all("NO LIVE INSTANCE: cap.lonely" in f for f in frames)

        # on a terminal: the alternate screen, each frame over the last, and Ctrl-C
        # gives the terminal back as it was
        master, slave = pty.openpty()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "reach.cli",
            "top",
            "--interval",
            "0.2",
            stdout=slave,
            stderr=asyncio.subprocess.PIPE,
            env={k: v for k, v in cli_env(reach_settings).items() if k != "NO_COLOR"}
            | {"COLUMNS": "120", "LINES": "30"},
        )
        os.close(slave)
        screen = Terminal(master)
        try:
            await screen.wait_for(lambda text: text.count(b"reach top") >= 2)
            proc.send_signal(signal.SIGINT)
            async with asyncio.timeout(30):
                _, err = await proc.communicate()
            await screen.wait_for(lambda text: text.endswith(LEAVE_SCREEN))
        finally:
            screen.close()
        assert proc.returncode == 0, err.decode()
        assert "Traceback" not in err.decode()
    text = screen.text
    assert text.startswith(b"\033[?1049h\033[?25l\033[Hreach top")
    assert b"\033[32mUP\033[0m 2" in text  # coloured on a terminal
    assert text.count(b"\033[H") >= 2  # redrawn in place


LEAVE_SCREEN = b"\033[?25h\033[?1049l"


class Terminal:
    """The far side of a pseudo-terminal: what the program wrote to it, read as it
    comes (without blocking the loop)."""

    def __init__(self, fd):
        self.fd = fd
        self.text = b""
        self.changed = asyncio.Event()
        asyncio.get_running_loop().add_reader(fd, self._read)

    def _read(self):
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: the program closed its side
            chunk = b""
        if not chunk:
            asyncio.get_running_loop().remove_reader(self.fd)
        self.text += chunk
        self.changed.set()

    async def wait_for(self, condition):
        async with asyncio.timeout(30):
            while not condition(self.text):
                self.changed.clear()
                await self.changed.wait()

    def close(self):
        asyncio.get_running_loop().remove_reader(self.fd)
        os.close(self.fd)
