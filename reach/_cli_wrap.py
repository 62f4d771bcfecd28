"""``reach wrap``: run a Reach agent in front of an unchanged HTTP service, from arguments
(one endpoint) or a TOML file (several). The wrapper itself (httpx) is imported only when
the command runs, so ``reach`` works without the ``edge`` extra."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ._telemetry import configure_logging
from .errors import ConfigurationError
from .settings import ReachSettings

__all__ = ["add_wrap_commands"]

# Flags that describe what to serve, refused alongside --config (the file says all of it).
_SPEC_FLAGS = {
    "capability": "--capability",
    "endpoint_url": "--url",
    "method": "--method",
    "timeout": "--timeout",
    "description": "--description",
    "max_concurrency": "--max-concurrency",
    "tags": "--tags",
    "name": "--name",
    "agent_id": "--agent-id",
    "health_url": "--health-url",
    "health_interval": "--health-interval",
    "pause_after": "--pause-after",
}


def _tags(values: list[str] | None) -> list[str]:
    return [t for v in values or () for t in v.split(",") if t]


def spec_data(args: argparse.Namespace) -> dict[str, Any]:
    """The wrap spec the arguments describe, as plain data (validated by ``build_spec``)."""
    if not args.capability or not args.endpoint_url:
        raise ConfigurationError("reach wrap needs --capability and --url, or --config FILE")
    endpoint: dict[str, Any] = {
        "capability": args.capability,
        "url": args.endpoint_url,
        "method": args.method or "POST",
        "timeout": 5.0 if args.timeout is None else args.timeout,
    }
    if args.description:
        endpoint["description"] = args.description
    data: dict[str, Any] = {"endpoints": [endpoint], "tags": _tags(args.tags)}
    if args.max_concurrency is not None:
        data["max_concurrency"] = args.max_concurrency
    if args.name:
        data["name"] = args.name
    if args.agent_id:
        data["agent_id"] = args.agent_id
    if args.health_url:
        health: dict[str, Any] = {"url": args.health_url}
        if args.health_interval is not None:
            health["interval"] = args.health_interval
        if args.pause_after is not None:
            health["pause_after"] = args.pause_after
        data["health"] = health
    elif args.health_interval is not None or args.pause_after is not None:
        raise ConfigurationError("--health-interval and --pause-after need --health-url")
    return data


async def _wrap(args: argparse.Namespace, settings: ReachSettings) -> int:
    try:
        from ._wrap import HttpWrapper, build_spec, load_config
    except ImportError as exc:
        raise ConfigurationError(
            f"reach wrap needs the edge extra (pip install 'agent-reach-nats[edge]'): {exc}"
        ) from None

    if args.config:
        given = [flag for dest, flag in _SPEC_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise ConfigurationError(f"--config declares everything; drop {', '.join(given)}")
        spec = load_config(args.config)
    else:
        spec = build_spec(spec_data(args))
    if args.nats_url:
        settings = settings.model_copy(update={"nats_url": args.nats_url})  # keeps --config
    if not logging.getLogger().handlers:
        configure_logging(settings.log_format, settings.log_level)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    wrapper = HttpWrapper(spec, settings=settings)
    print(
        f"# wrapping as agent {wrapper.agent.agent_id}: {spec.describe()}",
        file=sys.stderr,
        flush=True,
    )
    await wrapper.serve_forever()
    return 0


def add_wrap_commands(sub: Any) -> None:
    """Add ``reach wrap``. Its ``--url`` is the HTTP endpoint (as in the issue's command
    line), so the NATS URL is ``--nats-url`` here (default: ``$REACH_NATS_URL``)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "wrap",
        help="serve a capability by calling an existing HTTP endpoint (until Ctrl-C or drain)",
    )
    p.add_argument("--capability", help="the capability to serve, e.g. support.ask")
    p.add_argument("--url", dest="endpoint_url", metavar="URL", help="the HTTP endpoint to call")
    p.add_argument("--method", type=str.upper, help="HTTP method (default POST)")
    p.add_argument("--timeout", type=float, help="seconds to wait for the endpoint (default 5)")
    p.add_argument("--description", help="the capability's description in the registry")
    p.add_argument("--max-concurrency", type=int, help="requests forwarded at once (default 8)")
    p.add_argument("--tags", action="append", help="agent tags, comma-separated or repeated")
    p.add_argument("--name", help="agent name (default wrap-<capability>)")
    p.add_argument("--agent-id", help="agent id (default <name>-<unique>)")
    p.add_argument("--health-url", help="GET this URL to check the service's health")
    p.add_argument("--health-interval", type=float, help="seconds between checks (default 5)")
    p.add_argument(
        "--pause-after",
        type=int,
        help="failed checks in a row before the agent pauses (default 3; 0: never);"
        " one failure makes it DEGRADED",
    )
    p.add_argument("--config", help="a TOML file declaring the agent and its endpoints")
    p.add_argument("--nats-url", help="NATS URL (default: $REACH_NATS_URL or the local server)")
    p.set_defaults(run=_wrap, is_async=True)
