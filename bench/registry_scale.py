"""Registry at scale: N simulated agents heartbeating every 5 s against registry processes.

Every party is a process of its own, so each one's CPU and memory are its own:

- ``--replicas`` registries (``reach registry``, default 1), all on the same prefix: they
  share the heartbeats and the API requests through NATS queue groups, and every write
  is a compare-and-set on the key's revision;
- ``--sim-procs`` simulators (this script, ``--simulate``), each holding a slice of the
  agents: they register (64 in flight in all), then heartbeat on a uniform schedule with
  the real wire types, stamping each heartbeat's ``sent_ms``. Every agent serves
  ``sim.work``; the first 10 also serve ``sim.rare``;
- an idle client (this script, ``--idle-client``): a ``reach.Client`` that has picked a
  route for ``sim.rare`` (10 instances) and then does nothing. What it costs is what
  following the table costs that client: the whole table, or only the records of the
  capabilities it calls if the client follows only those;
- this process, which only orchestrates and observes: a KV watch of the routes of
  ``sim.watched`` (served also by every 100th agent: what a client calling it follows),
  and a heartbeat's lag is its own clock minus the ``sent_ms`` of the record the watch
  first holds with it (one host, one clock). Following 1% of the fleet keeps the watch
  from being the bottleneck (following all of it, the bench measured itself past 50,000).

Per size it reports the registries' CPU (share of one core: the sum over the replicas,
the busiest replica, and each one in ``--json``) and RSS (the sum), the writes into the
agents bucket (its stream's last sequence over the window) per second and per heartbeat
(a registry writes a heartbeat with news or a lease due for renewal, docs/registry.md;
the simulated agents report a constant load, so past each one's first heartbeat only
renewals are written: about one heartbeat in ceil(R / 5 s), R = lease/3 - 2.5 s, so
every one at the default 15 s lease, one in two at ``--lease-ttl 30``),
the lag p50/p99, the time to register everyone, the time the registries take to exit on
SIGTERM (sent to all at once, 1 s after the last heartbeat: the slowest replica's; one
still running after 10 s is killed, and reported so), and the idle client's CPU and RSS.

    python bench/registry_scale.py [--agents 1000 10000] [--seconds 15] [--warmup 5]
                                   [--sim-procs 2] [--replicas 1] [--lease-ttl 15] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import nats
from _fleet import clean_environ, defaults, pct

import reach
from reach.testing import NatsServer
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Heartbeat, Registration

_record = msgspec.json.Decoder(AgentRecord)
INTERVAL = 5.0  # the default heartbeat interval (the lease: --lease-ttl, default 15 s)
TICK = 0.01
INFLIGHT = 64  # registrations in flight, over all simulators
CAPABILITY = "sim.work"  # served by every simulated agent
RARE = "sim.rare"  # served also by the first RARE_AGENTS: the one the idle client picks
RARE_AGENTS = 10
#: every WATCHED_EVERY-th agent also serves WATCHED, whose routes the bench's own watch
#: follows to time the lag (1% of the fleet: the whole fleet's updates would make the
#: watch itself the bottleneck past 50,000 agents, and the bench would measure itself)
WATCHED = "sim.watched"
WATCHED_EVERY = 100
STOP_GRACE = 10.0  # a registry still running this long after SIGTERM is killed
READY_TIMEOUT = 120.0
GOAL = (
    "goal (issue 25, 2 cores): 100,000 agents at 5 s heartbeats with lag p99 < 1 s;"
    " registry CPU <= 10% of a core per 10,000 agents; all registered within 60 s;"
    " exit within 5 s of SIGTERM; an idle client < 5% of a core at 100,000 agents"
)

Proc = asyncio.subprocess.Process


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def now_ms() -> float:
    return time.time() * 1000


# -- the children's side: one JSON object a line on stdout, commands on stdin ----------


def say(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


async def hear() -> dict[str, Any]:
    """The parent's next command; its end (EOF) ends the child."""
    line = await asyncio.to_thread(sys.stdin.readline)
    if not line:
        raise SystemExit("bench parent gone")
    message: dict[str, Any] = json.loads(line)
    return message


async def simulate(url: str, prefix: str, first: int, count: int, inflight: int) -> None:
    """Agents ``first``..``first + count - 1``: register when told, then heartbeat on the
    parent's plan; reports how many heartbeats it sent within the measured window."""
    nc = await nats.connect(url)
    try:
        ids = [f"sim-{i:06d}" for i in range(first, first + count)]
        say({"ready": True})
        await hear()
        sem = asyncio.Semaphore(inflight)

        async def register(index: int, agent_id: str) -> None:
            served = [CapabilityInfo(name=CAPABILITY)]
            if index < RARE_AGENTS:
                served.append(CapabilityInfo(name=RARE))
            if index % WATCHED_EVERY == 0:
                served.append(CapabilityInfo(name=WATCHED))
            info = AgentInfo(agent_id=agent_id, name="sim", capabilities=served)
            async with sem:
                await nc.request(
                    f"{prefix}.registry.register.{agent_id}",
                    msgspec.json.encode(Registration(info=info)),
                    timeout=60,
                )

        await asyncio.gather(*(register(first + k, i) for k, i in enumerate(ids)))
        say({"registered": True})
        plan = await hear()
        start, lo, hi = plan["start_ms"], plan["measure_from_ms"], plan["until_ms"]
        await asyncio.sleep(max(0.0, (start - now_ms()) / 1000))
        rate = count / (INTERVAL * 1000)  # heartbeats due per ms
        sent = counted = 0
        while (now := now_ms()) < hi:
            due = int((now - start) * rate)
            while sent < due:  # the schedule, caught up if a tick came late
                at = now_ms()
                hb = Heartbeat(
                    agent_id=ids[sent % count],
                    seq=sent // count + 1,
                    load=0.25,
                    latency_ms=12.0,
                    sent_ms=round(at),
                )
                await nc.publish(f"{prefix}.hb.{hb.agent_id}", msgspec.json.encode(hb))
                sent += 1
                counted += int(lo <= hb.sent_ms < hi)
            await asyncio.sleep(TICK)
        await nc.flush()
        say({"heartbeats": counted})
    finally:
        await nc.close()


async def idle_client(url: str, prefix: str) -> None:
    """A client that has routed the rare capability once, then sits idle until told to end."""
    async with reach.Client(settings=defaults(url, prefix)) as client:
        with contextlib.suppress(reach.ReachError):  # no instance fits: the table still runs
            await client.pick(RARE)
        say({"ready": True})
        await hear()


# -- the parent's side -----------------------------------------------------------------


class Child:
    """A process of this script in a role, spoken to in JSON lines."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, *args: str) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=clean_environ(),
        )
        return cls(proc)

    async def say(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.proc.stdin.drain()

    async def hear(self, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            code = await self.proc.wait()
            raise RuntimeError(f"bench child {self.proc.pid} exited with {code}")
        message: dict[str, Any] = json.loads(line)
        return message


async def stop(proc: Proc, grace: float = STOP_GRACE) -> float | None:
    """SIGTERM to the process's PID, SIGKILL if it outlives ``grace``: the seconds it took
    to exit, or None when it had to be killed."""
    t0 = time.perf_counter()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return None
    return time.perf_counter() - t0


async def start_registry(url: str, prefix: str, lease_ttl: float) -> tuple[Proc, str]:
    """The registry under test, and its bucket's stream (named by the registry's own
    start line). Its log is read to the end by the caller (``drain``): a full pipe would
    stall it."""
    env = {
        **clean_environ(),
        "REACH_NATS_URL": url,
        "REACH_SUBJECT_PREFIX": prefix,
        "REACH_LEASE_TTL": str(lease_ttl),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "registry",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    async with asyncio.timeout(READY_TIMEOUT):
        while line := await proc.stderr.readline():
            found = re.match(rb"# registry .* bucket ([A-Za-z0-9_-]+)", line)
            if found:
                return proc, f"KV_{found[1].decode()}"
    await stop(proc)
    raise RuntimeError(f"registry exited with {proc.returncode} before it was ready")


async def drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


async def observe(kv: Any, lags: list[float], lo: float, hi: float) -> None:
    """Lag of every heartbeat sent within [lo, hi) ms by an agent serving ``WATCHED``, when
    a watch of its routes (what a client calling it follows) first holds it (a record
    written again with the same heartbeat is not a new sample)."""
    seen: set[tuple[str, int]] = set()
    watcher = await kv.watch(f"{WATCHED}.*")
    try:
        async for entry in watcher:
            if entry is None or entry.operation is not None or not entry.value:
                continue
            hb = _record.decode(entry.value).heartbeat
            if hb is None:
                continue
            if lo <= hb.sent_ms < hi and (hb.agent_id, hb.seq) not in seen:
                seen.add((hb.agent_id, hb.seq))
                lags.append(now_ms() - hb.sent_ms)
    finally:
        await watcher.stop()


async def sample(js: Any, stream: str, registries: list[int], idle: int) -> dict[str, Any]:
    info = await js.stream_info(stream)
    return {
        "wall": time.perf_counter(),
        "seq": info.state.last_seq,
        "registry_cpu": [proc_cpu_seconds(pid) for pid in registries],
        "idle_cpu": proc_cpu_seconds(idle),
    }


async def run_once(
    url: str,
    n: int,
    seconds: float,
    warmup: float,
    sim_procs: int,
    replicas: int,
    lease_ttl: float,
) -> dict[str, Any]:
    prefix = f"scale{n}"
    procs: list[Proc] = []
    registries: list[Proc] = []
    draining: list[asyncio.Task[None]] = []
    nc = await nats.connect(url)
    try:
        for _ in range(replicas):  # one at a time: the first one makes the bucket
            registry, stream = await start_registry(url, prefix, lease_ttl)
            procs.append(registry)
            registries.append(registry)
            assert registry.stderr is not None
            draining.append(asyncio.create_task(drain(registry.stderr)))
        pids = [r.pid for r in registries]

        inflight = max(1, INFLIGHT // sim_procs)
        cuts = [n * k // sim_procs for k in range(sim_procs + 1)]
        sims = []
        for first, end in itertools.pairwise(cuts):
            role = ["--simulate", str(first), str(end - first), str(inflight)]
            sim = await Child.start(*role, "--url", url, "--prefix", prefix)
            procs.append(sim.proc)
            sims.append(sim)
        for sim in sims:
            await sim.hear()
        t0 = time.perf_counter()
        for sim in sims:
            await sim.say({"register": True})
        for sim in sims:
            await sim.hear()
        register_s = time.perf_counter() - t0

        idle = await Child.start("--idle-client", "--url", url, "--prefix", prefix)
        procs.append(idle.proc)
        await idle.hear()

        lags: list[float] = []
        routes = await nc.jetstream().key_value(f"{prefix.replace('.', '_')}_routes")
        start = now_ms() + 200
        lo, hi = start + warmup * 1000, start + (warmup + seconds) * 1000
        observer = asyncio.create_task(observe(routes, lags, lo, hi))
        try:
            plan = {"start_ms": start, "measure_from_ms": lo, "until_ms": hi}
            for sim in sims:
                await sim.say(plan)
            js = nc.jetstream()
            await asyncio.sleep((lo - now_ms()) / 1000)
            before = await sample(js, stream, pids, idle.proc.pid)
            await asyncio.sleep((hi - now_ms()) / 1000)
            after = await sample(js, stream, pids, idle.proc.pid)
            registry_rss = [proc_rss_mb(pid) for pid in pids]
            idle_rss = proc_rss_mb(idle.proc.pid)
            heartbeats = sum([(await sim.hear())["heartbeats"] for sim in sims])
            await asyncio.sleep(1.0)  # the last heartbeats reach the table
        finally:
            observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observer
        stops = await asyncio.gather(*(stop(r) for r in registries))  # SIGTERM to all at once
    finally:
        for proc in procs:
            await stop(proc)
        for task in draining:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await nc.close()

    window = after["wall"] - before["wall"]
    hb_per_s = heartbeats / seconds
    writes_per_s = (after["seq"] - before["seq"]) / window
    cpu = [
        (a - b) / window for a, b in zip(after["registry_cpu"], before["registry_cpu"], strict=True)
    ]
    killed = any(s is None for s in stops)
    stop_s = None if killed else max(s for s in stops if s is not None)
    return {
        "agents": n,
        "sim_procs": sim_procs,
        "replicas": replicas,
        "lease_ttl_s": lease_ttl,
        "register_s": round(register_s, 2),
        "heartbeats": heartbeats,
        "heartbeats_per_s": round(hb_per_s),
        "registry_cpu_core": round(sum(cpu), 3),  # over all replicas
        "registry_cpu_core_max": round(max(cpu), 3),
        "registry_cpu_core_per_replica": [round(c, 3) for c in cpu],
        "registry_rss_mb": round(sum(registry_rss), 1),  # over all replicas
        "registry_rss_mb_per_replica": [round(r, 1) for r in registry_rss],
        "kv_writes_per_s": round(writes_per_s),
        "writes_per_heartbeat": round(writes_per_s / hb_per_s, 3) if hb_per_s else None,
        "lag_samples": len(lags),
        "lag_p50_ms": round(pct(lags, 0.5), 2),
        "lag_p99_ms": round(pct(lags, 0.99), 2),
        "stop_s": None if stop_s is None else round(stop_s, 2),  # the slowest replica
        "registry_killed": killed,
        "idle_client_cpu_core": round((after["idle_cpu"] - before["idle_cpu"]) / window, 3),
        "idle_client_rss_mb": round(idle_rss, 1),
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    with NatsServer() as server:
        for n in args.agents:
            results.append(
                await run_once(
                    server.url,
                    n,
                    args.seconds,
                    args.warmup,
                    args.sim_procs,
                    args.replicas,
                    args.lease_ttl,
                )
            )
    return results


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'agents':>7} {'hb/s':>6} {'reg CPU':>7} {'max/replica':>11} {'RSS MB':>7} "
        f"{'writes/s':>8} "
        f"{'w/hb':>5} {'lag p50 ms':>10} {'lag p99 ms':>10} {'samples':>8} {'register s':>10} "
        f"{'stop s':>8} {'idle CPU':>8} {'idle MB':>7}"
    )
    lines = [head]
    for r in results:
        stop_s = "killed" if r["registry_killed"] else f"{r['stop_s']:.2f}"
        w_hb = "-" if r["writes_per_heartbeat"] is None else f"{r['writes_per_heartbeat']:.2f}"
        lines.append(
            f"{r['agents']:>7} {r['heartbeats_per_s']:>6} {r['registry_cpu_core']:>7.0%} "
            f"{r['registry_cpu_core_max']:>11.0%} {r['registry_rss_mb']:>7.1f} "
            f"{r['kv_writes_per_s']:>8} {w_hb:>5} "
            f"{r['lag_p50_ms']:>10.2f} {r['lag_p99_ms']:>10.2f} {r['lag_samples']:>8} "
            f"{r['register_s']:>10.2f} {stop_s:>8} {r['idle_client_cpu_core']:>8.1%} "
            f"{r['idle_client_rss_mb']:>7.1f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--sim-procs", type=int, default=2, help="simulator processes")
    parser.add_argument(
        "--replicas", type=int, default=1, help="registry processes on one prefix (default 1)"
    )
    parser.add_argument(
        "--lease-ttl", type=float, default=15.0, help="the registry's lease, s (default 15)"
    )
    parser.add_argument("--json", action="store_true")
    # the children's roles
    parser.add_argument("--simulate", type=int, nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--idle-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if args.simulate:
        asyncio.run(simulate(args.url, args.prefix, *args.simulate))
        return 0
    if args.idle_client:
        asyncio.run(idle_client(args.url, args.prefix))
        return 0
    results = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(
            f"heartbeats every {INTERVAL:g} s, lease {args.lease_ttl:g} s,"
            f" {args.replicas} registry replica(s)"
        )
        print(table(results))
        print(GOAL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
