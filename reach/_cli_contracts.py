"""``reach asyncapi`` (the live fleet as an AsyncAPI 3.0 document) and ``reach mcp`` (the
live fleet as an MCP server, the ``mcp`` extra): the contracts of ``reach._contracts``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._client import Client
from ._contracts.asyncapi import fleet_document
from .errors import ConfigurationError
from .settings import ReachSettings

__all__ = ["add_contract_commands"]


async def _asyncapi(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name="reach-cli") as client:
        records = await client.agents()
        doc = fleet_document(
            records,
            subjects=client.subjects,
            url=client.url,
            names=args.capability,
            tags=args.tag,
        )
    _write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", args.output)
    if args.output not in (None, "-"):
        print(f"# wrote {args.output}: {len(doc['operations'])} operations", file=sys.stderr)
    return 0


def _write(text: str, output: str | None) -> None:
    if output in (None, "-"):
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text)
    except OSError as exc:
        raise ConfigurationError(f"cannot write {output!r}: {exc.strerror or exc}") from None


def _selection(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--capability",
        action="append",
        default=[],
        metavar="GLOB",
        help=f"only names matching GLOB ({what}); repeat for more",
    )
    p.add_argument(
        "--tag",
        action="append",
        default=[],
        help="only instances with this tag; repeat: with every one of them",
    )


def add_contract_commands(
    sub: Any, with_url: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Add ``asyncapi`` and ``mcp`` to the ``reach`` parser's subcommands."""
    p = with_url(
        sub.add_parser("asyncapi", help="write an AsyncAPI 3.0 document of the live fleet (JSON)")
    )
    _selection(p, "capabilities, task capabilities and topic patterns")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="default: stdout")
    p.set_defaults(run=_asyncapi, is_async=True)
