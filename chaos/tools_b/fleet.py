"""The fleet around the load: registry processes and ``reach tasks init`` run with the
settings as ``REACH_*`` variables and stopped by PID, agents killed mid-task, faults timed
after a lease write, and a watch on the routing table's comings and goings."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import reach
from reach.testing import eventually

from ..harness import AgentProc

__all__ = [
    "RegistryProc",
    "TableWatch",
    "all_up",
    "kill_mid_task",
    "next_write",
    "reach_env",
    "tasks_init",
    "within",
]


def reach_env(settings: reach.ReachSettings) -> dict[str, str]:
    """This process's environment with ``REACH_*`` replaced by every setting in
    ``settings`` that differs from its default (JSON for the non-strings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    for name, value in settings.model_dump(exclude_defaults=True).items():
        env[f"REACH_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


async def within(condition: Any, timeout: float) -> float | None:
    """Seconds until ``condition`` (as for ``eventually``) held, or None if it did not
    within ``timeout``: for a goal that is checked, where a miss must not end the run."""
    started = time.monotonic()
    try:
        await eventually(condition, timeout=timeout)
    except TimeoutError:
        return None
    return time.monotonic() - started


async def next_write(client: reach.Client, agent_id: str, timeout: float = 30.0) -> None:
    """Returns as soon as the table sees a new write of ``agent_id``'s record (a renewed
    lease), to time a fault just after it."""
    async with asyncio.timeout(timeout):
        async for change in client.changes():
            if not isinstance(change, str) and change.info.agent_id == agent_id:
                return


async def all_up(client: reach.Client, agents: list[AgentProc], timeout: float = 60.0) -> None:
    """Wait until every agent in ``agents`` is UP in the table; if not, a RuntimeError that
    names those that are not, and those whose process ended (with its status)."""

    async def up() -> set[str]:
        return {r.info.agent_id for r in await client.agents() if r.status is reach.Status.UP}

    async def every() -> bool:
        return {a.agent_id for a in agents} <= await up()

    if await within(every, timeout) is None:
        seen = await up()
        missing = [
            a.agent_id
            + (
                f" (its process exited with status {a.proc.returncode})"
                if a.proc is not None and a.proc.returncode is not None
                else ""
            )
            for a in agents
            if a.agent_id not in seen
        ]
        raise RuntimeError(f"not UP within {timeout} s: {', '.join(missing)}")


async def tasks_init(settings: reach.ReachSettings, timeout: float = 120.0) -> int:
    """``reach tasks init`` (the deploy-time step that makes the task streams and buckets)
    in a process, run again until it succeeds (a young cluster may not answer JetStream
    requests in time); how many runs it took. Each run is stopped by PID if it hangs."""
    tries = 0

    async def made() -> bool:
        nonlocal tries
        tries += 1
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "reach.cli", "tasks", "init"),
            env=reach_env(settings),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            async with asyncio.timeout(60):
                return await proc.wait() == 0
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return False

    await eventually(made, timeout=timeout)
    return tries


async def kill_mid_task(agent: AgentProc, timeout: float = 60.0) -> int:
    """SIGKILL ``agent`` right after it starts running a task (a new execution file of its
    PID), so that it dies with work in hand; its PID."""
    pid = agent.pid
    before = set(agent.runs.glob(f"*.{pid}"))
    await eventually(lambda: any(p not in before for p in agent.runs.glob(f"*.{pid}")), timeout)
    await agent.kill()
    return pid


class TableWatch:
    """Follows the routing table: per agent id, how often it left and which statuses other
    than UP it had, so a scenario can tell "stayed" from "came back"."""

    def __init__(self, client: reach.Client) -> None:
        self.client = client
        self.left: Counter[str] = Counter()
        self.statuses: dict[str, set[reach.Status]] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> TableWatch:
        await self.client.agents()  # the table is there before the first change
        self._task = asyncio.ensure_future(self._follow())
        return self

    async def _follow(self) -> None:
        async for change in self.client.changes():
            if isinstance(change, str):
                self.left[change] += 1
            else:
                self.statuses.setdefault(change.info.agent_id, set()).add(change.status)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # bounded: a cancel lost inside nats-py must not hold the scenario
            done, _ = await asyncio.wait({self._task}, timeout=10)
            if done and not self._task.cancelled():
                self._task.result()  # it failed: say so, as an await would have

    def summary(self, agent_ids: list[str]) -> str:
        parts = []
        for a in agent_ids:
            seen = sorted(s.value for s in self.statuses.get(a, set()) if s is not reach.Status.UP)
            parts.append(f"{a} left {self.left[a]}x{', was ' + '/'.join(seen) if seen else ''}")
        return "; ".join(parts)


class RegistryProc:
    """A registry in a process of its own (``python -m reach.cli registry``), with the
    settings as ``REACH_*`` variables, stopped by PID. Ready once it says so on stderr
    (its log file)."""

    def __init__(self, settings: reach.ReachSettings, log: Path) -> None:
        self.settings = settings
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 60.0) -> RegistryProc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "reach.cli",
                "registry",
                env=reach_env(self.settings),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=out,
            )
        pid = self.proc.pid

        def ready() -> bool:
            if self.proc is None or self.proc.returncode is not None:
                raise RuntimeError(f"registry process {pid} ended; see {self.log}")
            return "# registry " in self.log.read_text(errors="replace")

        try:
            await eventually(ready, timeout=timeout)
        except BaseException:
            await self.kill()
            raise
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def kill(self) -> None:
        """SIGKILL by PID, then reap it."""
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            await self.proc.wait()

    async def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it does not end in ``timeout``."""
        if self.proc is None or self.proc.returncode is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout):
                await self.proc.wait()
        except TimeoutError:
            await self.kill()
