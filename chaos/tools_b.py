"""What the server, cluster, registry and partition scenarios share: request load that times
every request against its own deadline, durable task load that follows every task to its
end, registry processes stopped by PID, and a watch on the routing table's comings and
goings. Every item is in a ``Ledger``; ``account`` puts requests and tasks into one
``Result``, with the p99 of the requests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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

from .harness import AgentProc, Ledger, Result

__all__ = [
    "RegistryProc",
    "RequestLoad",
    "TableWatch",
    "TaskLoad",
    "account",
    "all_up",
    "examples",
    "executions",
    "kill_mid_task",
    "next_write",
    "reach_env",
    "tasks_init",
    "within",
]

#: a request or submit still running this long past its own deadline is "hung": counted,
#: and given up on so that the scenario ends
HANG = 30.0


def reach_env(settings: reach.ReachSettings) -> dict[str, str]:
    """This process's environment with ``REACH_*`` replaced by every setting in
    ``settings`` that differs from its default (JSON for the non-strings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    for name, value in settings.model_dump(exclude_defaults=True).items():
        env[f"REACH_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


class RequestLoad:
    """``concurrency`` callers of ``capability``, one request after another, until
    ``stop()``. Each request is timed against its ``timeout``: ``worst_overrun`` is the
    most any took past it, ``overdue`` how many took more than ``slack`` past it. An error
    that is not a ``ReachError`` is ``unclear`` (counted by type, and failed)."""

    def __init__(
        self,
        client: reach.Client,
        capability: str,
        ledger: Ledger,
        *,
        concurrency: int = 8,
        timeout: float = 3.0,
        pause: float = 0.005,
        slack: float = 1.0,
    ) -> None:
        self.client = client
        self.capability = capability
        self.ledger = ledger
        self.concurrency = concurrency
        self.timeout = timeout
        self.pause = pause
        self.slack = slack
        self.overdue = 0
        self.worst_overrun = 0.0
        self.unclear: Counter[str] = Counter()
        #: the first message of each error code, for the notes
        self.examples: dict[str, str] = {}
        #: (monotonic end, seconds taken) of every answer; monotonic times of every failure
        self.answers: list[tuple[float, float]] = []
        self.failed_at: list[float] = []
        #: answers by the agent that gave them (the ``by`` of ``chaos.echo``)
        self.by: Counter[str] = Counter()
        self._stop = asyncio.Event()
        self._task: asyncio.Future[Any] | None = None

    def start(self) -> RequestLoad:
        self._task = asyncio.ensure_future(
            asyncio.gather(*(self._caller(n) for n in range(self.concurrency)))
        )
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    def failed_between(self, start: float, end: float = float("inf")) -> int:
        return sum(start <= t < end for t in self.failed_at)

    def answered_since(self, start: float) -> int:
        return sum(t >= start for t, _ in self.answers)

    def slowest_between(self, start: float, end: float = float("inf")) -> float:
        """The longest time an answer took, of those that came between ``start`` and
        ``end`` (seconds; 0 if none)."""
        return max((took for t, took in self.answers if start <= t < end), default=0.0)

    async def _caller(self, n: int) -> None:
        ledger, i = self.ledger, 0
        while not self._stop.is_set():
            i += 1
            ledger.sent += 1
            started = time.perf_counter()
            try:
                async with asyncio.timeout(self.timeout + HANG):
                    value = await self.client.request(
                        self.capability, {"caller": n, "i": i}, timeout=self.timeout
                    )
            except reach.ReachError as exc:
                ledger.refused(exc.code)
                self.examples.setdefault(exc.code, str(exc)[:160])
                self.failed_at.append(time.monotonic())
            except TimeoutError:  # our guard, not the request's deadline: it hung
                ledger.refused("hung")
                self.unclear["hung"] += 1
                self.failed_at.append(time.monotonic())
            except Exception as exc:  # counted and reported: the goal is clear errors only
                ledger.refused(f"unclear {type(exc).__name__}")
                self.unclear[type(exc).__name__] += 1
                self.failed_at.append(time.monotonic())
            else:
                took = time.perf_counter() - started
                ledger.answered(took)
                self.answers.append((time.monotonic(), took))
                self.by[value.get("by", "?") if isinstance(value, dict) else "?"] += 1
            took = time.perf_counter() - started
            self.worst_overrun = max(self.worst_overrun, took - self.timeout)
            if took > self.timeout + self.slack:
                self.overdue += 1
            await asyncio.sleep(self.pause)

    def per_phase(self, marks: list[tuple[str, float]]) -> str:
        """Failed requests in each phase; ``marks`` are (name, monotonic start), in order."""
        ends = [t for _, t in marks[1:]] + [float("inf")]
        return "failed requests by phase: " + ", ".join(
            f"{name} {self.failed_between(t, end)}"
            for (name, t), end in zip(marks, ends, strict=True)
        )

    def notes(self) -> str:
        return (
            f"worst request {self.worst_overrun * 1000:+.0f} ms past its {self.timeout:.1f} s"
            f" deadline, {self.overdue} more than {self.slack:.1f} s past"
        )


class TaskLoad:
    """Durable tasks of ``capability`` submitted one after another until ``stop()``; then
    ``settle()`` follows each to its end. In the ledger: SUCCEEDED is ok; a submit that
    raised a ``ReachError`` is failed with its code (it said so); a task that ended
    otherwise is failed as ``task <STATE>``; one with no end within ``settle``'s timeout
    is neither: lost. ``accepted_at`` (monotonic) gives the write gaps."""

    def __init__(
        self,
        client: reach.Client,
        capability: str,
        ledger: Ledger,
        *,
        job_ms: int = 20,
        pause: float = 0.02,
    ) -> None:
        self.client = client
        self.capability = capability
        self.ledger = ledger
        self.job_ms = job_ms
        self.pause = pause
        self.refs: list[reach.TaskRef] = []
        self.accepted_at: list[float] = []
        self.unclear: Counter[str] = Counter()
        #: the first message of each error code, for the notes
        self.examples: dict[str, str] = {}
        self.ended: Counter[str] = Counter()
        #: the final record of every task that ended (after ``settle``)
        self.records: list[reach.TaskRecord] = []
        self.started_at = 0.0
        self.stopped_at = 0.0
        self._stop = asyncio.Event()
        self._task: asyncio.Future[None] | None = None

    def start(self) -> TaskLoad:
        self.started_at = time.monotonic()
        self._task = asyncio.ensure_future(self._submitter())
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        self.stopped_at = time.monotonic()

    async def _submitter(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.ledger.sent += 1
            try:
                async with asyncio.timeout(HANG):
                    ref = await self.client.submit(self.capability, {"n": n, "ms": self.job_ms})
            except reach.ReachError as exc:
                self.ledger.refused(f"submit {exc.code}")
                self.examples.setdefault(exc.code, str(exc)[:160])
            except TimeoutError:
                self.ledger.refused("submit hung")
                self.unclear["submit hung"] += 1
            except Exception as exc:  # counted and reported: the goal is clear errors only
                self.ledger.refused(f"submit unclear {type(exc).__name__}")
                self.unclear[type(exc).__name__] += 1
            else:
                self.refs.append(ref)
                self.accepted_at.append(time.monotonic())
            await asyncio.sleep(self.pause)

    def longest_gap(self, start: float | None = None, end: float | None = None) -> float:
        """The longest time without an accepted submit between ``start`` and ``end``
        (default: while the load ran)."""
        lo = self.started_at if start is None else start
        hi = self.stopped_at if end is None else end
        marks = [lo, *(t for t in self.accepted_at if lo < t < hi), hi]
        return max(b - a for a, b in itertools.pairwise(marks))

    def accepted_since(self, start: float) -> int:
        return sum(t >= start for t in self.accepted_at)

    async def settle(self, timeout: float = 120.0, concurrency: int = 32) -> None:
        """Wait for every accepted task's end (all within ``timeout`` in all)."""
        gate = asyncio.Semaphore(concurrency)
        deadline = time.monotonic() + timeout

        async def one(ref: reach.TaskRef) -> None:
            async with gate:
                try:
                    rec = await ref.wait(timeout=max(1.0, deadline - time.monotonic()))
                except reach.RequestTimeout:
                    self.ended["no end"] += 1
                    return  # lost: neither ok nor failed
                except reach.ReachError as exc:
                    self.ended[f"unreadable {exc.code}"] += 1
                    return
            self.ended[str(rec.state)] += 1
            self.records.append(rec)
            if rec.state is reach.TaskState.SUCCEEDED:
                self.ledger.answered(max(0, rec.updated_ms - rec.submitted_ms) / 1000)
            else:
                self.ledger.refused(f"task {rec.state}")

        await asyncio.gather(*(one(ref) for ref in self.refs))


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


def examples(*loads: RequestLoad | TaskLoad) -> list[str]:
    """One note per error code seen: what the first error of that code said."""
    out = []
    for load in loads:
        kind = "request" if isinstance(load, RequestLoad) else "submit"
        out += [f"first {kind} {code}: {text}" for code, text in load.examples.items()]
    return out


async def kill_mid_task(agent: AgentProc, timeout: float = 60.0) -> int:
    """SIGKILL ``agent`` right after it starts running a task (a new execution file of its
    PID), so that it dies with work in hand; its PID."""
    pid = agent.pid
    before = set(agent.runs.glob(f"*.{pid}"))
    await eventually(lambda: any(p not in before for p in agent.runs.glob(f"*.{pid}")), timeout)
    await agent.kill()
    return pid


def executions(runs: Path) -> Counter[str]:
    """Executions per task id, from the files ``agent_proc.py`` creates."""
    return Counter(p.name.rsplit(".", 2)[0] for p in runs.glob("*.*.*"))


def account(result: Result, requests: Ledger, tasks: Ledger, runs: Path | None = None) -> Result:
    """Requests and tasks into one result; p99 of the requests; duplicates from ``runs``."""
    for kind, ledger in (("requests", requests), ("tasks", tasks)):
        failed = sum(ledger.failed.values())
        lost = ledger.sent - ledger.ok - failed
        result.sent += ledger.sent
        result.ok += ledger.ok
        result.failed += failed
        result.lost += lost
        codes = ", ".join(f"{k} {v}" for k, v in sorted(ledger.failed.items()))
        result.notes.append(
            f"{kind}: sent {ledger.sent}, ok {ledger.ok}, failed {failed}"
            f"{' (' + codes + ')' if codes else ''}, lost {lost}"
        )
    lat = sorted(requests.latencies)
    result.p99_ms = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else 0.0
    if runs is not None:
        result.duplicated = sum(n - 1 for n in executions(runs).values())
    return result


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
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

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
