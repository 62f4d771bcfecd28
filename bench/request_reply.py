"""Request/reply overhead: reach.Client -> reach.Agent vs raw nats-py, same server, same run.

Both sides do the same application work (a 256-byte JSON payload, decoded and re-encoded by
the responder with msgspec); the difference is what Agent-Reach adds (headers, deadline,
priority queue and workers, error mapping). Responders run in a child process; the client
side alternates raw and reach rounds and reports medians and the reach/raw ratio.

    python bench/request_reply.py [--rounds 5] [--seconds 2] [--inflight 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import msgspec
import nats

import reach
from reach.testing import NatsServer

PAYLOAD = {
    "order_id": "A-1029384756",
    "customer": "c-000123",
    "note": "x" * 150,
    "items": [{"sku": "sku-1", "qty": 2}, {"sku": "sku-2", "qty": 1}],
}
RAW = "bench.raw"
CAP = "bench.echo"


def _payload_bytes() -> bytes:
    data = msgspec.json.encode(PAYLOAD)
    return data + b" " * (256 - len(data)) if len(data) < 256 else data


def responders(url: str, ready: Any, stop: Any) -> None:
    async def main() -> None:
        nc = await nats.connect(url)

        async def raw(msg: Any) -> None:
            value = msgspec.json.decode(msg.data)
            await nc.publish(msg.reply, msgspec.json.encode(value))

        await nc.subscribe(RAW, cb=raw)
        await nc.flush()
        agent = reach.Agent(
            "bench", settings=reach.ReachSettings(nats_url=url), max_concurrency=64, max_queue=1024
        )

        @agent.capability(CAP)
        async def echo(value: dict[str, Any]) -> dict[str, Any]:
            return value

        async with agent:
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await nc.close()

    asyncio.run(main())


async def sequential(fn: Any, seconds: float) -> tuple[float, list[float]]:
    lat: list[float] = []
    end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while (now := time.perf_counter()) < end:
        await fn()
        lat.append(time.perf_counter() - now)
    return len(lat) / (time.perf_counter() - t0), lat


async def concurrent(fn: Any, seconds: float, inflight: int) -> float:
    count = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < end:
            await fn()
            count += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return count / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    body = _payload_bytes()
    nc = await nats.connect(url)
    client = await reach.Client(settings=reach.ReachSettings(nats_url=url)).connect()

    async def raw_call() -> None:
        msg = await nc.request(RAW, msgspec.json.encode(msgspec.json.decode(body)), timeout=5)
        msgspec.json.decode(msg.data)

    async def reach_call() -> None:
        await client.request(CAP, body, timeout=5)

    for fn in (raw_call, reach_call):  # warm up
        await sequential(fn, 0.3)
    results: dict[str, dict[str, list[float]]] = {
        k: {"seq": [], "p50": [], "p99": [], "conc": []} for k in ("raw", "reach")
    }
    for _ in range(args.rounds):
        for name, fn in (("raw", raw_call), ("reach", reach_call)):
            rate, lat = await sequential(fn, args.seconds)
            r = results[name]
            r["seq"].append(rate)
            r["p50"].append(pct(lat, 0.5) * 1e6)
            r["p99"].append(pct(lat, 0.99) * 1e6)
            r["conc"].append(await concurrent(fn, args.seconds, args.inflight))
    await client.close()
    await nc.close()
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}
    return {
        "raw": med["raw"],
        "reach": med["reach"],
        "ratio_sequential": med["reach"]["seq"] / med["raw"]["seq"],
        "ratio_inflight": med["reach"]["conc"] / med["raw"]["conc"],
        "rounds": args.rounds,
        "seconds": args.seconds,
        "inflight": args.inflight,
        "loop": "uvloop" if args.uvloop else "asyncio",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--uvloop", action="store_true", help="run the client on uvloop")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with NatsServer() as server:
        ctx = mp.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        child = ctx.Process(target=responders, args=(server.url, ready, stop))
        child.start()
        try:
            if not ready.wait(30):
                print("responders did not start", file=sys.stderr)
                return 1
            if args.uvloop:
                import uvloop

                out = uvloop.run(run(args, server.url))
            else:
                out = asyncio.run(run(args, server.url))
        finally:
            stop.set()
            child.join(10)
            if child.is_alive():
                child.kill()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"request/reply, 256-byte JSON, {args.rounds} alternating rounds x {args.seconds}s, "
        f"medians ({out['loop']})"
    )
    print(f"{'':8}{'seq rt/s':>10}{'p50 us':>9}{'p99 us':>9}{f'{args.inflight} in flight/s':>18}")
    for k in ("raw", "reach"):
        m = out[k]
        print(f"{k:8}{m['seq']:>10.0f}{m['p50']:>9.0f}{m['p99']:>9.0f}{m['conc']:>18.0f}")
    print(
        f"ratio reach/raw: sequential {out['ratio_sequential']:.2f}x (goal >= 0.85), "
        f"{args.inflight} in flight {out['ratio_inflight']:.2f}x (goal >= 0.75)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
