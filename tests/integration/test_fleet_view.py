"""What users see of their fleet (issue 19, point 6): task capabilities named in logs and in
`reach agents`, failing tasks logged with their traceback, DEGRADED that clears by itself and
says why, and submits to a task capability nobody serves."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import traceback
from typing import Any

import msgspec
import nats.js.errors
import pytest

import reach
from reach import Agent, CapabilityNotFound, Client, ReachSettings, Registry, Status
from reach.testing import eventually
from reach.wire import AgentEvent, Heartbeat

from .registry_wire import fast_settings
from .task_helpers import task_stream

TASK = "report.build"


@pytest.fixture
def settings(nats_server: Any) -> ReachSettings:
    return fast_settings(nats_server.url)


def task_agent(settings: ReachSettings, name: str = "reporter") -> Agent:
    agent = Agent(name, settings=settings)

    @agent.task(TASK)
    async def build(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    return agent


async def reach_cli(
    settings: ReachSettings, *args: str, timeout: float = 60
) -> tuple[int, str, str]:
    proc = await start_cli(settings, *args)
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def start_cli(settings: ReachSettings, *args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env |= {
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        "NO_COLOR": "1",
    }
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


# -- task capabilities are named -----------------------------------------------------------


async def test_a_task_only_agent_names_its_task_capabilities_when_it_starts(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="reach.agent")
    agent = task_agent(reach_settings)
    async with agent:
        pass
    [line] = [r.getMessage() for r in caplog.records if " serving " in r.getMessage()]
    assert line == f"agent {agent.agent_id} serving tasks {TASK}"


async def test_reach_agents_lists_task_capabilities_apart_and_says_why_degraded(
    settings: ReachSettings,
) -> None:
    caller = Agent("caller", settings=settings)

    @caller.capability("text.echo")
    async def echo(payload: Any) -> Any:
        return payload

    reporter = task_agent(settings)
    async with Registry(settings=settings), caller, reporter, Client(settings=settings) as client:
        await caller.report_health(False)

        async def listed() -> bool:
            records = {r.info.agent_id: r for r in await client.agents()}
            hb = records[caller.agent_id].heartbeat if caller.agent_id in records else None
            return reporter.agent_id in records and hb is not None and hb.reason != ""

        await eventually(listed, timeout=30)
        code, out, err = await reach_cli(settings, "agents")
        assert code == 0, err
        header, *rows = out.splitlines()
        assert header.split() == [
            "AGENT",
            "NAME",
            "STATUS",
            "CAPABILITIES",
            "TASKS",
            "TAGS",
            "INFLIGHT",
            "LOAD",
            "LATENCY",
            "SEEN",
            "REASON",
        ]
        by_id = {row.split()[0]: row for row in rows}
        assert f"{TASK}@1.0" in by_id[reporter.agent_id]
        assert "text.echo@1.0" in by_id[caller.agent_id]
        assert TASK not in by_id[caller.agent_id]
        at = header.index("TASKS")
        assert by_id[reporter.agent_id][at:].startswith(f"{TASK}@1.0")
        assert "DEGRADED" in by_id[caller.agent_id]
        assert by_id[caller.agent_id].endswith("health check failing")

        # --capability finds task capabilities too
        code, out, err = await reach_cli(settings, "agents", "--capability", TASK)
        assert code == 0, err
        assert [row.split()[0] for row in out.splitlines()[1:]] == [reporter.agent_id]


# -- a failing task leaves a traceback on its agent ----------------------------------------


def _ignite(payload: dict[str, Any]) -> None:
    raise ValueError(f"the printer is on fire (secret {payload['secret']})")


async def test_a_failing_task_logs_its_traceback_and_the_caller_gets_only_code_and_message(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="reach.tasks")
    agent = Agent("failer", settings=reach_settings)

    @agent.task("fail.op", max_attempts=1)
    async def fail(payload: dict[str, Any]) -> None:
        _ignite(payload)

    async with agent, Client(settings=reach_settings) as client:
        ref = await client.submit("fail.op", {"secret": "s3"})
        with pytest.raises(reach.ReachError) as info:
            await ref.result(timeout=30)
    logged = [r for r in caplog.records if ref.task_id in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    [record] = logged
    assert record.levelno == logging.ERROR
    assert agent.agent_id in record.getMessage()
    assert "fail.op" in record.getMessage()
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)
    tb = "".join(traceback.format_exception(*record.exc_info))
    assert "_ignite" in tb  # the frame that raised, as the request path logs it
    error = info.value
    assert error.code == "failed"
    shown = str(error)
    assert "Traceback" not in shown
    assert "_ignite" not in shown
    assert "ValueError(" not in shown  # never repr(exc)
    assert "the printer is on fire" in shown  # the code and message, as before


async def test_a_refused_task_is_not_logged_as_a_failure(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A deliberate refusal (``RemoteError``) is the task's answer, not a bug: no traceback,
    as on the request path."""
    caplog.set_level(logging.ERROR, logger="reach.tasks")
    agent = Agent("refuser", settings=reach_settings)

    @agent.task("refuse.op", max_attempts=1)
    async def refuse(payload: Any) -> None:
        raise reach.BadRequest("no such report")

    async with agent, Client(settings=reach_settings) as client:
        ref = await client.submit("refuse.op", {})
        with pytest.raises(reach.BadRequest, match="no such report"):
            await ref.result(timeout=30)
    assert not [r for r in caplog.records if ref.task_id in r.getMessage()]


# -- DEGRADED clears by itself and says why ------------------------------------------------


async def test_degraded_by_timeouts_clears_without_traffic_and_says_why(
    settings: ReachSettings,
) -> None:
    """Issue 19: an agent made DEGRADED by handler timeouts stayed so for 25 minutes when
    nobody called it (only successes cleared it). Now it is UP again after a quiet spell
    with no new timeout (the 10 s window and three heartbeats; shortened here), and its
    heartbeats say why it is DEGRADED meanwhile."""
    agent = Agent("slowpoke", settings=settings)
    never = asyncio.Event()

    @agent.capability("slow.op")
    async def slow(payload: Any) -> None:
        await never.wait()

    beats: list[Heartbeat] = []
    back_up = asyncio.Event()
    async with agent, Client(settings=settings) as client:
        agent._workers.timeouts.quiet = 0.6  # not 10 s: the test need not wait that long

        async def on_beat(msg: Any) -> None:
            hb = msgspec.json.decode(msg.data, type=Heartbeat)
            beats.append(hb)
            if hb.status is Status.UP and any(b.status is Status.DEGRADED for b in beats):
                back_up.set()

        await client.nc.subscribe(client.subjects.heartbeat(agent.agent_id), cb=on_beat)
        await client.flush()
        outcomes = await asyncio.gather(
            *(client.request("slow.op", {}, timeout=0.3, max_attempts=1) for _ in range(3)),
            return_exceptions=True,
        )
        assert all(isinstance(o, reach.RequestTimeout) for o in outcomes), outcomes
        async with asyncio.timeout(30):
            await back_up.wait()
    degraded = [b for b in beats if b.status is Status.DEGRADED]
    assert degraded[0].reason == "handler timeouts: 3 within 10s; UP again after 0.6s without one"
    assert [b.reason for b in beats if b.status is Status.UP][-1] == ""
    assert agent.stats.served == 0  # no success cleared it: time did


async def test_the_registry_keeps_the_reason_and_reach_watch_shows_it(
    settings: ReachSettings,
) -> None:
    agent = Agent("checked", settings=settings)

    @agent.capability("text.echo")
    async def echo(payload: Any) -> Any:
        return payload

    events: list[AgentEvent] = []
    degraded = asyncio.Event()
    async with Registry(settings=settings), agent, Client(settings=settings) as client:

        async def on_event(msg: Any) -> None:
            ev = msgspec.json.decode(msg.data, type=AgentEvent)
            events.append(ev)
            if ev.new is Status.DEGRADED:
                degraded.set()

        await client.nc.subscribe(client.subjects.event(agent.agent_id), cb=on_event)
        await client.flush()
        await eventually(lambda: agent.presence.seen is Status.UP, timeout=30)
        watch = await start_cli(settings, "watch", "--count", "1")
        try:
            assert watch.stderr is not None
            assert watch.stdout is not None
            async with asyncio.timeout(30):
                assert "watching" in (await watch.stderr.readline()).decode()
            await agent.report_health(False)
            async with asyncio.timeout(30):
                await degraded.wait()
                line = (await watch.stdout.readline()).decode()
                await watch.wait()
        finally:
            if watch.returncode is None:
                watch.kill()
                await watch.wait()
        [ev] = [e for e in events if e.new is Status.DEGRADED]
        assert (ev.reason, ev.detail) == ("reported", "health check failing")
        assert "UP -> DEGRADED" in line
        assert line.rstrip().endswith("(reported: health check failing)")
        [record] = [r for r in await client.agents() if r.info.agent_id == agent.agent_id]
        assert record.transitions[-1].detail == "health check failing"


# -- submitting to a task capability nobody serves ----------------------------------------


async def test_submit_with_require_agent_refuses_a_capability_nobody_serves(
    settings: ReachSettings,
) -> None:
    async with Registry(settings=settings), Client(settings=settings) as client:
        with pytest.raises(CapabilityNotFound) as info:
            await client.submit(TASK, {"n": 1}, require_agent=True)
        assert str(info.value) == f"no agent has registered task capability {TASK!r}"
        with pytest.raises(CapabilityNotFound):
            await client.submit_batch(TASK, [{"n": 1}], require_agent=True)
        with pytest.raises(nats.js.errors.NotFoundError):  # nothing was stored, or made
            await client.nc.jetstream().stream_info(task_stream(settings))
        # the default keeps durable-queue semantics: queued before its worker starts
        early = await client.submit(TASK, {"n": 2})
        agent = task_agent(settings)
        async with agent:

            async def offered() -> bool:
                return any(r.info.agent_id == agent.agent_id for r in await client.agents())

            await eventually(offered, timeout=30)
            ref = await client.submit(TASK, {"n": 3}, require_agent=True)
            assert await ref.result(timeout=30) == {"n": 3}
            assert await early.result(timeout=30) == {"n": 2}
            with pytest.raises(CapabilityNotFound, match="with tags \\['gpu'\\]"):
                await client.submit(TASK, {"n": 4}, required_tags=["gpu"], require_agent=True)
            await agent.pause()

            async def paused() -> bool:
                records = await client.agents()
                return any(r.status is Status.PAUSED for r in records)

            await eventually(paused, timeout=30)
            with pytest.raises(CapabilityNotFound, match="1 PAUSED"):
                await client.submit(TASK, {"n": 5}, require_agent=True)


async def test_reach_submit_warns_when_no_agent_serves_the_task_capability(
    settings: ReachSettings,
) -> None:
    async with Registry(settings=settings), Client(settings=settings) as client:
        code, out, err = await reach_cli(settings, "submit", TASK, '{"n": 1}')
        assert code == 0, err
        task_id = out.strip()
        assert (await client.task_record(task_id)).state is reach.TaskState.PENDING
        assert err.splitlines() == [
            f"warning: no agent has registered task capability {TASK!r};"
            " the task waits until one does, however long"
        ]
        code, out, err = await reach_cli(settings, "submit", TASK, '{"n": 1}', "--require-agent")
        assert (code, out) == (1, "")
        assert "capability_not_found" in err
        async with task_agent(settings) as agent:

            async def offered() -> bool:
                return any(r.info.agent_id == agent.agent_id for r in await client.agents())

            await eventually(offered, timeout=30)
            code, out, err = await reach_cli(settings, "submit", TASK, '{"n": 1}', "--wait")
            assert (code, json.loads(out)) == (0, {"n": 1}), err
            assert "warning" not in err
