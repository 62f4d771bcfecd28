"""Durable tasks end to end: reach vs a bare JetStream work-queue loop vs taskiq-nats.

One nats-server from the shipped `nats-server.conf` (file storage, `sync_interval: always`)
on a random loopback port. Each worker is its own process; the submitting side is this
process. A task counts when its submitter has seen the result (reach: SUCCEEDED), so the
figure is end-to-end tasks/s, in a closed loop with 1 and N (default 64) in flight.

Variants (`--variants`, default all):
- `bare`: stream with work-queue retention on file storage, one durable pull consumer. The
  submitter publishes (awaiting the JetStream ack) with a reply subject in a header and waits
  on a muxed inbox; the worker fetches up to 64, publishes the body back on core NATS, acks.
  No state machine: the floor that a task runtime on JetStream builds on.
- `taskiq`: taskiq 0.13 + taskiq-nats 0.7, pull broker (same stream settings), NATS
  object-store result backend polled every 5 ms, worker via `taskiq.api.run_receiver_task`.
  It is first probed at N, 16, 4, 1 in flight and measured at the highest it survives (at
  1 too); reach/taskiq is computed at that same concurrency, and the probe is printed.
- `reach`: an agent process serving `@agent.task("bench.work")` (and the capability
  `bench.echo`), a registry process, and `client.submit()` then `ref.result()`.
- `reach+key`: the same with a unique `idempotency_key` per task: the cost of the claims.
With reach, one `client.request("bench.echo")` at a time is also timed, to report the added
latency of one task over one request/reply (p50 at 1 in flight).

Rounds interleave the variants (rotating their order); ratios are computed within each
round and the median over rounds is reported. 256-byte JSON bodies.

    python bench/tasks.py [--quick] [--rounds 5] [--seconds 2] [--inflight 64]
                          [--variants bare,taskiq,reach,reach+key] [--max-concurrency N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
from _fleet import (
    Call,
    Children,
    closed_loop,
    defaults,
    interleaved,
    median_ratio,
    parse_rounds,
    rate_table,
    round_parser,
    round_setup,
    shown,
    summary,
    whole_fleet,
)
from _tasks_baselines import (
    TASKIQ_POLL,
    BareSubmitter,
    TaskiqSubmitter,
    run_bare_worker,
    run_taskiq_worker,
    wait_stop,
)
from request_reply import SIZE, payload, run_registry

import reach
from reach.testing import NatsServer, config_with_store

VARIANTS = ("bare", "taskiq", "reach", "reach+key")
REQUEST = "request"  # reach request/reply to bench.echo, for the latency comparison only
WORK = "bench.work"
ECHO = "bench.echo"
CONFIG = Path(__file__).resolve().parent.parent / "nats-server.conf"


def run_agent(url: str, max_concurrency: int | None, ready: Any, stop: Any) -> None:
    """One agent instance: the durable task and a capability doing the same (nothing)."""

    async def main() -> None:
        kw = {} if max_concurrency is None else {"max_concurrency": max_concurrency}
        agent = reach.Agent("bench-tasks", settings=defaults(url, **kw))

        @agent.task(WORK)
        async def work(body: bytes) -> bytes:
            return body

        @agent.capability(ECHO)
        async def echo(body: bytes) -> bytes:
            return body

        async with agent:
            ready.set()
            await wait_stop(stop)

    asyncio.run(main())


class Workers(Children):
    """One worker process per selected variant (reach: an agent and a registry)."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        super().__init__()
        if "bare" in args.variants:
            self.add(run_bare_worker, url)
        if "taskiq" in args.variants:
            self.add(run_taskiq_worker, url)
        if {"reach", "reach+key"} & set(args.variants):
            self.add(run_registry, url)
            self.add(run_agent, url, args.max_concurrency)


def same(result: Any, body: bytes) -> bool:
    """The echoed body, whether it comes back raw or decoded from JSON."""
    return (result if isinstance(result, bytes) else msgspec.json.encode(result)) == body


def reason(exc: BaseException) -> str:
    """The first failure of a run, with its causes: what to print when taskiq gives up."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        parts.append(f"{type(seen).__name__}: {seen}".strip().rstrip(":"))
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(parts)


async def submitters(
    args: argparse.Namespace, url: str, stack: contextlib.AsyncExitStack
) -> tuple[dict[str, Call], TaskiqSubmitter | None]:
    """A call per selected variant, each checked once to return the body it was given."""
    body = payload()
    text = body.decode()
    calls: dict[str, Call] = {}
    taskiq: TaskiqSubmitter | None = None
    if "bare" in args.variants:
        nc = await nats.connect(url)
        stack.push_async_callback(nc.close)
        bare = BareSubmitter(nc)
        await bare.start()
        assert await bare.submit(body) == body
        calls["bare"] = lambda: bare.submit(body)
    if "taskiq" in args.variants:
        taskiq = TaskiqSubmitter(url)
        await taskiq.start()
        stack.push_async_callback(taskiq.close)
        assert await taskiq.submit(text) == text
        calls["taskiq"] = lambda: taskiq.submit(text)  # type: ignore[union-attr]
    if {"reach", "reach+key"} & set(args.variants):
        client = await stack.enter_async_context(
            reach.Client(settings=defaults(url), name="bench-tasks")
        )
        await whole_fleet(client, 1, ECHO)
        run = uuid.uuid4().hex[:8]
        keys = iter(range(1 << 62))

        async def task() -> Any:
            return await (await client.submit(WORK, body)).result()

        async def keyed() -> Any:
            key = f"{run}-{next(keys)}"
            return await (await client.submit(WORK, body, idempotency_key=key)).result()

        async def request() -> Any:
            return await client.request(ECHO, body)

        for name, fn in (("reach", task), ("reach+key", keyed), (REQUEST, request)):
            if name in args.variants or name == REQUEST:
                assert same(await fn(), body), name
                calls[name] = fn
    return calls, taskiq


async def taskiq_run(taskiq: TaskiqSubmitter, fn: Call, seconds: float, n: int) -> str:
    """One taskiq run from a clean state: "ok (...)" or "failed: why"."""
    await taskiq.settle()
    try:
        rate, _ = await closed_loop(fn, seconds, n)
    except Exception as exc:
        return "failed: " + reason(exc)
    return f"ok ({rate:,.0f}/s, {await taskiq.consumers()} result consumers open)"


async def probe_taskiq(
    taskiq: TaskiqSubmitter, fn: Call, args: argparse.Namespace
) -> tuple[int | None, dict[str, str]]:
    """The highest concurrency (N, 16, 4, 1) at which taskiq completes a run, and each try.

    A try starts clean and lasts ``--seconds``, as a measured run does. Whether it can keep
    1 in flight up for 8 s, longer than the ~5 s the server keeps each result read's
    consumer, is tried too and reported as "sustained".
    """
    tried: dict[str, str] = {}
    level = None
    for n in sorted({m for m in (args.inflight, 16, 4, 1) if m <= args.inflight}, reverse=True):
        tried[str(n)] = await taskiq_run(taskiq, fn, args.seconds, n)
        if tried[str(n)].startswith("ok"):
            level = n
            break
    tried["sustained"] = "x1 for 8 s: " + await taskiq_run(taskiq, fn, 8.0, 1)
    return level, tried


def runs_at(name: str, n: int, taskiq_level: int | None) -> bool:
    if name == REQUEST:
        return n == 1
    return name != "taskiq" or n in (1, taskiq_level)


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {"failures": [], "taskiq": {}}
    async with contextlib.AsyncExitStack() as stack:
        calls, taskiq = await submitters(args, url, stack)
        taskiq_level: int | None = None
        if taskiq is not None:
            taskiq_level, out["taskiq"]["probe"] = await probe_taskiq(taskiq, calls["taskiq"], args)
            out["taskiq"]["inflight"] = taskiq_level
            if taskiq_level is None:
                del calls["taskiq"]
        levels = sorted({1, args.inflight} | ({taskiq_level} if taskiq_level else set()))
        for name, fn in calls.items():  # warm up (taskiq was, by its probe)
            for n in levels:
                if name != "taskiq" and runs_at(name, n, taskiq_level):
                    await closed_loop(fn, args.warmup, n)
        names = list(calls)

        async def settle(name: str) -> None:
            if name == "taskiq" and taskiq is not None:
                await taskiq.settle()

        def tolerated(r: int, name: str, n: int, exc: Exception) -> bool:
            if name == "taskiq":
                out["failures"].append(f"round {r}, taskiq x{n}: {reason(exc)}")
            return name == "taskiq"

        per_round, lat = await interleaved(
            calls,
            levels,
            args.rounds,
            args.seconds,
            runs=lambda name, n: runs_at(name, n, taskiq_level),
            before=settle,
            tolerated=tolerated,
        )
        if taskiq is not None:
            out["taskiq"]["stuck_consumers"] = taskiq.stuck

    out["levels"] = levels
    out["rounds"] = per_round
    out["variants"] = summary(per_round, lat)
    out["ratios"] = {
        f"{a} / {b}": {str(n): median_ratio(per_round, a, b, str(n)) for n in levels}
        for a in ("reach", "reach+key")
        for b in ("bare", "taskiq", "reach")
        if a != b and a in names and b in names
    }
    v = out["variants"]
    if "reach" in v and REQUEST in v:
        out["added_latency_ms"] = {
            "task over request (p50, 1 in flight)": v["reach"]["1"]["p50_ms"]
            - v[REQUEST]["1"]["p50_ms"]
        }
        if "reach+key" in v:
            out["added_latency_ms"]["idempotency key (p50, 1 in flight)"] = (
                v["reach+key"]["1"]["p50_ms"] - v["reach"]["1"]["p50_ms"]
            )
    return out


def report(out: dict[str, Any], args: argparse.Namespace, url: str) -> None:
    setup = out["setup"]
    print(
        f"durable tasks end to end, {SIZE}-byte JSON; nats-server from {CONFIG.name} (file"
        f" storage, sync_interval: always); one worker process per variant;"
        f" {args.rounds} interleaved rounds x {args.seconds:g} s"
    )
    if {"reach", "reach+key"} & set(args.variants):
        print(
            f"reach agent settings (defaults; REACH_* and .env ignored): {setup['agent_settings']}"
        )
    tq = out["taskiq"]
    if "probe" in tq:
        print(f"taskiq (result poll {TASKIQ_POLL * 1000:g} ms), each run from a clean state:")
        for n, what in tq["probe"].items():
            print(f"  {'x' if n.isdigit() else ''}{n}: {what}")
        if tq["stuck_consumers"]:
            print(
                f"taskiq: up to {tq['stuck_consumers']} result consumers stayed open after"
                " cancelled reads (a failed run), counting against the server's 1000"
            )
        level = tq["inflight"]
        print(
            f"taskiq measured at 1 and {level} in flight; reach / taskiq is at those"
            if level
            else "taskiq could not complete a run at any concurrency: not measured"
        )
    for failure in out["failures"]:
        print(f"FAILED {failure}")
    print()
    print(rate_table(out, "tasks"))
    for what, ms in out.get("added_latency_ms", {}).items():
        print(f"added latency, {what}: {ms:+.2f} ms")


def main() -> int:
    parser = round_parser(__doc__, VARIANTS)
    parser.add_argument("--max-concurrency", type=int, help="the reach agent's max_concurrency")
    args = parse_rounds(parser, VARIANTS)
    with tempfile.TemporaryDirectory(prefix="reach-bench-tasks-") as data:
        config = config_with_store(CONFIG, Path(data))
        # -m -1: the shipped config's fixed monitoring port may be taken; any free one will do.
        with NatsServer(config_file=config, extra_args=("-m", "-1")) as server:
            url = server.url
            with Workers(url, args):
                out = asyncio.run(measure(args, url))
    kw = {} if args.max_concurrency is None else {"max_concurrency": args.max_concurrency}
    out["setup"] = round_setup(
        args,
        payload_bytes=SIZE,
        taskiq_poll_s=TASKIQ_POLL,
        agent_settings=shown(defaults(url, **kw)),
    )
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        report(out, args, url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
