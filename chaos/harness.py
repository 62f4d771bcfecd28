"""What every scenario shares: a ledger that accounts for every request and task, agent
processes to kill, stop and restart, steady load, and the one-line result."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import reach

__all__ = ["AgentProc", "Ledger", "Result", "Scenario", "settings_for", "steady_load"]

AGENT_SCRIPT = Path(__file__).with_name("agent_proc.py")


def settings_for(url: str, prefix: str, **kw: Any) -> reach.ReachSettings:
    """Short intervals, so failures show in seconds (as in the demo)."""
    base: dict[str, Any] = {
        "nats_url": url,
        "subject_prefix": prefix,
        "heartbeat_interval": 0.5,
        "lease_ttl": 2.0,
        "probe_timeout": 0.5,
        "down_grace": 2.0,
        "task_ack_wait": 2.0,
        "task_sweep_interval": 2.0,
        "timeout_ms": 3000,
    }
    base.update(kw)
    return reach.ReachSettings(**base)


@dataclass
class Result:
    """What one scenario did; ``line()`` is the suite's output format."""

    scenario: str
    sent: int = 0
    ok: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    p99_ms: float = 0.0
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(self.checks.values()) and self.lost == 0

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks[name] = ok
        if detail or not ok:
            self.notes.append(
                f"{'ok' if ok else 'FAILED'}: {name}{': ' + detail if detail else ''}"
            )

    def line(self) -> str:
        return (
            f"{self.scenario}: {'PASS' if self.passed else 'FAIL'}, sent {self.sent}, ok {self.ok},"
            f" failed {self.failed}, lost {self.lost}, duplicated {self.duplicated},"
            f" p99 {self.p99_ms:.1f} ms"
        )


class Ledger:
    """Every item sent, and what came of it: answered, failed (with a clear error), or
    neither (lost). Durable tasks: executions counted per id (duplicates)."""

    def __init__(self) -> None:
        self.sent = 0
        self.ok = 0
        self.failed: dict[str, int] = {}
        #: latency in 0.1 ms steps -> count: p99 of any number of requests in bounded memory
        self.latencies: dict[int, int] = {}
        self.executions: dict[str, int] = {}

    def answered(self, seconds: float) -> None:
        self.ok += 1
        step = int(seconds * 10_000)
        self.latencies[step] = self.latencies.get(step, 0) + 1

    def quantile(self, q: float) -> float:
        """Seconds below which ``q`` of the answered requests took."""
        total = sum(self.latencies.values())
        seen = 0
        for step in sorted(self.latencies):
            seen += self.latencies[step]
            if seen >= q * total:
                return step / 10_000
        return 0.0

    @property
    def slowest(self) -> float:
        """Seconds the slowest answered request took (to 0.1 ms)."""
        return max(self.latencies, default=0) / 10_000

    def refused(self, code: str) -> None:
        self.failed[code] = self.failed.get(code, 0) + 1

    def into(self, result: Result) -> Result:
        result.sent, result.ok = self.sent, self.ok
        result.failed = sum(self.failed.values())
        result.lost = self.sent - self.ok - result.failed
        result.p99_ms = self.quantile(0.99) * 1000
        if self.failed:
            result.notes.append(
                "failed by code: " + ", ".join(f"{k} {v}" for k, v in sorted(self.failed.items()))
            )
        return result


async def steady_load(
    client: reach.Client,
    capability: str,
    ledger: Ledger,
    stop: asyncio.Event,
    *,
    concurrency: int = 8,
    timeout: float = 3.0,
    pause: float = 0.005,
) -> None:
    """``concurrency`` callers, each sending a request, then another, until ``stop``."""

    async def caller(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            ledger.sent += 1
            started = time.perf_counter()
            try:
                await client.request(  # the echo may run twice (another instance)
                    capability, {"caller": n, "i": i}, timeout=timeout, idempotent=True
                )
            except reach.ReachError as exc:
                ledger.refused(exc.code)
            else:
                ledger.answered(time.perf_counter() - started)
            await asyncio.sleep(pause)

    await asyncio.gather(*(caller(n) for n in range(concurrency)))


class AgentProc:
    """One agent in a process of its own (``agent_proc.py``), stopped by PID."""

    def __init__(self, settings: reach.ReachSettings, agent_id: str, runs: Path, *args: str):
        self.settings = settings
        self.agent_id = agent_id
        self.runs = runs
        self.args = args
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> AgentProc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
        s = self.settings
        env |= {
            "REACH_NATS_URL": s.nats_url,
            "REACH_SUBJECT_PREFIX": s.subject_prefix,
            "REACH_HEARTBEAT_INTERVAL": str(s.heartbeat_interval),
            "REACH_LEASE_TTL": str(s.lease_ttl),
            "REACH_TASK_ACK_WAIT": str(s.task_ack_wait),
            "REACH_TASK_RETENTION": str(s.task_retention),
            "REACH_TASK_TIMEOUT": str(s.task_timeout),
            "REACH_TASK_IDEMPOTENCY_TTL": str(s.task_idempotency_ttl),
            "REACH_REPLICAS": str(s.replicas),  # on a cluster, what it makes is R3 too
            "REACH_DRAIN_TIMEOUT": "10",
            **self.extra_env(),
        }
        self.runs.mkdir(parents=True, exist_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(AGENT_SCRIPT),
            self.agent_id,
            str(self.runs),
            *self.args,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        return self

    def extra_env(self) -> dict[str, str]:
        """More REACH_* for the process (subclasses: a metrics port, say)."""
        return {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, sig)

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            await self.proc.wait()

    async def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (a graceful drain), then SIGKILL if it does not end in ``timeout``."""
        if self.proc is None or self.proc.returncode is not None:
            return self.proc.returncode if self.proc else None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout):
                return await self.proc.wait()
        except TimeoutError:
            await self.kill()
            return None


async def known(
    client: reach.Client, capability: str, n: int, status: reach.Status = reach.Status.UP
) -> bool:
    return sum(r.status is status for r in await client.agents(capability)) >= n


Scenario = Callable[[str, Path, bool], Awaitable[Result]]
