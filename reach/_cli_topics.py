"""The topic commands of ``reach``: ``publish`` (``--durable``: stored, or an error),
``listen`` (``--since``: the stored history first, then live) and ``topics init`` (the
topics stream made at deploy time). They use the ``Client`` API (``topics init``: the
topics side, ``_topics.DurableTopics``, on a client's connection); errors end the command
through ``cli.main`` (``error: <code>: <message>``, exit 1)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from ._cli_common import PAYLOAD_HELP, duration_of, read_payload
from ._client import Client
from ._topics import DurableTopics, Since
from .settings import ReachSettings

__all__ = ["add_topic_commands", "parse_since"]

_NAME = "reach-cli"


def parse_since(text: str) -> Since:
    """``--since``: a duration before now (``90s``, ``10m``, ``2h``, ``7d``, or several:
    ``1h30m``), a stream sequence (a bare number), or an ISO 8601 time (``2026-05-01T08:00``,
    UTC unless it names its zone). argparse type: anything else is a usage error."""
    text = text.strip()
    if text.isdigit():
        if int(text) >= 1:
            return int(text)
    elif (duration := duration_of(text)) is not None and duration < datetime.timedelta.max:
        return duration
    else:
        with contextlib.suppress(ValueError):
            return datetime.datetime.fromisoformat(text)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a time to start from: give a duration before now (90s, 10m, 2h,"
        " 7d), a stream sequence (a number >= 1) or an ISO 8601 time (2026-05-01T08:00)"
    )


async def _publish(args: argparse.Namespace, settings: ReachSettings) -> int:
    payload = read_payload(args.payload)
    async with Client(settings=settings, name=_NAME) as client:
        seq = await client.publish(args.topic, payload, durable=args.durable)
        await client.flush()
    if args.durable:
        print(seq)  # its sequence in the topics stream: `reach listen --since SEQ`
    return 0


async def _listen(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name=_NAME) as client:
        sub = await client.subscribe(args.topic, since=args.since)
        since = f" since {args.since}" if args.since is not None else ""
        print(f"# listening on {args.topic}{since}", file=sys.stderr, flush=True)
        count = 0
        async with sub:
            async for msg in sub:
                try:
                    value: Any = msgspec.json.decode(msg.data) if msg.data else None
                except msgspec.DecodeError:
                    value = msg.data.decode("utf-8", "replace")
                line: dict[str, Any] = {"topic": msg.topic, "data": value}
                if msg.seq:
                    line["seq"] = msg.seq
                    line["time"] = msg.time.isoformat() if msg.time else None
                print(json.dumps(line, ensure_ascii=False), flush=True)
                count += 1
                if args.count and count >= args.count:
                    break
    return 0


async def _topics(args: argparse.Namespace, settings: ReachSettings) -> int:
    """``topics init``: make the topics stream (and the DLQ stream) now, at deploy time,
    as a user allowed to: agents and clients then find them."""
    async with Client(settings=settings, name=_NAME) as client:
        topics = DurableTopics(settings, client.subjects)
        try:
            store = await topics.ready(client.nc)
        finally:
            await topics.close()
    if args.json:
        out = {"streams": [store.stream, store.dlq_stream], "replicas": settings.stream_replicas}
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"topic streams {store.stream} and {store.dlq_stream} ready"
        f" ({settings.stream_replicas} replica(s); topics kept"
        f" {settings.topic_retention:g}s, at most {settings.topic_max_bytes} bytes)"
    )
    return 0


def add_topic_commands(
    sub: Any, with_url: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Add ``publish``, ``listen`` and ``topics`` to the ``reach`` parser's subcommands."""
    p = with_url(sub.add_parser("publish", help="broadcast a JSON payload on a topic"))
    p.add_argument("topic")
    p.add_argument("payload", nargs="?", default="null", help=PAYLOAD_HELP)
    p.add_argument(
        "--durable",
        action="store_true",
        help="return once the server stored it (stream REACH_TOPICS); print its sequence",
    )
    p.set_defaults(run=_publish, is_async=True)

    p = with_url(sub.add_parser("listen", help="print every broadcast on a topic as JSON lines"))
    p.add_argument("topic", help="topic, wildcards allowed (order.*, order.>)")
    p.add_argument("--count", type=int, default=0, help="exit after this many messages")
    p.add_argument(
        "--since",
        type=parse_since,
        default=None,
        metavar="WHEN",
        help="first what the topics stream kept from WHEN (10m, 2h, 7d; a stream sequence;"
        " an ISO time), then live messages",
    )
    p.set_defaults(run=_listen, is_async=True)

    p = with_url(
        sub.add_parser("topics", help="'topics init' makes the durable topics stream (deploy)")
    )
    p.add_argument("action", choices=["init"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_topics, is_async=True)
