"""The soak: mixed requests, broadcasts and durable tasks for minutes, with agents
churning, every process's memory watched.

    python -m chaos.soak [--minutes 10] [--churn 20]

Reports throughput and p99, the RSS of every process at the end of the warm-up and at
the end (goal: none grows more than 10% after warm-up), and lost and duplicated items
(goal: 0 lost). Exit status 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import reach
from reach.testing import NatsServer, eventually

from .harness import AgentProc, Ledger, Result, known, settings_for, steady_load

WARMUP = 0.2  # share of the run before memory is first measured


def rss_kib(pid: int) -> int:
    """Resident memory of a process (Linux /proc), in KiB; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return 0
    return 0


async def registry_proc(settings: reach.ReachSettings) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env |= {"REACH_SUBJECT_PREFIX": settings.subject_prefix, "REACH_LOG_LEVEL": "WARNING"}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "reach.cli", "registry", "--url", settings.nats_url,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


async def check_ended(client: reach.Client, unchecked: dict[str, float]) -> int:
    """Read the record of every task submitted over 3 s ago; forget those that ended
    (how many SUCCEEDED); the others are read again next time."""
    succeeded, horizon = 0, time.monotonic() - 3
    for task_id in [t for t, at in unchecked.items() if at < horizon]:
        rec = await client.task_record(task_id)
        if rec.state in (
            reach.TaskState.SUCCEEDED,
            reach.TaskState.FAILED,
            reach.TaskState.CANCELLED,
        ):
            succeeded += rec.state is reach.TaskState.SUCCEEDED
            del unchecked[task_id]
    return succeeded


async def soak(minutes: float, churn: float, work: Path) -> Result:
    result = Result("soak")
    ledger = Ledger()
    tasks_sent: list[str] = []
    heard = done = 0
    unchecked: dict[str, float] = {}  # task id -> when submitted, until its end is read
    async with NatsServer() as server:
        # Records are kept a minute, not a day: the server's memory holds what is stored,
        # so only with retention shorter than the run is a steady state reached to judge
        settings = settings_for(
            server.url, "soak", task_retention=60.0, task_timeout=30.0, task_idempotency_ttl=60.0
        )
        registry = await registry_proc(settings)
        agents = [AgentProc(settings, f"soak-{i}", work / "runs") for i in range(3)]
        try:
            async with reach.Client(settings=settings, name="soak") as client:
                for a in agents:
                    await a.start()
                await eventually(lambda: known(client, "chaos.echo", 3), timeout=60)

                topic = await client.subscribe("soak.news")

                async def listen() -> None:
                    nonlocal heard
                    async for _ in topic:
                        heard += 1

                listener = asyncio.ensure_future(listen())
                stop = asyncio.Event()
                load = asyncio.ensure_future(steady_load(client, "chaos.echo", ledger, stop))

                async def broadcasts_and_tasks() -> None:
                    n = 0
                    while not stop.is_set():
                        n += 1
                        await client.publish("soak.news", {"n": n})
                        if n % 5 == 0:
                            ref = await client.submit("chaos.job", {"n": n, "ms": 5})
                            tasks_sent.append(ref.task_id)
                            unchecked[ref.task_id] = time.monotonic()
                        await asyncio.sleep(0.02)

                side = asyncio.ensure_future(broadcasts_and_tasks())
                started = time.monotonic()
                total = minutes * 60
                pids = {
                    "nats-server": server.pid,
                    "registry": registry.pid,
                    "soak client": os.getpid(),
                }
                warm: dict[str, int] = {}
                next_churn, victim = started + churn, 0
                next_check = started + 5
                while (elapsed := time.monotonic() - started) < total:
                    if not warm and elapsed >= WARMUP * total:
                        warm = {name: rss_kib(pid) for name, pid in pids.items()}
                        warm |= {a.agent_id: rss_kib(a.pid) for a in agents}
                    if churn and time.monotonic() >= next_churn:
                        # churn: drain one agent and start a fresh one with the same id
                        a = agents[victim % len(agents)]
                        await a.stop()
                        await a.start()
                        victim += 1
                        next_churn = time.monotonic() + churn
                    if time.monotonic() >= next_check:
                        # records live a minute: read each task's end while it is there
                        done += await check_ended(client, unchecked)
                        next_check = time.monotonic() + 5
                    await asyncio.sleep(0.5)
                end = {name: rss_kib(pid) for name, pid in pids.items()}
                end |= {a.agent_id: rss_kib(a.pid) for a in agents}
                stop.set()
                await asyncio.gather(load, side)
                await topic.unsubscribe()
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
                for task_id in list(unchecked):
                    rec = await (await client.task(task_id)).wait(timeout=30)
                    done += rec.state is reach.TaskState.SUCCEEDED
                elapsed = time.monotonic() - started
        finally:
            for a in agents:
                await a.stop()
            if registry.returncode is None:
                registry.terminate()
                await registry.wait()
    ledger.into(result)
    runs: dict[str, int] = {}
    for f in (work / "runs").iterdir():
        task_id = f.name.split(".")[0]
        runs[task_id] = runs.get(task_id, 0) + 1
    result.lost += len(tasks_sent) - done
    result.duplicated = sum(n - 1 for t, n in runs.items() if t in set(tasks_sent) and n > 1)
    result.notes.append(
        f"{elapsed:.0f} s, {ledger.ok / elapsed:,.0f} requests/s answered, {heard:,} broadcasts"
        f" heard, {len(tasks_sent)} tasks ({done} SUCCEEDED), {victim} agent restarts"
    )
    for name, before in sorted(warm.items()):
        after = end.get(name, 0)
        if name.startswith("soak-"):
            result.notes.append(f"RSS {name}: {before:,} -> {after:,} KiB (restarted: not judged)")
            continue
        growth = (after - before) / before if before else 0.0
        result.check(f"RSS of {name} grows <= 10% after warm-up", growth <= 0.10,
                     f"{before:,} -> {after:,} KiB ({growth:+.1%})")  # fmt: skip
    result.check("every task SUCCEEDED", done == len(tasks_sent))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--churn", type=float, default=20.0, help="seconds between restarts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="reach-soak-") as tmp:
        result = asyncio.run(soak(args.minutes, args.churn, Path(tmp)))
    print(result.line())
    for note in result.notes:
        print(f"    {note}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
