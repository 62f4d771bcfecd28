"""Streaming replies: reach's ``client.stream`` vs a raw nats-py streaming loop, same server,
same run, same chunk size and window.

Fleet: a registry (its own process) and one instance process holding a reach agent whose
capability ``bench.stream`` is an async generator yielding ``n`` pre-built chunks of
``--chunk`` bytes, and a raw nats-py responder doing the same with the least a stream
needs: each chunk a plain message to the caller's reply subject (no headers), an empty
message as the end, and credit as a plain message to the chunks' reply-to (a
per-stream subject on one wildcard subscription), sent by the caller every half window;
the responder sends while it has credit and waits for more otherwise. The reach stream
carries what the protocol adds: a ``Reach-Chunk`` header per chunk, ``Reach-End``, JSON
credit bodies, keepalives, routing through the table.

Client side (this process): ``reach`` consumes ``client.stream(...)`` to its end; ``raw``
uses one wildcard inbox subscription, a queue per stream, and publishes the request and
the credit with nats-py's ``publish``. Both read every chunk as bytes.

Measured per variant: chunks per second (all chunks received / time) and the time to the
first chunk of each stream (from the call to the first chunk in hand), with 1 stream at a
time and with ``--inflight`` streams at once. Rounds interleave the variants; ratios
reach/raw are taken within each round and the median over rounds is reported. Goals:
chunks/s >= 0.7x raw, time to first chunk <= 1.2x raw.

    python bench/streams.py [--quick] [--rounds 5] [--seconds 2] [--inflight 8]
                            [--chunks 200] [--chunk 64] [--window 16] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import msgspec
import nats
from _fleet import (
    Children,
    defaults,
    pct,
    rounds_parser,
    run_registry,
    settle,
    shown,
    whole_fleet,
)

import reach
from reach.testing import NatsServer

CAP = "bench.stream"
RAW = "bench.raw.stream"
RAW_CREDIT = "bench.raw.credit."


# -- child processes: the registry, and one instance (a reach agent + a raw responder) ------


class RawStreamer:
    """The raw responder: a stream per request, sent within the caller's credit."""

    def __init__(self, nc: Any, size: int) -> None:
        self.nc = nc
        self.chunk = b"x" * size
        self.credit: dict[str, list[Any]] = {}  # token -> [granted, event]
        self.seq = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.nc.subscribe(RAW_CREDIT + "*", cb=self.on_credit)
        await self.nc.subscribe(RAW, cb=self.on_request)
        await self.nc.flush()

    async def on_credit(self, msg: Any) -> None:
        state = self.credit.get(msg.subject[len(RAW_CREDIT) :])
        if state is not None:
            state[0] += int(msg.data)
            state[1].set()

    async def on_request(self, msg: Any) -> None:
        task = asyncio.create_task(self.serve(msg))  # streams run side by side
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def serve(self, msg: Any) -> None:
        req = msgspec.json.decode(msg.data)
        self.seq += 1
        token = str(self.seq)
        via = RAW_CREDIT + token
        state: list[Any] = [req["w"], asyncio.Event()]
        self.credit[token] = state
        nc, chunk = self.nc, self.chunk
        try:
            for sent in range(req["n"]):
                while sent >= state[0]:
                    state[1].clear()
                    await state[1].wait()
                await nc.publish(msg.reply, chunk, reply=via)
            await nc.publish(msg.reply, b"", reply=via)
        finally:
            del self.credit[token]


def run_instance(url: str, size: int, ready: Any, stop: Any) -> None:
    async def main() -> None:
        nc = await nats.connect(url)
        raw = RawStreamer(nc, size)
        await raw.start()
        agent = reach.Agent("bench", "bench-0", settings=defaults(url))
        chunk = b"x" * size

        @agent.capability(CAP)
        async def stream(req: dict[str, int]) -> Any:
            for _ in range(req["n"]):
                yield chunk

        async with agent:
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await nc.close()

    asyncio.run(main())


class Fleet(Children):
    """The registry and the instance, each in its own process."""

    def __init__(self, url: str, size: int) -> None:
        super().__init__()
        self.add(run_registry, url)
        self.add(run_instance, url, size)


# -- the client side ----------------------------------------------------------------------


class RawCaller:
    """A raw streaming caller: one wildcard inbox, a queue per stream, credit every half
    window to the chunks' reply-to."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.prefix = ""
        self.seq = 0
        self.queues: dict[str, asyncio.Queue[Any]] = {}

    async def start(self) -> None:
        self.prefix = self.nc.new_inbox() + "."
        await self.nc.subscribe(self.prefix + "*", cb=self.on_frame)
        await self.nc.flush()

    async def on_frame(self, msg: Any) -> None:
        queue = self.queues.get(msg.subject[len(self.prefix) :])
        if queue is not None:
            queue.put_nowait(msg)

    async def stream(self, n: int, window: int, ttfc: list[float]) -> int:
        self.seq += 1
        token = str(self.seq)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[token] = queue
        half = max(1, window // 2)
        got = owed = 0
        began = time.perf_counter()
        try:
            body = msgspec.json.encode({"n": n, "w": window})
            await self.nc.publish(RAW, body, reply=self.prefix + token)
            while True:
                msg = await asyncio.wait_for(queue.get(), 10)
                if not msg.data:
                    return got
                if not got:
                    ttfc.append((time.perf_counter() - began) * 1000)
                got += 1
                owed += 1
                if owed >= half:
                    await self.nc.publish(msg.reply, str(owed).encode())
                    owed = 0
        finally:
            del self.queues[token]


async def reach_stream(client: reach.Client, n: int, window: int, ttfc: list[float]) -> int:
    got = 0
    began = time.perf_counter()
    async for _ in client.stream(CAP, {"n": n}, window=window, response_type=bytes, timeout=10):
        if not got:
            ttfc.append((time.perf_counter() - began) * 1000)
        got += 1
    return got


async def loop(fn: Any, seconds: float, inflight: int) -> tuple[float, list[float]]:
    """Chunks per second with ``inflight`` streams at once, and each stream's time to its
    first chunk (ms)."""
    ttfc: list[float] = []
    chunks = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal chunks
        while time.perf_counter() < end:
            got = await fn(ttfc)  # (not `chunks += await ...`: it reads chunks first)
            chunks += got

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(inflight):
            group.create_task(worker())
    return chunks / (time.perf_counter() - t0), ttfc


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    nc = await nats.connect(url)
    raw = RawCaller(nc)
    await raw.start()
    n, w = args.chunks, args.window
    async with reach.Client(settings=defaults(url), name="bench") as client:
        await whole_fleet(client, 1, CAP)
        variants = {
            "reach": lambda ttfc: reach_stream(client, n, w, ttfc),
            "raw": lambda ttfc: raw.stream(n, w, ttfc),
        }
        for name, fn in variants.items():  # the same chunks on both paths; warm up
            assert await fn([]) == n, name
            await loop(fn, args.warmup, 1)
            await loop(fn, args.warmup, args.inflight)
        names = list(variants)
        per_round: list[dict[str, dict[str, float]]] = []
        firsts: dict[str, dict[str, list[float]]] = {k: {"seq": [], "conc": []} for k in names}
        for r in range(args.rounds):
            order = names[r % 2 :] + names[: r % 2]
            rates: dict[str, dict[str, float]] = {k: {} for k in names}
            for mode, inflight in (("seq", 1), ("conc", args.inflight)):
                for name in order:
                    rate, ttfc = await loop(variants[name], args.seconds, inflight)
                    rates[name][f"{mode}_rate"] = rate
                    rates[name][f"{mode}_ttfc"] = statistics.median(ttfc)
                    firsts[name][mode] += ttfc
            per_round.append(rates)
    await nc.close()
    out: dict[str, Any] = {"variants": {}, "ratios": {}, "rounds": per_round}
    for name in names:
        out["variants"][name] = {
            **{
                key: statistics.median(r[name][key] for r in per_round)
                for key in ("seq_rate", "conc_rate")
            },
            **{
                f"{mode}_ttfc_{q}": pct(firsts[name][mode], p) * 1e3
                for mode in ("seq", "conc")
                for q, p in (("p50_us", 0.5), ("p99_us", 0.99))
            },
        }
    out["ratios"] = {
        key: statistics.median(r["reach"][key] / r["raw"][key] for r in per_round)
        for key in ("seq_rate", "conc_rate", "seq_ttfc", "conc_ttfc")
    }
    return out


def table(out: dict[str, Any], args: argparse.Namespace) -> str:
    k = args.inflight
    rows = [
        f"| caller | 1 stream: chunks/s | first chunk p50 / p99 µs | {k} streams: chunks/s"
        " | first chunk p50 / p99 µs |",
        "|---|---|---|---|---|",
    ]
    for name, v in out["variants"].items():
        rows.append(
            f"| {name} | {v['seq_rate']:,.0f} | {v['seq_ttfc_p50_us']:,.0f} /"
            f" {v['seq_ttfc_p99_us']:,.0f} | {v['conc_rate']:,.0f} |"
            f" {v['conc_ttfc_p50_us']:,.0f} / {v['conc_ttfc_p99_us']:,.0f} |"
        )
    r = out["ratios"]
    rows.append(
        f"| **reach / raw** | **{r['seq_rate']:.2f}x** (goal >= 0.7) |"
        f" **{r['seq_ttfc']:.2f}x** (goal <= 1.2) | **{r['conc_rate']:.2f}x** |"
        f" **{r['conc_ttfc']:.2f}x** |"
    )
    return "\n".join(rows)


def main() -> int:
    parser = rounds_parser(__doc__, inflight=8)
    parser.add_argument("--chunks", type=int, default=200, help="chunks per stream")
    parser.add_argument("--chunk", type=int, default=64, help="bytes per chunk")
    parser.add_argument("--window", type=int, default=16, help="chunks granted ahead")
    args = settle(parser.parse_args())
    with NatsServer() as server, Fleet(server.url, args.chunk):
        out = asyncio.run(measure(args, server.url))
    out["setup"] = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "inflight": args.inflight,
        "chunks_per_stream": args.chunks,
        "chunk_bytes": args.chunk,
        "window": args.window,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"streaming replies, {args.chunks} chunks of {args.chunk} bytes per stream, window"
        f" {args.window}; registry + 1 instance (reach agent and raw responder in one"
        f" process); {args.rounds} interleaved rounds x {args.seconds:g} s"
    )
    print(f"settings (defaults; REACH_* and .env ignored): {shown(defaults(server.url))}")
    print()
    print(table(out, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
