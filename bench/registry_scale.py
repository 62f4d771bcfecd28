"""Registry at scale: N simulated agents heartbeating every 5 s against one registry process.

Reports the registry process's CPU (share of one core) and memory (RSS), and the
heartbeat-to-table lag: from the moment a simulated agent publishes a heartbeat to the
moment a client's routing table (a reach.Client, following the KV watch) holds that
heartbeat. Simulated agents, all in this process, register first (64 in flight), then
heartbeat on a uniform schedule.

    python bench/registry_scale.py [--agents 1000 10000] [--seconds 15] [--warmup 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import nats

import reach
from reach.testing import NatsServer
from reach.wire import AgentInfo, CapabilityInfo, Heartbeat, Registration

INTERVAL = 5.0
TICK = 0.01


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def start_registry(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The registry under test, in its own process so its CPU and memory are its own."""
    registry: subprocess.Popen[bytes] = subprocess.Popen(
        [sys.executable, "-m", "reach.cli", "registry"],
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert registry.stderr is not None
    while b"registry" not in registry.stderr.readline():
        pass
    # keep reading its log so a full pipe can never stall it
    threading.Thread(target=registry.stderr.read, daemon=True).start()
    return registry


async def run_once(url: str, n: int, seconds: float, warmup: float) -> dict[str, Any]:
    prefix = f"scale{n}"
    env = {
        **os.environ,
        "REACH_NATS_URL": url,
        "REACH_SUBJECT_PREFIX": prefix,
        "REACH_HEARTBEAT_INTERVAL": str(INTERVAL),
        "REACH_LEASE_TTL": str(3 * INTERVAL),
    }
    registry = start_registry(env)
    settings = reach.ReachSettings(
        nats_url=url, subject_prefix=prefix, heartbeat_interval=INTERVAL, lease_ttl=3 * INTERVAL
    )
    nc = await nats.connect(url)
    ids = [f"sim-{i:05d}" for i in range(n)]
    sent: dict[tuple[str, int], float] = {}
    lags: list[float] = []
    measuring = False
    try:
        # register everyone, 64 at a time
        sem = asyncio.Semaphore(64)

        async def register(agent_id: str) -> None:
            info = AgentInfo(
                agent_id=agent_id, name="sim", capabilities=[CapabilityInfo(name="sim.work")]
            )
            async with sem:
                await nc.request(
                    f"{prefix}.registry.register.{agent_id}",
                    msgspec.json.encode(Registration(info=info)),
                    timeout=30,
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(register(i) for i in ids))
        register_s = time.perf_counter() - t0

        async with reach.Client(settings=settings) as client:
            await client.agents()  # start the table

            async def observe() -> None:
                async for change in client.changes():
                    if isinstance(change, str) or change.heartbeat is None:
                        continue
                    key = (change.info.agent_id, change.heartbeat.seq)
                    at = sent.pop(key, None)
                    if at is not None and measuring:
                        lags.append(time.perf_counter() - at)

            observer = asyncio.ensure_future(observe())
            per_tick = n * TICK / INTERVAL
            seq = 0
            carry = 0.0
            cursor = 0
            start = time.perf_counter()
            cpu0 = wall0 = 0.0
            heartbeats = 0
            next_tick = start
            while True:
                now = time.perf_counter()
                if not measuring and now - start >= warmup:
                    measuring = True
                    cpu0, wall0 = proc_cpu_seconds(registry.pid), now
                    heartbeats = 0
                if now - start >= warmup + seconds:
                    break
                carry += per_tick
                batch, carry = int(carry), carry - int(carry)
                for _ in range(batch):
                    agent_id = ids[cursor]
                    cursor += 1
                    if cursor == n:
                        cursor, seq = 0, seq + 1
                    hb = Heartbeat(agent_id=agent_id, seq=seq + 1, load=0.25, latency_ms=12.0)
                    sent[(agent_id, seq + 1)] = time.perf_counter()
                    await nc.publish(f"{prefix}.hb.{agent_id}", msgspec.json.encode(hb))
                    heartbeats += 1
                next_tick += TICK
                await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))
            cpu = (proc_cpu_seconds(registry.pid) - cpu0) / (time.perf_counter() - wall0)
            rss = proc_rss_mb(registry.pid)
            await asyncio.sleep(1.0)  # let the last updates arrive before stopping
            observer.cancel()
    finally:
        registry.terminate()
        registry.wait(10)
        await nc.close()
    return {
        "agents": n,
        "register_s": round(register_s, 2),
        "heartbeats_per_s": round(heartbeats / seconds),
        "registry_cpu_core": round(cpu, 3),
        "registry_rss_mb": round(rss, 1),
        "lag_samples": len(lags),
        "lag_p50_ms": round(pct(lags, 0.5) * 1000, 2),
        "lag_p99_ms": round(pct(lags, 0.99) * 1000, 2),
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    with NatsServer() as server:
        for n in args.agents:
            results.append(await run_once(server.url, n, args.seconds, args.warmup))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"{'agents':>7} {'hb/s':>6} {'registry CPU':>13} {'RSS MB':>7} "
        f"{'lag p50 ms':>11} {'lag p99 ms':>11} {'samples':>8} {'register s':>10}"
    )
    for r in results:
        print(
            f"{r['agents']:>7} {r['heartbeats_per_s']:>6} {r['registry_cpu_core']:>12.0%} "
            f"{r['registry_rss_mb']:>7.1f} {r['lag_p50_ms']:>11.2f} {r['lag_p99_ms']:>11.2f} "
            f"{r['lag_samples']:>8} {r['register_s']:>10.2f}"
        )
    print("goal: 10,000 agents under one core, lag p99 under 1 s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
