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

Writes per task, for each variant and concurrency: what the server stored during the measured
runs, divided by the tasks they completed. Read from the streams' state (`$JS.API.STREAM.LIST`:
each stream's last sequence and message count) before and after each run, once the run's last
acks have landed, so nothing is added to the path being timed and nothing in reach is counted
by reach itself: a write no code path owns up to is counted all the same. With the shipped
`sync_interval: always`, each stored write is an fsync, and one stream stores its writes one
at a time. Columns: task messages (the work stream: a submit, a requeue), record writes
(`KV_reach_tasks`), claims (`KV_reach_idem`: idempotency keys, run claims and their releases),
other (any other file-storage stream: dead letters, advisories, taskiq's results), and acks
(messages removed from the work stream: with work-queue retention an ack deletes its message).
An ack stores no message, but nats-server 2.15 writes a delete tombstone for each removal it
is asked for, and with `sync_interval: always` fsyncs it (500 acks, 511 fsync calls under
strace), so the last column counts them too: fsyncs per task. Memory-storage streams (the
agents' leases) are left out: nothing of theirs is fsynced.

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
    BARE_STREAM,
    TASKIQ_POLL,
    TASKIQ_STREAM,
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
#: what each stream holds, for the writes per task (reach's names under the prefix "reach")
ROLES = {
    BARE_STREAM: "messages",
    TASKIQ_STREAM: "messages",
    "REACH_TASKS": "messages",
    "KV_reach_tasks": "records",
    "KV_reach_idem": "claims",
}
WRITE_COLUMNS = ("messages", "records", "claims", "other")
SETTLE = 5.0  # s at most a run's last acks may take to land before its writes are read


class Ledger:
    """Stored writes per task, from the server's stream state read around each run.

    ``before()`` and ``after(variant, n, tasks)`` bracket one timed run; ``after`` first
    waits (up to ``SETTLE`` s) until the work streams hold no more messages than before,
    so the acks of the run's last tasks, sent after their results, are in. Between runs
    only: the timed path carries nothing extra.
    """

    def __init__(self, nc: Any) -> None:
        self.js = nc.jetstream()
        self.totals: dict[str, dict[str, dict[str, int]]] = {}
        self._before: dict[str, tuple[int, int, str]] = {}

    async def state(self) -> dict[str, tuple[int, int, str]]:
        """Each stream's (last sequence, messages, storage)."""
        return {
            i.config.name or "": (i.state.last_seq, i.state.messages, str(i.config.storage))
            for i in await self.js.streams_info()
        }

    async def before(self) -> None:
        self._before = await self.state()

    async def after(self, variant: str, n: int, tasks: int) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + SETTLE
        while True:
            now = await self.state()
            held = [
                name
                for name, (_, msgs, _) in now.items()
                if ROLES.get(name) == "messages" and msgs > self._before.get(name, (0, 0, ""))[1]
            ]
            if not held or loop.time() > until:
                break
            await asyncio.sleep(0.05)  # a bench waiting on the server, not a test
        row = self.totals.setdefault(variant, {}).setdefault(
            str(n), dict.fromkeys((*WRITE_COLUMNS, "acks", "tasks"), 0)
        )
        row["tasks"] += tasks
        for name, (last, msgs, storage) in now.items():
            last0, msgs0, _ = self._before.get(name, (0, 0, ""))
            role = ROLES.get(name, "other")
            if "memory" in storage.lower() and role == "other":
                continue  # leases and such: not fsynced
            row[role] += last - last0
            if role == "messages":
                row["acks"] += (last - last0) - (msgs - msgs0)

    def per_task(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for variant, by_level in self.totals.items():
            for n, row in by_level.items():
                if not row["tasks"]:
                    continue
                cells = {k: row[k] / row["tasks"] for k in (*WRITE_COLUMNS, "acks")}
                cells["stored"] = sum(cells[k] for k in WRITE_COLUMNS)
                cells["fsyncs"] = cells["stored"] + cells["acks"]
                cells["tasks"] = row["tasks"]
                out.setdefault(variant, {})[n] = cells
        return out


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
        stats_nc = await nats.connect(url)
        stack.push_async_callback(stats_nc.close)
        ledger = Ledger(stats_nc)
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
            await ledger.before()

        async def counted(name: str, n: int, calls_made: int) -> None:
            if name != REQUEST:
                await ledger.after(name, n, calls_made)

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
            after=counted,
            tolerated=tolerated,
        )
        if taskiq is not None:
            out["taskiq"]["stuck_consumers"] = taskiq.stuck

    out["levels"] = levels
    out["rounds"] = per_round
    out["writes"] = ledger.per_task()
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


def writes_table(out: dict[str, Any]) -> str:
    """Writes per task by variant and concurrency (``Ledger``)."""
    rows = [
        "| variant | in flight | task messages | record writes | claims | other"
        " | stored writes | acks | **fsyncs** | tasks counted |",
        "|---" * 10 + "|",
    ]
    for name, by_level in out["writes"].items():
        for n, c in by_level.items():
            cells = [f"{c[k]:.2f}" for k in (*WRITE_COLUMNS, "stored", "acks")]
            rows.append(
                f"| {name} | {n} | " + " | ".join(cells) + f" | **{c['fsyncs']:.2f}**"
                f" | {c['tasks']:,.0f} |"
            )
    return "\n".join(rows)


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
    print()
    print("writes per task in the measured runs, from the streams' state: each stored write is")
    print("an fsync with sync_interval: always, and so is each ack (a delete tombstone):")
    print()
    print(writes_table(out))


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
