"""Routing benchmarks: decision cost, overhead, a skewed fleet, and a SIGKILL under load.

    python bench/routing.py decision [--sizes 10 100 1000]
    python bench/routing.py overhead [--rounds 5 --seconds 2]   (3 instances)
    python bench/routing.py skewed   [--rounds 3 --seconds 4 --png bench/results/skewed.png]
                                     (default heartbeat interval; --no-png without matplotlib)
    python bench/routing.py failure  [--rate 500 --seconds 30 --kill-at 10]
    python bench/routing.py all

Everything runs against one local nats-server and a registry; agents live in child
processes, the client in this one. Ratios compare runs made in the same process run.
Settings are the defaults (5 s heartbeats, 15 s leases), whatever REACH_* variables or .env
say, except where a bench says otherwise: `decision` keeps its simulated leases alive while
it measures. The settings in effect are printed first, under "setup".
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import nats
from _fleet import (
    Children,
    clean_environ,
    closed_loop,
    defaults,
    open_loop,
    pct,
    whole_fleet,
)

import reach
from reach.testing import NatsServer, eventually
from reach.wire import AgentInfo, CapabilityInfo, Heartbeat, Registration

RESULTS = Path(__file__).parent / "results"


# -- decision cost ----------------------------------------------------------------------


async def decision(url: str, sizes: list[int], picks: int) -> list[dict[str, Any]]:
    out = []
    for n in sizes:
        s = defaults(url, f"dec{n}", lease_ttl=600.0)  # no expiry while measuring
        async with reach.Registry(settings=s), reach.Client(settings=s) as client:
            nc = client.nc
            for i in range(n):
                aid = f"sim-{i:04d}"
                info = AgentInfo(
                    agent_id=aid,
                    name="sim",
                    max_concurrency=8,
                    capabilities=[CapabilityInfo(name="sim.work")],
                )
                await nc.request(
                    f"dec{n}.registry.register.{aid}",
                    msgspec.json.encode(Registration(info=info)),
                    timeout=10,
                )
                hb = Heartbeat(
                    agent_id=aid, load=(i % 10) / 10, latency_ms=5 + i % 7, queue_len=i % 3
                )
                await nc.publish(f"dec{n}.hb.{aid}", msgspec.json.encode(hb))

            async def ready(n: int = n) -> bool:
                records = await client.agents("sim.work")
                return len(records) == n and all(r.heartbeat for r in records)

            await eventually(ready, timeout=60)
            row: dict[str, Any] = {"instances": n}
            for policy in ("balanced", "scored"):
                count = picks if policy == "balanced" else max(200, picks // (n // 10 or 1))
                for _ in range(200):
                    await client.pick("sim.work", routing=policy)
                t0 = time.perf_counter()
                for _ in range(count):
                    await client.pick("sim.work", routing=policy)
                row[f"{policy}_us"] = round((time.perf_counter() - t0) / count * 1e6, 2)
            out.append(row)
    return out


# -- agents in a child process ---------------------------------------------------------


def fleet(
    url: str, prefix: str, delays: list[float], concurrency: int, ready: Any, stop: Any
) -> None:
    """Agents of capability bench.work, one per delay (seconds of simulated work)."""

    async def main() -> None:
        s = defaults(url, prefix)
        nc = await nats.connect(url)

        async def raw(msg: Any) -> None:
            await nc.publish(msg.reply, msgspec.json.encode(msgspec.json.decode(msg.data)))

        await nc.subscribe(f"{prefix}.raw", cb=raw)
        registry = reach.Registry(settings=s)
        await registry.start()
        agents = []
        for i, delay in enumerate(delays):
            agent = reach.Agent(
                "bench", f"bench-{i}", settings=s, max_concurrency=concurrency, max_queue=4096
            )

            def handler(d: float) -> Any:
                async def work(value: dict[str, Any]) -> dict[str, Any]:
                    if d:
                        await asyncio.sleep(d)
                    return value

                return work

            agent.capability("bench.work")(handler(delay))
            await agent.start()
            agents.append(agent)
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        for agent in agents:
            await agent.stop()
        await registry.stop()
        await nc.close()

    asyncio.run(main())


def agents(url: str, prefix: str, delays: list[float], concurrency: int) -> Children:
    """The registry and agents of ``fleet`` in one child process; enter it to start them."""
    children = Children(stop_timeout=20)
    children.add(fleet, url, prefix, delays, concurrency)
    return children


# -- overhead: balanced vs queue vs raw ------------------------------------------------


async def overhead(url: str, rounds: int, seconds: float) -> dict[str, Any]:
    prefix = "ovh"
    instances = 3
    body = msgspec.json.encode({"order_id": "A-1", "note": "x" * 200})
    with agents(url, prefix, [0.0] * instances, 64):
        nc = await nats.connect(url)
        async with reach.Client(settings=defaults(url, prefix)) as client:
            await whole_fleet(client, instances)

            async def raw() -> None:
                msg = await nc.request(f"{prefix}.raw", body, timeout=5)
                msgspec.json.decode(msg.data)

            async def queue() -> None:
                await client.request("bench.work", body, routing="queue")

            async def balanced() -> None:
                await client.request("bench.work", body, routing="balanced")

            fns = {"raw": raw, "queue": queue, "balanced": balanced}
            for fn in fns.values():
                await closed_loop(fn, 0.5, 8)
            res: dict[str, dict[str, list[float]]] = {k: {"seq": [], "conc": []} for k in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    res[name]["seq"].append((await closed_loop(fn, seconds, 1))[0])
                    res[name]["conc"].append((await closed_loop(fn, seconds, 64))[0])
        await nc.close()
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    return {
        "instances": instances,
        "throughput": {k: {m: round(v) for m, v in r.items()} for k, r in med.items()},
        "balanced_vs_queue_seq": round(med["balanced"]["seq"] / med["queue"]["seq"], 3),
        "balanced_vs_queue_64": round(med["balanced"]["conc"] / med["queue"]["conc"], 3),
        "balanced_vs_raw_64": round(med["balanced"]["conc"] / med["raw"]["conc"], 3),
    }


# -- skewed fleet ------------------------------------------------------------------------


async def skewed(
    url: str, rounds: int, seconds: float, png: Path | None, rate: float = 800.0
) -> dict[str, Any]:
    prefix = "skew"
    delays = [0.002, 0.002, 0.002, 0.010]  # one instance 5x slower
    policies = ("queue", "scored", "balanced")
    lat: dict[str, list[float]] = {p: [] for p in policies}
    rates: dict[str, list[float]] = {p: [] for p in policies}
    share: dict[str, dict[str, int]] = {p: {} for p in policies}
    with agents(url, prefix, delays, 8):
        async with reach.Client(settings=defaults(url, prefix)) as client:
            await whole_fleet(client, len(delays))
            for policy in policies:  # warm up: heartbeats and this client's EWMAs

                async def warm(p: str = policy) -> None:
                    await client.request("bench.work", {}, routing=p)

                await closed_loop(warm, 1.0, 16)
            for _ in range(rounds):
                for policy in policies:

                    async def one(p: str = policy) -> None:
                        r = await client.call("bench.work", {}, routing=p)
                        share[p][r.agent_id] = share[p].get(r.agent_id, 0) + 1

                    # latency at the same offered load for every policy
                    lat[policy].extend(await open_loop(one, rate, seconds))
                    # throughput with 16 in flight
                    r, _ = await closed_loop(one, seconds, 16)
                    rates[policy].append(r)
    out = {
        p: {
            "req_per_s_16_inflight": round(statistics.median(rates[p])),
            "p50_ms": round(pct(lat[p], 0.5), 2),
            "p99_ms": round(pct(lat[p], 0.99), 2),
            "slow_share": round(share[p].get("bench-3", 0) / max(1, sum(share[p].values())), 3),
        }
        for p in policies
    }
    out["balanced_p99_vs_queue"] = round(out["balanced"]["p99_ms"] / out["queue"]["p99_ms"], 3)
    out["heartbeat_interval_s"] = defaults(url, prefix).heartbeat_interval  # the default
    if png is not None:
        chart(lat, png)
        out["png"] = str(png)
    return out


def chart(lat: dict[str, list[float]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for policy, values in lat.items():
        ordered = sorted(values)
        ys = [i / len(ordered) for i in range(len(ordered))]
        ax.plot(ordered, ys, label=f"{policy} (p99 {pct(values, 0.99):.1f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title("4 instances, one 5x slower, same offered load: latency CDF per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# -- failure: SIGKILL one of three under steady load -----------------------------------

AGENT = """
import asyncio, sys
from reach import Agent, ReachSettings
settings = ReachSettings(_env_file=None, nats_url=sys.argv[2], subject_prefix=sys.argv[3])
agent = Agent("victim", sys.argv[1], settings=settings, max_concurrency=16, max_queue=1024)

@agent.capability("bench.work")
async def work(value: dict) -> dict:
    await asyncio.sleep(0.005)
    return value

agent.run()
"""


async def failure(url: str, rate: float, seconds: float, kill_at: float) -> dict[str, Any]:
    prefix = "fail"
    s = defaults(url, prefix)
    results: list[tuple[float, float, bool]] = []
    async with reach.Registry(settings=s), reach.Client(settings=s) as client:
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                AGENT,
                f"victim-{i}",
                url,
                prefix,
                env=clean_environ(),  # the victims run on the defaults too
                stdin=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i in range(3)
        ]
        try:

            async def three() -> bool:
                return len(await client.agents("bench.work")) == 3

            await eventually(three, timeout=60)
            start = time.perf_counter()
            killed_at = None

            async def one(t: float) -> None:
                try:
                    await client.request("bench.work", {"t": t}, timeout=2)
                    ok = True
                except reach.ReachError:
                    ok = False
                results.append((t, (time.perf_counter() - start - t) * 1000, ok))

            tasks = set()
            n = 0
            while (now := time.perf_counter() - start) < seconds:
                if killed_at is None and now >= kill_at:
                    os.kill(procs[0].pid, signal.SIGKILL)
                    killed_at = now
                task = asyncio.ensure_future(one(now))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
                await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
            await asyncio.gather(*tasks)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.terminate()
                    await p.wait()
    assert killed_at is not None

    def window(a: float, b: float) -> dict[str, Any]:
        part = [r for r in results if a <= r[0] - killed_at < b]
        return {
            "requests": len(part),
            "failed": sum(not ok for _, _, ok in part),
            "p99_ms": round(pct([ms for _, ms, ok in part if ok], 0.99), 2),
        }

    return {
        "rate": rate,
        "requests": len(results),
        "failed": sum(not ok for _, _, ok in results),
        "before_kill": window(-kill_at, 0),
        "first_2s_after": window(0, 2),
        "rest_after": window(2, seconds),
    }


# -- main ---------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["decision", "overhead", "skewed", "failure", "all"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--picks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--png", type=Path, default=RESULTS / "skewed.png")
    parser.add_argument("--no-png", action="store_true", help="skip the chart (no matplotlib)")
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--kill-at", type=float, default=30.0)
    args = parser.parse_args()
    todo = ["decision", "overhead", "skewed", "failure"] if args.which == "all" else [args.which]
    if "skewed" in todo and not args.no_png and importlib.util.find_spec("matplotlib") is None:
        # said now, not after a minute of measuring
        parser.exit(
            2,
            "routing.py: the skewed chart needs matplotlib (pip install -e '.[bench]'),"
            " or pass --no-png\n",
        )
    report: dict[str, Any] = {}
    with NatsServer() as server:
        report["setup"] = {"settings": defaults(server.url).model_dump(mode="json")}
        print(json.dumps({"setup": report["setup"]}, indent=2), flush=True)
        for which in todo:
            if which == "decision":
                report[which] = asyncio.run(decision(server.url, args.sizes, args.picks))
            elif which == "overhead":
                report[which] = asyncio.run(overhead(server.url, args.rounds, args.seconds))
            elif which == "skewed":
                png = None if args.no_png else args.png
                report[which] = asyncio.run(skewed(server.url, args.rounds, args.seconds, png))
            else:
                report[which] = asyncio.run(
                    failure(server.url, args.rate, args.duration, args.kill_at)
                )
            print(json.dumps({which: report[which]}, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
