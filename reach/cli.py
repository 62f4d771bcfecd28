"""The ``reach`` command: run a local server, call, publish, listen, and the demo."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from ._client import Client
from ._runtime import run_async
from ._server import NatsServer
from .errors import ConfigurationError, ReachError
from .settings import ReachSettings
from .wire import Priority

__all__ = ["main"]


def _settings(args: argparse.Namespace) -> ReachSettings:
    if getattr(args, "url", None):
        return ReachSettings(nats_url=args.url)
    return ReachSettings()


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"payload is not valid JSON: {exc}") from None


def _print_value(data: bytes) -> None:
    if not data:
        print("null")
        return
    try:
        print(json.dumps(msgspec.json.decode(data), indent=2, ensure_ascii=False))
    except msgspec.DecodeError:
        print(data.decode("utf-8", "replace"))


async def _call(args: argparse.Namespace) -> int:
    payload = _parse_json(args.payload)
    async with Client(settings=_settings(args), name="reach-cli") as client:
        reply = await client.call(
            args.capability,
            payload,
            timeout=args.timeout,
            priority=args.priority,
            agent_id=args.agent,
        )
    _print_value(reply.data)
    if args.verbose:
        print(f"# served by {reply.agent_id or '?'} in {reply.latency_ms:.1f} ms", file=sys.stderr)
    return 0


async def _publish(args: argparse.Namespace) -> int:
    payload = _parse_json(args.payload)
    async with Client(settings=_settings(args), name="reach-cli") as client:
        await client.publish(args.topic, payload)
        await client.flush()
    return 0


async def _listen(args: argparse.Namespace) -> int:
    async with Client(settings=_settings(args), name="reach-cli") as client:
        sub = await client.subscribe(args.topic)
        print(f"# listening on {args.topic}", file=sys.stderr, flush=True)
        count = 0
        async with sub:
            async for msg in sub:
                try:
                    value: Any = msgspec.json.decode(msg.data) if msg.data else None
                except msgspec.DecodeError:
                    value = msg.data.decode("utf-8", "replace")
                print(
                    json.dumps({"topic": msg.topic, "data": value}, ensure_ascii=False), flush=True
                )
                count += 1
                if args.count and count >= args.count:
                    break
    return 0


def _up(args: argparse.Namespace) -> int:
    """Run the wheel's nats-server in the foreground until Ctrl-C or SIGTERM."""
    config = args.config
    if config is None and Path("nats-server.conf").is_file():
        config = "nats-server.conf"
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        # nats-server refuses -sd beside a store_dir in the file: write the data dir in.
        text = Path(config).read_text()
        store = f'store_dir: "{data_dir / "jetstream"}"'
        text, found = re.subn(r"(?m)^\s*store_dir\s*[:=].*$", store, text)
        if not found:
            text += f"\njetstream {{\n  {store}\n}}\n"
        effective = data_dir / "nats-server.effective.conf"
        effective.write_text(text)
        config = str(effective)
    server = NatsServer(
        store_dir=data_dir / "jetstream",
        port=args.port,
        config_file=config,
        log_file=data_dir / "nats-server.log",
        extra_args=("-m", str(args.monitor_port)) if args.monitor_port is not None else (),
    )
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    print(server.url, flush=True)
    print(
        f"# nats-server pid {server.pid}, JetStream in {data_dir}, log {server.log_file}",
        file=sys.stderr,
        flush=True,
    )
    print(f"# export REACH_NATS_URL={server.url}", file=sys.stderr, flush=True)
    try:
        while not stop:
            if server.proc is not None and server.proc.poll() is not None:
                print(f"nats-server exited with {server.proc.returncode}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        server.close()
    print("# stopped", file=sys.stderr, flush=True)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_async(run_demo())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reach", description="Agent-Reach over NATS")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_url(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--url", help="NATS URL (default: $REACH_NATS_URL or the local server)")
        return p

    p = with_url(sub.add_parser("call", help="call a capability and print the JSON answer"))
    p.add_argument("capability")
    p.add_argument("payload", nargs="?", default="null", help="JSON payload")
    p.add_argument("--agent", help="direct call to this agent id (never substituted)")
    p.add_argument("--timeout", type=float, default=None, help="seconds")
    p.add_argument("--priority", default="normal", choices=[x.value for x in Priority])
    p.add_argument("-v", "--verbose", action="store_true", help="say who answered")
    p.set_defaults(run=_call, is_async=True)

    p = with_url(sub.add_parser("publish", help="broadcast a JSON payload on a topic"))
    p.add_argument("topic")
    p.add_argument("payload", nargs="?", default="null")
    p.set_defaults(run=_publish, is_async=True)

    p = with_url(sub.add_parser("listen", help="print every broadcast on a topic as JSON lines"))
    p.add_argument("topic", help="topic, wildcards allowed (order.*, order.>)")
    p.add_argument("--count", type=int, default=0, help="exit after this many messages")
    p.set_defaults(run=_listen, is_async=True)

    p = sub.add_parser("up", help="run a local nats-server (JetStream on) until Ctrl-C")
    p.add_argument("--config", default=None, help="config file (default ./nats-server.conf)")
    p.add_argument("--data-dir", default=os.environ.get("REACH_DATA_DIR", ".reach-data"))
    p.add_argument("--port", type=int, default=4222, help="-1 picks a free port")
    p.add_argument("--monitor-port", type=int, default=None)
    p.set_defaults(run=_up, is_async=False)

    p = sub.add_parser("demo", help="a self-contained customer-service scenario")
    p.set_defaults(run=_demo, is_async=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.is_async:
            code: int = run_async(args.run(args))
        else:
            code = args.run(args)
    except ReachError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: bad_request: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    raise SystemExit(main())
