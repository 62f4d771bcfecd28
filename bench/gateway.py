"""HTTP -> capability -> reply through `reach gateway`, against the direct Python client.

Setup, all on one machine: nats-server, a registry and two agent instances (one process
each, default settings, capability `bench.echo` answering its 256-byte JSON request), and
`reach gateway` in its own process exactly as deployed (`python -m reach.cli gateway`:
uvicorn with httptools on uvloop, no tokens, no access log).

Variants, interleaved in rounds (their order rotating), each with N callers in flight:
- `direct client`: `reach.Client.call` in this process (the baseline).
- `gateway (raw HTTP)`: POST /v1/capabilities/bench.echo over N keep-alive connections,
  written and parsed by a few lines of asyncio here (HTTP/1.1, Content-Length only): the
  lightest load generator, so the gateway, not the generator, sets the pace.
- `gateway (httpx)`: the same through one pooled `httpx.AsyncClient` (N connections), to
  show what a common Python HTTP client costs on the caller's side.
- `gateway (wrk)`: the same load from `wrk` (one thread, N connections), the usual C load
  generator, when it is installed (Debian: `apt-get install wrk`): HTTP callers normally
  run elsewhere, and on a 2-core machine a Python generator takes CPU from the gateway.
  Any non-2xx answer fails the run.
- `gateway, W workers (...)`: raw HTTP and wrk again, against `reach gateway --workers W`
  (default W: one per core), a second gateway on its own port: W processes behind one
  port, each with its own NATS connection.

This process runs on uvloop (both the direct client and the HTTP load generators; pass
--asyncio for the default loop). CPU use of this process and of the gateway processes
(share of one core, workers included), and how busy the whole machine was, are sampled
per variant, so a saturated load generator or gateway shows. The ratio reported is the
median over rounds of gateway/direct within each round.

    python bench/gateway.py [--quick] [--rounds 5] [--seconds 2] [--inflight 64]
                            [--only direct,raw,httpx,wrk] [--workers W] [--asyncio] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
from _fleet import Call, Children, clean_environ, closed_loop, defaults, pct, run_registry

import reach
from reach.testing import NatsServer, eventually

CAP = "bench.echo"
#: one variant: run for that many seconds -> (requests/s, latencies ms or {"50": p50, ...})
Runner = Callable[[float], Awaitable[tuple[float, "list[float] | dict[str, float]"]]]
SIZE = 256
ROOT = Path(__file__).resolve().parents[1]


def payload() -> bytes:
    value: dict[str, Any] = {"order_id": "A-1029384756", "customer": "c-000123", "note": ""}
    value["note"] = "x" * (SIZE - len(msgspec.json.encode(value)))
    body = msgspec.json.encode(value)
    assert len(body) == SIZE
    return body


def run_instance(url: str, index: int, ready: Any, stop: Any) -> None:
    async def main() -> None:
        agent = reach.Agent("bench", f"bench-{index}", settings=defaults(url))

        @agent.capability(CAP)
        async def echo(value: dict[str, Any]) -> dict[str, Any]:
            return value

        async with agent:
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)

    asyncio.run(main())


class Gateway:
    """`reach gateway --port 0` as a child process; its URL read from its first line."""

    def __init__(self, url: str, workers: int = 1) -> None:
        self.workers = workers
        env = clean_environ() | {
            "REACH_NATS_URL": url,
            "REACH_LOG_LEVEL": "WARNING",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reach.cli",
                "gateway",
                "--port",
                "0",
                "--workers",
                str(workers),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith("# gateway on "):
                self.url = line.split()[3]
                break
        else:
            raise RuntimeError(f"the gateway exited with {self.proc.wait()}")

    def cpu_seconds(self) -> float:
        """user + system CPU time of the gateway's processes, its workers' too (Linux /proc)."""
        pids = {self.proc.pid}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            pids |= {int(c) for c in (task / "children").read_text().split()}
        total = 0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot (Linux /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


class RawHttp:
    """Keep-alive HTTP/1.1 connections, one request at a time on each: write the request,
    read the head, read Content-Length bytes. No chunked replies (the route sends none)."""

    def __init__(self, url: str, path: str, body: bytes) -> None:
        hostport = url.removeprefix("http://")
        self.host, port = hostport.rsplit(":", 1)
        self.port = int(port)
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def call(self) -> bytes:
        while self.idle:
            reader, writer = self.idle.pop()
            try:
                return await self._exchange(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()  # the server closed it while idle (its keep-alive timeout)
        return await self._exchange(*await asyncio.open_connection(self.host, self.port))

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        data = await reader.readexactly(length)
        self.idle.append((reader, writer))
        return data

    async def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


_WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[%s]]
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


class Wrk:
    """`wrk -t1 -cN` against the route: its rate and latency percentiles (ms)."""

    def __init__(self, url: str, path: str, body: bytes, inflight: int, workdir: Path) -> None:
        script = workdir / "post.lua"
        script.write_text(_WRK_SCRIPT % body.decode())
        self.argv = ["wrk", "-t1", f"-c{inflight}", "--latency", "-s", str(script), url + path]
        self.latencies: list[float] = []

    async def run(self, seconds: float) -> tuple[float, dict[str, float]]:
        proc = await asyncio.create_subprocess_exec(
            *self.argv[:3],
            f"-d{max(1, round(seconds))}s",
            *self.argv[3:],
            stdout=asyncio.subprocess.PIPE,
        )
        out = (await proc.communicate())[0].decode()
        if proc.returncode or "Non-2xx" in out or "Socket errors" in out:
            raise RuntimeError(f"wrk: {out}")
        rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        pcts = {
            q: float(v) * _UNITS[u]
            for q, v, u in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)$", out, re.M)
        }
        return rate, pcts


async def measure(args: argparse.Namespace, url: str, gateways: list[Gateway]) -> dict[str, Any]:
    body = payload()
    path = f"/v1/capabilities/{CAP}"
    gateway = gateways[0]
    raws = [RawHttp(g.url, path, body) for g in gateways]
    raw = raws[0]
    limits = httpx.Limits(max_connections=args.inflight, max_keepalive_connections=args.inflight)
    async with (
        reach.Client(settings=defaults(url), name="bench") as client,
        httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=10) as http,
    ):

        async def both_known() -> bool:
            records = await client.agents(CAP)
            return len(records) == 2 and all(r.status == reach.Status.UP for r in records)

        await eventually(both_known, timeout=60)
        # each gateway's workers must know both instances too before measuring
        for g in gateways:
            ready: set[int] = set()  # worker pids that know both instances
            await eventually(lambda g=g, ready=ready: _workers_know(g, 2, ready), timeout=60)

        async def direct() -> None:
            await client.call(CAP, body, timeout=5, response_type=bytes)

        def via_raw(raw: RawHttp) -> Call:
            async def call() -> None:
                msgspec.json.decode(await raw.call())

            return call

        async def via_httpx() -> None:
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            if r.status_code != 200:
                raise RuntimeError(r.text)
            msgspec.json.decode(r.content)

        def looped(fn: Call) -> Runner:
            return lambda seconds: closed_loop(fn, seconds, args.inflight)

        wanted = set(args.only.split(",")) if args.only else {"raw", "httpx", "wrk"}
        if "wrk" in wanted and not shutil.which("wrk"):
            if args.only:
                raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
            wanted.discard("wrk")
        variants: dict[str, Runner] = {"direct client": looped(direct)}
        for g, g_raw in zip(gateways, raws, strict=True):
            label = "gateway" if g.workers == 1 else f"gateway, {g.workers} workers"
            if "raw" in wanted:
                variants[f"{label} (raw HTTP)"] = looped(via_raw(g_raw))
            if "httpx" in wanted and g is gateway:
                variants[f"{label} (httpx)"] = looped(via_httpx)
            if "wrk" in wanted:
                variants[f"{label} (wrk)"] = Wrk(g.url, path, body, args.inflight, args.tmp).run
        answer = msgspec.json.decode(await raw.call())
        assert msgspec.json.encode(answer["result"]) == body, answer
        assert answer["agent_id"] in {"bench-0", "bench-1"}
        for run in variants.values():
            await run(args.warmup)

        names = list(variants)
        per_round: list[dict[str, float]] = []
        lat: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, dict[str, list[float]]] = {
            n: {"bench": [], "gateway": [], "machine": []} for n in names
        }
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            rates: dict[str, float] = {}
            for name in order:
                t0, c0, g0 = time.perf_counter(), own_cpu(), gateways_cpu(gateways)
                m0 = machine_busy()
                rate, values = await variants[name](args.seconds)
                wall = time.perf_counter() - t0
                m1 = machine_busy()
                cpu[name]["machine"].append((m1[0] - m0[0]) / max(1, m1[1] - m0[1]))
                cpu[name]["bench"].append((own_cpu() - c0) / wall)
                cpu[name]["gateway"].append((gateways_cpu(gateways) - g0) / wall)
                rates[name] = rate
                if isinstance(values, dict):  # wrk's own percentiles, per round
                    for q, v in values.items():
                        lat.setdefault(f"{name} {q}", []).append(v)
                else:
                    lat[name] += values
            per_round.append(rates)
        for each in raws:
            await each.close()

    out: dict[str, Any] = {"variants": {}, "ratios": {}, "rounds": per_round}
    for name in names:
        out["variants"][name] = {
            "rate": statistics.median(r[name] for r in per_round),
            "p50_us": _percentile(lat, name, 0.5) * 1e3,
            "p99_us": _percentile(lat, name, 0.99) * 1e3,
            "cpu_bench": statistics.median(cpu[name]["bench"]),
            "cpu_gateway": statistics.median(cpu[name]["gateway"]),
            "cpu_machine": statistics.median(cpu[name]["machine"]),
        }
    for name in names[1:]:
        out["ratios"][name] = statistics.median(r[name] / r["direct client"] for r in per_round)
    return out


def _percentile(lat: dict[str, list[float]], name: str, q: float) -> float:
    """From the variant's latencies, or the median of what wrk reported per round."""
    if lat[name]:
        return pct(lat[name], q)
    return statistics.median(lat.get(f"{name} {round(q * 100)}", [float("nan")]))


def gateways_cpu(gateways: list[Gateway]) -> float:
    return sum(g.cpu_seconds() for g in gateways)


def own_cpu() -> float:
    """CPU seconds of this process and its finished children (wrk)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


async def _workers_know(gateway: Gateway, n: int, ready: set[int]) -> bool:
    """Whether every worker has ``n`` instances in its table; asks one (the kernel's
    choice: a new connection each time) and remembers its answer by its pid."""
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        pid = (await http.get("/healthz")).json()["pid"]
        r = await http.get("/v1/agents", params={"capability": CAP})  # same connection
        if len(r.json()["agents"]) == n:
            ready.add(pid)
    return len(ready) == gateway.workers


def table(out: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [
        f"| variant | {args.inflight} in flight req/s | p50 / p99 µs | CPU bench / gateway"
        " (of one core) | machine busy (all cores) |",
        "|---|---|---|---|---|",
    ]
    for name, v in out["variants"].items():
        rows.append(
            f"| {name} | {v['rate']:,.0f} | {v['p50_us']:,.0f} / {v['p99_us']:,.0f}"
            f" | {v['cpu_bench']:.0%} / {v['cpu_gateway']:.0%} | {v['cpu_machine']:.0%} |"
        )
    for name, ratio in out["ratios"].items():
        rows.append(f"| **{name} / direct client** | **{ratio:.2f}x** | | | |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds x 1 s (< 1 minute)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--only", default="", help="a subset: direct,raw,httpx,wrk")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="also measure `reach gateway --workers N` (default: one per core)",
    )
    parser.add_argument("--asyncio", action="store_true", help="this process on asyncio's loop")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.warmup = 0.5
    if args.quick:
        args.rounds, args.seconds, args.warmup = 3, 1.0, 0.3
    fleet = Children()
    with NatsServer() as server, tempfile.TemporaryDirectory() as tmp:
        args.tmp = Path(tmp)
        fleet.add(run_registry, server.url)
        for i in range(2):
            fleet.add(run_instance, server.url, i)
        with fleet:
            gateways: list[Gateway] = []
            try:
                for n in sorted({1, args.workers}):
                    gateways.append(Gateway(server.url, n))
                if args.asyncio:
                    out = asyncio.run(measure(args, server.url, gateways))
                else:
                    import uvloop

                    out = uvloop.run(measure(args, server.url, gateways))
            finally:
                for gateway in gateways:
                    gateway.close()
    out["setup"] = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "inflight": args.inflight,
        "loop": "asyncio" if args.asyncio else "uvloop",
        "payload_bytes": SIZE,
        "cores": os.cpu_count(),
        "workers": sorted({1, args.workers}),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"HTTP -> capability -> reply, {SIZE}-byte JSON; registry + 2 instances; `reach gateway`"
        f" in its own process(es) (uvicorn, httptools, uvloop; workers {out['setup']['workers']});"
        f" load from this process on"
        f" {out['setup']['loop']}; {args.rounds} interleaved rounds x {args.seconds:g} s;"
        f" {os.cpu_count()} cores shared by all"
    )
    print()
    print(table(out, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
