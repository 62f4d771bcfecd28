"""Request/reply on the default path: reach vs raw nats-py, same server, same run.

What users get by default: a registry running (its own process), two agent instances (one
process each, default settings: balanced routing, max_concurrency 8, max_queue 64, whatever
REACH_* variables the shell exports or a .env holds; printed under "setup") and a
`reach.Client` whose routing table holds both. Each instance process also runs a raw nats-py
responder in queue group `raw`, doing the same per-request work as the reach handler: msgspec
JSON decode of the 256-byte request and encode of the reply.

Client variants, all in this process, all sending the same 256 pre-encoded bytes and
decoding the reply:
- `reach`: `client.request(capability, body)`, balanced routing to a direct subject.
- `raw nc.request`: nats-py's own `nc.request`. By default it IS a muxed inbox: one
  wildcard subscription `_INBOX.<nuid>.*` for all replies, a future per request keyed by a
  token, and `asyncio.wait_for` for the timeout (`old_style=True` would be a subscription
  per request; not measured).
- `raw mux`: the same muxed inbox written by hand with a subscription callback and one
  `loop.call_later` timer per request instead of `wait_for` (the technique reach's Client
  uses): the tightest raw baseline.

Telemetry variants, same fleet: each instance process also runs an agent with
`Telemetry.off()` (capability `bench.echo.off`) and one tracing every request at sample
ratio 1.0 (`bench.echo.traced`, SDK tracer provider, batch processor, an exporter that
drops the spans); the client side of each uses the same telemetry setting.
- `reach` is the default: metrics on (scrape-time counters), no tracer provider.
- `reach telemetry off`: no metrics, no spans. Goal: `reach` >= 0.95x of it.
- `reach traced`: metrics and a span per attempt and per handler run, at 1.0 sampling.

Gather variants, same fleet: `reach gather` is `client.gather(capability, body)`, one
request to each of the two instances at once, returning when both have answered; `raw
gather` is two nats-py `nc.request`s to the raw responders under `asyncio.gather`. Their
ratio is reported (rates in gathers per second); a gather in which an instance failed is
counted (it should be none) and still timed.

Shortcuts variant, same fleet: `reach shortcuts off` is `reach` with `nats_shortcuts=False`
on both sides (capability `bench.echo.plain`): nats-py's public API only. Each private
shortcut must earn 10% or more here (`reach / reach shortcuts off`), or go.

Rounds interleave every variant (rotating their order), sequentially and with N in flight;
ratios reach/raw are computed within each round and the median over rounds is reported.

    python bench/request_reply.py [--quick] [--rounds 5] [--seconds 2] [--inflight 64]
                                  [--uvloop] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from typing import Any

import msgspec
import nats
from _fleet import Call, Children, closed_loop, defaults, pct, run_registry, shown

import reach
from reach.testing import NatsServer, eventually

RAW = "bench.raw"
CAP = "bench.echo"
CAP_OFF = "bench.echo.off"
CAP_TRACED = "bench.echo.traced"
CAP_PLAIN = "bench.echo.plain"
SIZE = 256


def tracer_provider() -> Any:
    """Every span sampled and batched, then dropped: the cost of tracing, not of a collector."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    return provider


def payload() -> bytes:
    """A realistic JSON request of exactly SIZE bytes."""
    value: dict[str, Any] = {
        "order_id": "A-1029384756",
        "customer": "c-000123",
        "items": [{"sku": "sku-1", "qty": 2}, {"sku": "sku-2", "qty": 1}],
        "note": "",
    }
    value["note"] = "x" * (SIZE - len(msgspec.json.encode(value)))
    body = msgspec.json.encode(value)
    assert len(body) == SIZE, len(body)
    return body


# -- child processes: the registry, and two instances (a reach agent + a raw responder) ----


def run_instance(url: str, index: int, served: Any, ready: Any, stop: Any) -> None:
    async def main() -> None:
        count = {"raw": 0, "reach": 0}
        nc = await nats.connect(url)

        async def raw(msg: Any) -> None:
            count["raw"] += 1
            await nc.publish(msg.reply, msgspec.json.encode(msgspec.json.decode(msg.data)))

        await nc.subscribe(RAW, queue="raw", cb=raw)
        await nc.flush()
        agent = reach.Agent("bench", f"bench-{index}", settings=defaults(url))
        off = reach.Agent(
            "bench-off",
            f"bench-off-{index}",
            settings=defaults(url),
            telemetry=reach.Telemetry.off(),
        )
        traced = reach.Agent(
            "bench-traced",
            f"bench-traced-{index}",
            settings=defaults(url),
            telemetry=reach.Telemetry(tracer_provider=tracer_provider()),
        )

        @agent.capability(CAP)
        async def echo(value: dict[str, Any]) -> dict[str, Any]:
            count["reach"] += 1
            return value

        @off.capability(CAP_OFF)
        async def echo_off(value: dict[str, Any]) -> dict[str, Any]:
            return value

        @traced.capability(CAP_TRACED)
        async def echo_traced(value: dict[str, Any]) -> dict[str, Any]:
            return value

        plain = reach.Agent(
            "bench-plain",
            f"bench-plain-{index}",
            settings=defaults(url).model_copy(update={"nats_shortcuts": False}),
        )

        @plain.capability(CAP_PLAIN)
        async def echo_plain(value: dict[str, Any]) -> dict[str, Any]:
            return value

        async with agent, off, traced, plain:
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await nc.close()
        served.put((index, count))

    asyncio.run(main())


class Fleet(Children):
    """The registry and the two instances, each in its own process, on the defaults."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.served = self.queue()
        self.add(run_registry, url)
        for i in range(2):
            self.add(run_instance, url, i, self.served)

    def counts(self) -> dict[int, dict[str, int]]:
        """What each instance served, once it has stopped."""
        return dict(self.served.get(timeout=30) for _ in range(2))


# -- the client side ----------------------------------------------------------------------


class Mux:
    """A hand-written muxed inbox: one wildcard subscription, futures by token, a timer."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.pending: dict[str, asyncio.Future[Any]] = {}
        self.prefix = ""
        self.seq = 0

    async def start(self) -> None:
        self.prefix = self.nc.new_inbox() + "."
        await self.nc.subscribe(self.prefix + "*", cb=self.on_reply)
        await self.nc.flush()

    async def on_reply(self, msg: Any) -> None:
        fut = self.pending.get(msg.subject[len(self.prefix) :])
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def request(self, subject: str, body: bytes, timeout: float) -> Any:
        self.seq += 1
        token = str(self.seq)
        fut = asyncio.get_running_loop().create_future()
        self.pending[token] = fut
        timer = asyncio.get_running_loop().call_later(timeout, expire, fut)
        try:
            await self.nc.publish(subject, body, reply=self.prefix + token)
            return await fut
        finally:
            timer.cancel()
            del self.pending[token]


def expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    body = payload()
    settings = defaults(url)
    nc = await nats.connect(url)
    mux = Mux(nc)
    await mux.start()
    off_client = reach.Client(settings=settings, name="bench-off", telemetry=reach.Telemetry.off())
    traced_client = reach.Client(
        settings=settings,
        name="bench-traced",
        telemetry=reach.Telemetry(tracer_provider=tracer_provider()),
    )
    plain_client = reach.Client(
        settings=settings.model_copy(update={"nats_shortcuts": False}), name="bench-plain"
    )
    async with (
        reach.Client(settings=settings, name="bench") as client,
        off_client,
        traced_client,
        plain_client,
    ):

        async def both_known() -> bool:
            for c, cap in (
                (client, CAP),
                (off_client, CAP_OFF),
                (traced_client, CAP_TRACED),
                (plain_client, CAP_PLAIN),
            ):
                records = await c.agents(cap)
                if len(records) != 2 or not all(
                    r.status == reach.Status.UP and r.heartbeat for r in records
                ):
                    return False
            return True

        await eventually(both_known, timeout=60)
        # Status changes while measuring (an instance whose queue passes 80% of max_queue
        # reports DEGRADED, and balanced routing then steers away from it).
        changes: dict[str, int] = {}

        async def on_event(msg: Any) -> None:
            ev = msgspec.json.decode(msg.data, type=reach.AgentEvent)
            key = f"{ev.agent_id} -> {'gone' if ev.removed else ev.new.value}"
            changes[key] = changes.get(key, 0) + 1

        await client.nc.subscribe(client.subjects.event("*"), cb=on_event)
        await client.flush()

        async def reach_call() -> None:
            await client.request(CAP, body, timeout=5)

        async def reach_off() -> None:
            await off_client.request(CAP_OFF, body, timeout=5)

        async def reach_traced() -> None:
            await traced_client.request(CAP_TRACED, body, timeout=5)

        async def reach_plain() -> None:
            await plain_client.request(CAP_PLAIN, body, timeout=5)

        failed_gathers = 0

        async def reach_gather() -> None:
            nonlocal failed_gathers
            result = await client.gather(CAP, body, timeout=5)
            if len(result.replies) != 2:
                failed_gathers += 1

        async def raw_gather() -> None:
            msgs = await asyncio.gather(
                nc.request(RAW, body, timeout=5), nc.request(RAW, body, timeout=5)
            )
            for msg in msgs:
                msgspec.json.decode(msg.data)

        async def raw_request() -> None:
            msg = await nc.request(RAW, body, timeout=5)
            msgspec.json.decode(msg.data)

        async def raw_mux() -> None:
            msg = await mux.request(RAW, body, 5)
            msgspec.json.decode(msg.data)

        variants: dict[str, Call] = {
            "reach": reach_call,
            "reach telemetry off": reach_off,
            "reach traced": reach_traced,
            "reach shortcuts off": reach_plain,
            "raw nc.request": raw_request,
            "raw mux": raw_mux,
            "reach gather": reach_gather,
            "raw gather": raw_gather,
        }
        # Same answer on every path, and reach really spreads over both instances.
        assert len((await nc.request(RAW, body, timeout=5)).data) == SIZE
        assert len((await mux.request(RAW, body, 5)).data) == SIZE
        by = {(await client.call(CAP, body)).agent_id for _ in range(200)}
        assert by == {"bench-0", "bench-1"}, by
        assert sorted((await client.gather(CAP, body)).replies) == ["bench-0", "bench-1"]
        for fn in variants.values():  # warm up
            await closed_loop(fn, args.warmup, 1)
            await closed_loop(fn, args.warmup, args.inflight)

        names = list(variants)
        per_round: list[dict[str, dict[str, float]]] = []
        lat: dict[str, dict[str, list[float]]] = {n: {"seq": [], "conc": []} for n in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            rates: dict[str, dict[str, float]] = {n: {} for n in names}
            for mode, inflight in (("seq", 1), ("conc", args.inflight)):
                for name in order:
                    rate, values = await closed_loop(variants[name], args.seconds, inflight)
                    rates[name][mode] = rate
                    lat[name][mode] += values
            per_round.append(rates)
    await nc.close()

    out: dict[str, Any] = {
        "variants": {},
        "ratios": {},
        "telemetry": {},
        "rounds": per_round,
        "status_changes": changes,
        "failed_gathers": failed_gathers,
    }
    for name in names:
        out["variants"][name] = {
            f"{mode}_{what}": value
            for mode in ("seq", "conc")
            for what, value in (
                ("rate", statistics.median(r[name][mode] for r in per_round)),
                ("p50_us", pct(lat[name][mode], 0.5) * 1e3),
                ("p99_us", pct(lat[name][mode], 0.99) * 1e3),
            )
        }
    for raw in ("raw nc.request", "raw mux"):
        out["ratios"][raw] = {
            mode: statistics.median(r["reach"][mode] / r[raw][mode] for r in per_round)
            for mode in ("seq", "conc")
        }
    out["ratios"]["raw gather"] = {
        mode: statistics.median(r["reach gather"][mode] / r["raw gather"][mode] for r in per_round)
        for mode in ("seq", "conc")
    }
    for a, b in (
        ("reach", "reach telemetry off"),
        ("reach traced", "reach telemetry off"),
        ("reach", "reach shortcuts off"),
    ):
        out["telemetry"][f"{a} / {b}"] = {
            mode: statistics.median(r[a][mode] / r[b][mode] for r in per_round)
            for mode in ("seq", "conc")
        }
    return out


def table(out: dict[str, Any], args: argparse.Namespace) -> str:
    n = args.inflight
    rows = [
        f"| client | sequential req/s | p50 / p99 µs | {n} in flight req/s | p50 / p99 µs |",
        "|---|---|---|---|---|",
    ]
    for name, v in out["variants"].items():
        rows.append(
            f"| {name} | {v['seq_rate']:,.0f} | {v['seq_p50_us']:,.0f} / {v['seq_p99_us']:,.0f}"
            f" | {v['conc_rate']:,.0f} | {v['conc_p50_us']:,.0f} / {v['conc_p99_us']:,.0f} |"
        )
    for raw, r in out["ratios"].items():
        mine = "reach gather" if raw == "raw gather" else "reach"
        rows.append(f"| **{mine} / {raw}** | **{r['seq']:.2f}x** | | **{r['conc']:.2f}x** | |")
    for pair, r in out["telemetry"].items():
        rows.append(f"| **{pair}** | **{r['seq']:.2f}x** | | **{r['conc']:.2f}x** | |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds x 1 s, short warm-up")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--uvloop", action="store_true", help="run the client on uvloop")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.warmup = 0.5
    if args.quick:
        args.rounds, args.seconds, args.warmup = 3, 1.0, 0.3
    with NatsServer() as server, Fleet(server.url) as fleet:
        if args.uvloop:
            import uvloop

            out = uvloop.run(measure(args, server.url))
        else:
            out = asyncio.run(measure(args, server.url))
        fleet.stop.set()
        out["served"] = fleet.counts()
    out["setup"] = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "inflight": args.inflight,
        "loop": "uvloop" if args.uvloop else "asyncio",
        "payload_bytes": SIZE,
        "settings": defaults(server.url).model_dump(mode="json"),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"request/reply, {SIZE}-byte JSON; registry + 2 instances (balanced) vs 2 raw queue-group"
        f" responders; {args.rounds} interleaved rounds x {args.seconds:g} s;"
        f" {out['setup']['loop']}"
    )
    print(
        "served per instance (raw, reach): "
        + ", ".join(
            f"bench-{i} {c['raw']:,} / {c['reach']:,}" for i, c in sorted(out["served"].items())
        )
    )
    print(f"settings (defaults; REACH_* and .env ignored): {shown(defaults(server.url))}")
    changes = ", ".join(f"{k} x{n}" for k, n in sorted(out["status_changes"].items()))
    print(f"status changes while measuring: {changes or 'none'}")
    print(f"gathers in which an instance failed: {out['failed_gathers']:,}")
    print()
    print(table(out, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
