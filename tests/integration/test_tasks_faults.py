"""Durable tasks under faults: a SIGKILLed agent process, a killed nats-server, a SIGSTOPped
agent whose late write meets the fence. The agent runs as a process of its own
(``task_agent.py``) that leaves one file per execution, so side effects are counted."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

import reach
from reach import Agent, Client, ReachSettings, TaskState
from reach.testing import NatsServer, eventually, unique_prefix

from .task_agent import CAPABILITY

SCRIPT = Path(__file__).with_name("task_agent.py")
ROOT = Path(reach.__file__).resolve().parents[1]
CONCURRENCY = 8
TOTAL = 500


def fast(url: str) -> ReachSettings:
    """Short leases and retries, so a lost agent's task comes back within seconds."""
    return ReachSettings(
        nats_url=url, subject_prefix=unique_prefix(), task_ack_wait=2.0, task_retry_base=0.05
    )


class AgentProcess:
    """``task_agent.py`` in a process of its own, with the test's settings."""

    def __init__(self, settings: ReachSettings, runs: Path, mode: str, concurrency: int) -> None:
        self.args = (str(SCRIPT), str(runs), mode)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "REACH_NATS_URL": settings.nats_url,
            "REACH_SUBJECT_PREFIX": settings.subject_prefix,
            "REACH_TASK_ACK_WAIT": str(settings.task_ack_wait),
            "REACH_TASK_RETRY_BASE": str(settings.task_retry_base),
            "REACH_TASK_CONCURRENCY": str(concurrency),
        }
        self.procs: list[asyncio.subprocess.Process] = []

    @property
    def pid(self) -> int:
        return self.procs[-1].pid

    async def start(self) -> None:
        self.procs.append(
            await asyncio.create_subprocess_exec(sys.executable, *self.args, env=self.env)
        )

    async def kill(self) -> None:
        proc = self.procs[-1]
        if proc.returncode is None:
            proc.kill()
        await proc.wait()

    async def close(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            await proc.wait()


@pytest.fixture
async def runs(tmp_path: Path) -> Path:
    out = tmp_path / "runs"
    out.mkdir()
    return out


def executions(runs: Path) -> list[tuple[str, int, int]]:
    """(task id, attempt, pid) of every run so far."""
    out = []
    for f in runs.iterdir():
        parts = f.name.split(".")
        if len(parts) == 3 and parts[1].isdigit():
            out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


async def run_through_a_fault(settings: ReachSettings, runs: Path, fault: Any) -> None:
    """Submit TOTAL tasks, let one agent process run them, apply ``fault`` once some are
    done, then check that every task succeeded and few ran twice."""
    agent = AgentProcess(settings, runs, "quick", CONCURRENCY)
    async with Client(settings=settings) as client:
        batch = await client.submit_batch(CAPABILITY, [{"n": i} for i in range(TOTAL)])
        assert len(batch.refs) == TOTAL
        waiting = asyncio.create_task(batch.results(timeout=180))  # waits through the fault
        try:
            await agent.start()
            await eventually(lambda: len(executions(runs)) >= TOTAL // 5, timeout=60)
            await fault(agent, client)
            started = {t for t, _, _ in executions(runs)}
            assert len(started) < TOTAL, "the fault came too late to test anything"
            results = await waiting
            records = [await ref.status() for ref in batch.refs]
        finally:
            waiting.cancel()
            await agent.close()
    assert [r["n"] for r in results] == list(range(TOTAL)), results
    assert all(rec.state is TaskState.SUCCEEDED for rec in records)
    runs_per_task = Counter(t for t, _, _ in executions(runs))
    assert set(runs_per_task) == {ref.task_id for ref in batch.refs}
    duplicated = sum(n - 1 for n in runs_per_task.values())
    assert duplicated <= CONCURRENCY, runs_per_task.most_common(CONCURRENCY + 1)
    # the run each record says succeeded is a run that happened (its file is there)
    ran = {(t, n) for t, n, _ in executions(runs)}
    for rec in records:
        [won] = [a.n for a in rec.attempts if a.outcome == "succeeded"]
        assert (rec.task_id, won) in ran, rec


async def test_a_killed_agent_process_loses_no_task(nats_server: NatsServer, runs: Path):
    settings = fast(nats_server.url)
    pids: list[int] = []

    async def kill_and_restart(agent: AgentProcess, client: Client) -> None:
        pids.append(agent.pid)
        await agent.kill()  # SIGKILL: no drain, no cleanup
        await agent.start()
        pids.append(agent.pid)

    await run_through_a_fault(settings, runs, kill_and_restart)
    by_pid = Counter(pid for _, _, pid in executions(runs))
    assert set(by_pid) == set(pids)  # both processes ran tasks


async def test_a_killed_server_loses_no_task(runs: Path):
    async with NatsServer() as server:
        settings = fast(server.url)

        async def kill_server(agent: AgentProcess, client: Client) -> None:
            port, store = server.port, server.store_dir
            await server.akill()
            await eventually(lambda: not client.connected)
            await server.astart()
            assert (server.port, server.store_dir) == (port, store)

        await run_through_a_fault(settings, runs, kill_server)


async def test_every_process_killed_at_once_loses_no_task(runs: Path):
    """kill -9 of the agent and the server together, then both restarted: every task
    still finishes (the client, the caller, rides it out)."""
    async with NatsServer() as server:
        settings = fast(server.url)

        async def kill_everything(agent: AgentProcess, client: Client) -> None:
            await asyncio.gather(agent.kill(), server.akill())
            await eventually(lambda: not client.connected)
            await server.astart()
            await agent.start()

        await run_through_a_fault(settings, runs, kill_everything)


@pytest.mark.parametrize(
    ("handler_returns", "recorded"),
    [(True, True), (False, True), (True, False)],
    ids=["late-result", "still-running", "stopped-before-running-was-written"],
)
async def test_a_stopped_agent_is_fenced_when_it_wakes(
    nats_server: NatsServer, runs: Path, handler_returns: bool, recorded: bool
):
    """After SIGCONT the first agent either finishes its handler and tries to write its
    result (refused by the fence), or its lease check finds the newer attempt first and
    cancels the handler; either way it writes nothing and counts a fenced attempt. Also
    when it was frozen within its first moments, before its RUNNING was written: then
    both think they run attempt 1, and the record's agent tells them apart."""
    settings = fast(nats_server.url)
    first = AgentProcess(settings, runs, "hold", 1)
    async with Client(settings=settings) as client:
        ref = await client.submit(CAPABILITY, {"n": 7}, max_attempts=5)
        try:
            await first.start()
            await eventually(lambda: any(runs.glob(f"{ref.task_id}.1.*")), timeout=30)

            async def recorded_running() -> bool:  # a long task: its RUNNING is written
                return (await ref.status()).state is TaskState.RUNNING

            if recorded:
                await eventually(recorded_running, timeout=30)
            os.kill(first.pid, signal.SIGSTOP)
            second = Agent("second", settings=settings)

            @second.task(CAPABILITY)
            async def work(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
                return {"n": payload["n"], "pid": 0, "attempt": ctx.attempt}

            async with second:
                got = await ref.result(timeout=60)
            # a recorded first attempt makes the takeover attempt 2; an unrecorded one
            # (frozen within its first moments) leaves the number to the takeover: 1
            n = 2 if recorded else (await ref.status()).attempt
            assert got == {"n": 7, "pid": 0, "attempt": n}
            before = await ref.status()
            if handler_returns:
                # the first agent's handler returns once it runs again
                await client.nc.publish(f"{settings.subject_prefix}.test.release", b"")
                await client.flush()
            os.kill(first.pid, signal.SIGCONT)
            await eventually(lambda: (runs / f"fenced.{first.pid}").exists(), timeout=30)
            after = await ref.status()
        finally:
            await first.close()
    assert after == before  # the stale worker wrote nothing
    assert after.state is TaskState.SUCCEEDED
    if recorded:
        assert (after.attempt, after.agent_id) == (2, second.agent_id)
        assert [a.outcome for a in after.attempts] == ["lost", "succeeded"]
        assert after.attempts[0].agent_id != second.agent_id
    else:  # the frozen attempt left no trace but its run file; the record is the second's
        assert after.agent_id == second.agent_id
        assert after.attempts[-1].outcome == "succeeded"
    assert msgspec.json.decode(after.result or b"") == {"n": 7, "pid": 0, "attempt": n}
    stopped = (runs / f"cancelled.{ref.task_id}.{first.pid}").exists()
    if not handler_returns:
        assert stopped  # the stale handler was cancelled, not left running


async def test_an_idle_agent_pulls_again_after_a_server_restart():
    """The server forgets open pull requests when it restarts; an agent that was waiting
    on one must notice and ask again, or it never sees another task."""
    async with NatsServer() as server:
        settings = fast(server.url)
        agent = Agent("idle", settings=settings)

        @agent.task("idle.op")
        async def op(payload: dict[str, Any]) -> dict[str, Any]:
            return payload

        async with agent, Client(settings=settings) as client:
            assert await (await client.submit("idle.op", {"n": 1})).result(timeout=30) == {"n": 1}
            await server.akill()
            await eventually(lambda: not client.connected and not agent.client.connected)
            await server.astart()
            await eventually(lambda: client.connected and agent.client.connected, timeout=30)
            ref = await client.submit("idle.op", {"n": 2})
            assert await ref.result(timeout=60) == {"n": 2}


async def test_a_caller_waits_through_a_server_outage():
    """``result()`` rides through an outage longer than one request (each status read
    fails meanwhile) instead of ending early with a false timeout; a read while the
    server is gone raises ConnectionFailed, a ReachError, not a nats-py error."""
    async with NatsServer() as server:
        settings = fast(server.url)
        agent = Agent("after-outage", settings=settings)

        @agent.task("outage.op")
        async def op(payload: dict[str, Any]) -> dict[str, Any]:
            return payload

        async with Client(settings=settings) as client:
            ref = await client.submit("outage.op", {"n": 3})
            await server.akill()
            await eventually(lambda: not client.connected)
            waiting = asyncio.create_task(ref.result(timeout=300))
            try:
                for _ in range(2):  # the waiter's first read has failed by the second's end
                    with pytest.raises(reach.ConnectionFailed):
                        await ref.status()
                with pytest.raises(reach.ConnectionFailed):
                    await client.task(ref.task_id)
                assert not waiting.done()
                await server.astart()
                async with agent:
                    assert await waiting == {"n": 3}
            finally:
                waiting.cancel()
