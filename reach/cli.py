"""The ``reach`` command: run a local server, call, and the demo; the durable-task
commands (submit, tasks, dlq) live in ``_cli_tasks``, the topic ones (publish, listen,
topics) in ``_cli_topics``, ``run`` (an agent from an import path) in ``_cli_run`` and
``examples`` in ``_cli_examples``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from typing import Any, NoReturn

import msgspec
import nats.errors
from opentelemetry import trace

from ._cli_common import PAYLOAD_HELP
from ._cli_common import json_or_text as _json_or_text
from ._cli_common import print_value as _print_value
from ._cli_common import read_payload as _read_payload
from ._cli_common import status as _status
from ._cli_common import table as _table
from ._cli_contracts import add_contract_commands
from ._cli_examples import add_examples_commands
from ._cli_gateway import add_gateway_commands
from ._cli_run import add_run_command
from ._cli_schedules import add_schedule_commands
from ._cli_status import add_status_commands
from ._cli_tasks import add_task_commands
from ._cli_topics import add_topic_commands
from ._cli_up import up
from ._cli_wrap import add_wrap_commands
from ._client import Client, Gathered
from ._codec import now_ms
from ._nats import redact
from ._registry import Registry
from ._runtime import run_async
from ._telemetry import configure_logging, configure_tracing
from .errors import AgentUnavailable, ConfigurationError, ReachError, RequestTimeout
from .settings import ReachSettings
from .wire import AgentEvent, AgentRecord, Control, ControlReply, Priority, Status

__all__ = ["main"]


def _server_port(text: str) -> int:
    """A port for nats-server: 0 means any free port, as for the gateway, and nats-server
    itself spells that -1 (its 0 would mean its default, 4222)."""
    port = int(text)
    if not -1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (1-65535, or 0 for any)")
    return -1 if port == 0 else port


def _settings(args: argparse.Namespace) -> ReachSettings:
    """The command's settings, built once here at the edge: ``--url`` over ``REACH_*`` over
    the settings file (``--config``, else ``REACH_CONFIG``)."""
    values: dict[str, Any] = {}
    if getattr(args, "url", None) is not None:  # an empty --url is an error, not the default
        values["nats_url"] = args.url
    if getattr(args, "settings_file", None):
        values["config"] = args.settings_file
    return ReachSettings.load(**values)


async def _call(args: argparse.Namespace, settings: ReachSettings) -> int:
    payload = _read_payload(args.payload)
    if args.stream:
        if args.all:
            raise ConfigurationError("--stream asks one instance: not with --all")
        return await _stream(args, settings, payload)
    wait = args.timeout if args.timeout is not None else settings.timeout_ms / 1000
    # A backstop: connecting, the call's own deadline and closing each have their bound;
    # should one ever fail, the command still ends, saying so, instead of waiting forever.
    bound = settings.connect_timeout + wait + 10.0
    try:
        async with asyncio.timeout(bound) as limit:
            async with Client(settings=settings, name="reach-cli") as client:
                if args.all:
                    gathered = await client.gather(
                        args.capability, payload, timeout=args.timeout, priority=args.priority
                    )
                    return _print_gathered(gathered, args.verbose)
                reply = await client.call(
                    args.capability,
                    payload,
                    timeout=args.timeout,
                    priority=args.priority,
                    agent_id=args.agent,
                )
    except TimeoutError:
        if not limit.expired():
            raise
        raise RequestTimeout(
            f"reach call of {args.capability!r} did not end within {bound:g}s although every"
            " step has its own bound (a bug: please report it with the log)",
            capability=args.capability,
        ) from None
    _print_value(reply.data)
    if args.verbose:
        print(f"# served by {reply.agent_id or '?'} in {reply.latency_ms:.1f} ms", file=sys.stderr)
    return 0


async def _stream(args: argparse.Namespace, settings: ReachSettings, payload: Any) -> int:
    """``reach call --stream``: each chunk as one line of JSON as it arrives (``--timeout``
    bounds the wait for each); the error of a stream that fails after some, after them."""
    async with Client(settings=settings, name="reach-cli") as client:
        stream = client.stream(
            args.capability,
            payload,
            timeout=args.timeout,
            priority=args.priority,
            agent_id=args.agent,
            response_type=bytes,
        )
        async with stream:
            async for chunk in stream:
                print(json.dumps(_json_or_text(chunk), ensure_ascii=False), flush=True)
    if args.verbose:
        print(
            f"# streamed by {stream.agent_id or '?'}: {stream.chunks} chunk(s), the first in"
            f" {stream.latency_ms:.1f} ms",
            file=sys.stderr,
        )
    return 0


def _print_gathered(gathered: Gathered, verbose: bool) -> int:
    """One line per instance, in agent id order: its answer as one line of JSON, its
    error, or why it was not asked; exit 1 if any instance failed."""
    lines: list[tuple[str, str]] = []
    for agent_id, outcome in gathered.items():
        if isinstance(outcome, ReachError):
            lines.append((agent_id, f"error: {outcome.code}: {outcome.message}"))
            continue
        answer = json.dumps(_json_or_text(outcome.data), ensure_ascii=False)
        took = f"{outcome.latency_ms:.1f} ms  " if verbose else ""
        lines.append((agent_id, took + answer))
    lines += [(agent_id, f"skipped: {why}") for agent_id, why in gathered.skipped.items()]
    width = max(len(agent_id) for agent_id, _ in lines)
    for agent_id, text in sorted(lines):
        print(f"{agent_id:<{width}}  {text}")
    return 1 if gathered.errors else 0


async def _agents(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name="reach-cli") as client:
        records = everyone = await client.agents()
    if args.capability:  # served by request or as a task
        cap = args.capability
        records = [
            r for r in records if any(c.name == cap for c in [*r.info.capabilities, *r.info.tasks])
        ]
    if args.json:
        print(json.dumps([msgspec.to_builtins(r) for r in records], indent=2))
        return 0
    if not records:
        if args.capability and everyone:
            print(f"no agent offers {args.capability!r} ({len(everyone)} known)", file=sys.stderr)
        else:
            print("no agents known (is a registry running?)", file=sys.stderr)
        return 0
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    now = now_ms()
    rows = []
    for r in records:
        hb = r.heartbeat
        rows.append(
            [
                r.info.agent_id,
                r.info.name,
                _status(r.status.value, colour),
                ",".join(f"{c.name}@{c.version}" for c in r.info.capabilities) or "-",
                ",".join(f"{c.name}@{c.version}" for c in r.info.tasks) or "-",
                ",".join(r.info.tags),
                str(hb.inflight) if hb else "-",
                f"{hb.load:.2f}" if hb else "-",
                f"{hb.latency_ms:.1f}ms" if hb else "-",
                f"{(now - r.last_seen_ms) / 1000:.1f}s" if r.last_seen_ms else "-",
                _why(r),
            ]
        )
    header = [
        "AGENT",
        "NAME",
        "STATUS",
        "CAPABILITIES",  # served by request
        "TASKS",  # durable task capabilities (@agent.task)
        "TAGS",
        "INFLIGHT",
        "LOAD",
        "LATENCY",
        "SEEN",
        "REASON",
    ]
    print(_table(rows, header))
    return 0


def _why(r: AgentRecord) -> str:
    """Why an instance has its status: what its agent reported, else what the registry
    saw (a lease that lapsed, a probe lost); empty when UP."""
    hb = r.heartbeat
    if hb is not None and hb.status == r.status and hb.reason:
        return hb.reason
    last = r.transitions[-1] if r.transitions else None
    if r.status is Status.UP or last is None or last.new != r.status:
        return ""
    return last.detail or last.reason


async def _watch(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name="reach-cli") as client:
        nc = client.nc
        sub = await nc.subscribe(client.subjects.event("*"))
        await client.flush()
        print("# watching agent status events", file=sys.stderr, flush=True)
        colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        count = 0
        async for msg in sub.messages:
            try:
                ev = msgspec.json.decode(msg.data, type=AgentEvent)
            except msgspec.DecodeError:
                continue
            if args.json:
                print(json.dumps(msgspec.to_builtins(ev)), flush=True)
            else:
                old = ev.old.value if ev.old else "-"
                new = "gone" if ev.removed else ev.new.value
                stamp = time.strftime("%H:%M:%S", time.localtime(ev.at_ms / 1000))
                why = f"{ev.reason}: {ev.detail}" if ev.detail else ev.reason  # the agent's own
                print(
                    f"{stamp}  {ev.agent_id:<28} {_status(old, colour)} -> "
                    f"{_status(new, colour)}  ({why})",
                    flush=True,
                )
            count += 1
            if args.count and count >= args.count:
                break
    return 0


async def _control(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name="reach-cli") as client:
        try:
            msg = await client.nc.request(
                client.subjects.ctl(args.agent_id),
                msgspec.json.encode(Control(command=args.command)),
                timeout=args.timeout,
            )
        except nats.errors.NoRespondersError:
            raise AgentUnavailable(f"agent {args.agent_id!r} is not running") from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(f"agent {args.agent_id!r} did not answer") from None
    reply = msgspec.json.decode(msg.data, type=ControlReply)
    print(json.dumps({"agent_id": reply.agent_id, "status": reply.status.value}))
    return 0


async def _registry(args: argparse.Namespace, settings: ReachSettings) -> int:
    if not logging.getLogger().handlers:
        configure_logging(settings.log_format, settings.log_level)
    registry = Registry(settings=settings, metrics_port=args.metrics_port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with registry:
        print(
            f"# registry {registry.registry_id} on {redact(registry.url)},"
            f" bucket {registry.bucket_name}"
            + (f", metrics {registry.metrics_url}/metrics" if registry.metrics_url else ""),
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
    return 0


async def _demo(args: argparse.Namespace, settings: ReachSettings) -> int:
    """Run the demo shipped in the package (``reach.examples.demo``, as ``make demo`` does)."""
    from .examples import demo  # imported here: the demo's agents load only for the demo

    code: int = await demo.main()
    return code


class _Parser(argparse.ArgumentParser):
    """Bad usage is one line that names the problem and where help is (exit status 2, as
    argparse's), not the usage block before it; subcommands' parsers are of this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="reach", description="Agent-Reach over NATS")
    parser.add_argument(
        "--config",
        dest="settings_file",
        metavar="FILE",
        help="settings file (.toml or .yaml; keys like nats_url), as REACH_CONFIG: below "
        "the REACH_* variables and the command's options",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_url(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--url", help="NATS URL (default: $REACH_NATS_URL or the local server)")
        return p

    p = with_url(
        sub.add_parser(
            "call", help="call a capability (--all: every instance) and print the answer"
        )
    )
    p.add_argument("capability")
    p.add_argument("payload", nargs="?", default="null", help=PAYLOAD_HELP)
    who = p.add_mutually_exclusive_group()
    who.add_argument("--agent", help="direct call to this agent id (never substituted)")
    who.add_argument(
        "--all",
        action="store_true",
        help="ask every live instance at once; one line each: its answer or its error",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="a streaming capability: print each chunk as one line of JSON as it arrives",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds (--stream: for each chunk)")
    p.add_argument(
        "--priority", default="normal", type=str.lower, choices=[x.value for x in Priority]
    )
    p.add_argument("-v", "--verbose", action="store_true", help="say who answered")
    p.set_defaults(run=_call, is_async=True)

    add_topic_commands(sub, with_url)  # publish, listen, topics

    p = sub.add_parser("up", help="run local nats-server(s) and a registry until Ctrl-C")
    p.add_argument("--config", default=None, help="default ./nats-server.conf, else the shipped")
    p.add_argument("--data-dir", default=os.environ.get("REACH_DATA_DIR", ".reach-data"))
    p.add_argument("--port", type=_server_port, default=4222, help="0 or -1 picks a free port")
    p.add_argument("--monitor-port", type=_server_port, default=None)
    p.add_argument("--no-registry", action="store_true", help="do not start a registry")
    p.add_argument("--cluster", type=int, default=0, metavar="N", help="N nodes, one cluster")
    p.set_defaults(run=up, is_async=False)

    p = with_url(sub.add_parser("agents", help="the routing table: every known agent"))
    p.add_argument("--capability", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_agents, is_async=True)

    p = with_url(sub.add_parser("watch", help="agent status transitions as they happen"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--count", type=int, default=0, help="exit after this many events")
    p.set_defaults(run=_watch, is_async=True)

    for command in ("pause", "resume", "drain"):
        p = with_url(sub.add_parser(command, help=f"{command} one agent (by agent id)"))
        p.add_argument("agent_id")
        p.add_argument("--timeout", type=float, default=5.0)
        p.set_defaults(run=_control, is_async=True, command=command)

    p = with_url(sub.add_parser("registry", help="run a registry replica until Ctrl-C"))
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics and /healthz on this port (0: any; default REACH_METRICS_PORT)",
    )
    p.set_defaults(run=_registry, is_async=True)

    p = sub.add_parser("demo", help="the customer-service desk (reach.examples.demo)")
    p.set_defaults(run=_demo, is_async=True)

    add_task_commands(sub, with_url)  # submit, tasks, dlq
    add_schedule_commands(sub, with_url)  # schedules
    add_status_commands(sub, with_url)  # status, top
    add_gateway_commands(sub, with_url)  # gateway
    add_contract_commands(sub, with_url)  # asyncapi, mcp
    add_wrap_commands(sub)  # wrap: an HTTP service as an agent
    add_run_command(sub)  # run: an agent from an import path
    add_examples_commands(sub)  # examples, examples copy DIR
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            settings = _settings(args)  # once, before anything starts: bad values stop us here
            check = getattr(args, "check_settings", None)
            if check is not None:
                check(args)  # a command's settings of its own (REACH_GATEWAY_*), as early
        except ValueError as exc:  # a bad setting or settings file (ConfigurationError)
            print(f"error: bad_request: {exc}", file=sys.stderr)
            return 2  # as for a bad option
        # The program's edge: spans go where REACH_TRACE_EXPORTER says, for every Reach
        # object this command makes (they read OpenTelemetry's provider when made).
        provider = configure_tracing(settings, f"reach-{args.command}")
        if provider is not None:
            trace.set_tracer_provider(provider)
        try:
            if args.is_async:
                code: int = run_async(args.run(args, settings))
            else:
                code = args.run(args, settings)
        finally:
            if provider is not None:
                provider.shutdown()
    except ReachError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: bad_request: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`reach agents --json | head`): nothing more to say to it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit's own flush cannot fail again
        return 141  # 128 + SIGPIPE, as a shell tool would
    return code


if __name__ == "__main__":
    raise SystemExit(main())
