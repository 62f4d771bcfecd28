"""Durable topics end to end: reach vs a bare nats-py JetStream publish + pull-consume loop.

One nats-server from the shipped `nats-server.conf` (file storage, `sync_interval: always`)
on a random loopback port. The consumers run in a process of their own; the publishing
side is this process. A message counts when its publisher has seen the consumer's notice
of it (a core NATS publish on `bench.seen.<variant>` carrying the body): end-to-end
messages/s in a closed loop with 1 and N (default 64) messages in flight, each publish
awaiting the server's acknowledgement.

Variants (`--variants`, default all):
- `bare`: stream `BARE_TOPICS` (limits retention, file storage) and one durable pull
  consumer; the publisher awaits `js.publish`, the consumer keeps one pull request for up
  to 64 messages open and, in its subscription callback, publishes each notice and acks
  it, one message after the other. No handler decoding, no leases, no retries: the floor
  a durable topic builds on.
- `reach`: `client.publish(topic, body, durable=True)` to an agent process's
  `@agent.on_topic("bench.work.>", durable=True)` (default settings: `topic_concurrency`
  0, so `max_concurrency`, 8, handlers per instance), which publishes the notice.
- `reach-ordered`: the same with `ordered=True` (one message in flight for the name).

Rounds interleave the variants (rotating their order); ratios are computed within each
round and the median over rounds is reported. 256-byte JSON bodies.

    python bench/topics.py [--quick] [--rounds 5] [--seconds 2] [--inflight 64]
                           [--variants bare,reach,reach-ordered] [--fsync always|default]
                           [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import nats
from _fleet import (
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
)
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig
from request_reply import SIZE

import reach
from reach.testing import NatsServer, config_with_store

VARIANTS = ("bare", "reach", "reach-ordered")
CONFIG = Path(__file__).resolve().parent.parent / "nats-server.conf"
TOPIC = {"reach": "bench.work.one", "reach-ordered": "bench.ordered.one"}
BARE_STREAM, BARE_SUBJECT, BARE_CONSUMER = "BARE_TOPICS", "bare.topic.work", "bare"
_ID = slice(7, 19)  # where a body carries its id: b'{"id": 000000000042, ...'


def body_of(n: int) -> bytes:
    head = f'{{"id": {n:012d}, "pad": "'.encode()
    return head + b"x" * (SIZE - len(head) - 2) + b'"}'


def seen(variant: str) -> str:
    return f"bench.seen.{variant}"


async def wait_stop(stop: Any) -> None:
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)


def run_bare_consumer(url: str, ready: Any, stop: Any) -> None:
    """The stream and its durable pull consumer, served by one pull request at a time for
    up to 64 messages (5 s expiry), each handled as it arrives: notice, ack. (nats-py's
    ``fetch(64)``, once it has a message, waits for the other 63 until its timeout: with
    few messages in flight it stalls, so the floor is this loop.)"""

    async def main() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name=BARE_STREAM, subjects=[BARE_SUBJECT], storage=StorageType.FILE)
        )
        config = ConsumerConfig(durable_name=BARE_CONSUMER, ack_policy=AckPolicy.EXPLICIT)
        await js.add_consumer(BARE_STREAM, config)
        api = f"$JS.API.CONSUMER.MSG.NEXT.{BARE_STREAM}.{BARE_CONSUMER}"
        inbox = nc.new_inbox()
        notice = seen("bare")
        left = 0
        ended = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            nonlocal left
            if msg.reply and msg.reply.startswith("$JS.ACK."):
                await nc.publish(notice, msg.data)
                await msg.ack()
                left -= 1
                if left > 0:
                    return
            elif (msg.headers or {}).get("Status") == "100":
                return  # an idle heartbeat
            left = 0
            ended.set()

        await nc.subscribe(inbox, cb=on_msg)

        async def serve() -> None:
            nonlocal left
            request = json.dumps({"batch": 64, "expires": 5_000_000_000}).encode()
            while True:
                ended.clear()
                left = 64
                await nc.publish(api, request, reply=inbox)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), 10)

        task = asyncio.ensure_future(serve())
        ready.set()
        await wait_stop(stop)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await nc.close()

    asyncio.run(main())


def run_agent(url: str, concurrency: int | None, ready: Any, stop: Any) -> None:
    """One agent instance with a durable subscription and an ordered one."""

    async def main() -> None:
        kw = {} if concurrency is None else {"topic_concurrency": concurrency}
        agent = reach.Agent("bench-topics", settings=defaults(url, **kw))

        @agent.on_topic("bench.work.>", durable=True)
        async def work(body: bytes) -> None:
            await agent.client.nc.publish(seen("reach"), body)

        @agent.on_topic("bench.ordered.>", durable=True, ordered=True)
        async def ordered(body: bytes) -> None:
            await agent.client.nc.publish(seen("reach-ordered"), body)

        async with agent:
            ready.set()
            await wait_stop(stop)

    asyncio.run(main())


class Notices:
    """The publisher's side: a future per message in flight, resolved by its notice."""

    def __init__(self) -> None:
        self.waiting: dict[bytes, asyncio.Future[None]] = {}
        self.next = 0

    async def on_notice(self, msg: Msg) -> None:
        fut = self.waiting.pop(msg.data[_ID], None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def new(self) -> tuple[bytes, asyncio.Future[None]]:
        self.next += 1
        body = body_of(self.next)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[body[_ID]] = fut
        return body, fut


async def publishers(args: argparse.Namespace, url: str, stack: contextlib.AsyncExitStack) -> Any:
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    notices = Notices()
    for variant in args.variants:
        await nc.subscribe(seen(variant), cb=notices.on_notice)
    await nc.flush()
    js = nc.jetstream()
    client = await stack.enter_async_context(
        reach.Client(settings=defaults(url), name="bench-topics")
    )

    def bare() -> Any:
        async def call() -> None:
            body, fut = notices.new()
            await js.publish(BARE_SUBJECT, body, stream=BARE_STREAM)
            await fut

        return call

    def via_reach(topic: str) -> Any:
        async def call() -> None:
            body, fut = notices.new()
            await client.publish(topic, body, durable=True)
            await fut

        return call

    calls = {"bare": bare(), "reach": via_reach(TOPIC["reach"])}
    calls["reach-ordered"] = via_reach(TOPIC["reach-ordered"])
    calls = {k: v for k, v in calls.items() if k in args.variants}
    for fn in calls.values():
        await asyncio.wait_for(fn(), 30)  # each goes through once
    return calls


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        calls = await publishers(args, url, stack)
        levels = sorted({1, args.inflight})
        names = list(calls)
        for name in names:
            for n in levels:
                await closed_loop(calls[name], args.warmup, n)
        per_round, lat = await interleaved(calls, levels, args.rounds, args.seconds)
    out["levels"] = levels
    out["rounds"] = per_round
    out["variants"] = summary(per_round, lat)
    pairs = [("reach", "bare"), ("reach-ordered", "bare"), ("reach-ordered", "reach")]
    out["ratios"] = {
        f"{a} / {b}": {str(n): median_ratio(per_round, a, b, str(n)) for n in levels}
        for a, b in pairs
        if a in names and b in names
    }
    return out


def main() -> int:
    parser = round_parser(__doc__, VARIANTS)
    parser.add_argument(
        "--fsync",
        choices=["always", "default"],
        default="always",
        help="always: the shipped nats-server.conf (fsync before each ack); default: the"
        " server's own default (fsync every 2 minutes), where the server is less the limit",
    )
    parser.add_argument(
        "--topic-concurrency", type=int, help="the agent's topic_concurrency (default: 0)"
    )
    args = parse_rounds(parser, VARIANTS)
    with tempfile.TemporaryDirectory(prefix="reach-bench-topics-") as data:
        config = config_with_store(CONFIG, Path(data)) if args.fsync == "always" else None
        # -m -1: the shipped config's fixed monitoring port may be taken; any free one will do.
        with NatsServer(config_file=config, extra_args=("-m", "-1")) as server:
            url = server.url
            children = Children()
            if "bare" in args.variants:
                children.add(run_bare_consumer, url)
            if {"reach", "reach-ordered"} & set(args.variants):
                children.add(run_agent, url, args.topic_concurrency)
            with children:
                out = asyncio.run(measure(args, url))
    out["setup"] = round_setup(
        args,
        payload_bytes=SIZE,
        fsync=args.fsync,
        agent_settings=shown(
            defaults(url)
            if args.topic_concurrency is None
            else defaults(url, topic_concurrency=args.topic_concurrency)
        ),
    )
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"durable topics end to end (durable publish, consume, notice seen by the publisher),"
        f" {SIZE}-byte bodies; nats-server "
        + (
            f"from {CONFIG.name} (file storage, sync_interval: always)"
            if args.fsync == "always"
            else "with its default fsync (every 2 minutes)"
        )
        + f"; consumers in one other process; {args.rounds} interleaved rounds x"
        f" {args.seconds:g} s"
    )
    print()
    print(rate_table(out, "msgs"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
