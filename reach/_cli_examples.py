"""``reach examples``: what ``reach.examples`` ships (the demo's agents, the shopper client,
the HTTP service and its wrap.toml), and ``reach examples copy DIR`` to take them out and
edit them. Each file's summary is its docstring's (or, for TOML, its comment's) first line."""

from __future__ import annotations

import argparse
import ast
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from .errors import ConfigurationError
from .settings import ReachSettings

__all__ = ["add_examples_commands", "example_files"]

_PACKAGE = "reach.examples"


def example_files() -> list[Traversable]:
    """The example files the package holds, by name (not ``__init__.py``, not caches)."""
    root = resources.files(_PACKAGE)
    return sorted(
        (
            f
            for f in root.iterdir()
            if f.is_file() and f.name.endswith((".py", ".toml")) and f.name != "__init__.py"
        ),
        key=lambda f: f.name,
    )


def _summary(file: Traversable) -> str:
    text = file.read_text(encoding="utf-8")
    if file.name.endswith(".py"):
        doc = ast.get_docstring(ast.parse(text)) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""
    for raw in text.splitlines():
        if raw.startswith("#"):
            return raw.lstrip("# ").strip()
    return ""


def _list(args: argparse.Namespace, settings: ReachSettings) -> int:
    files = example_files()
    width = max(len(f.name) for f in files)
    print(f"Examples shipped in {_PACKAGE} ({resources.files(_PACKAGE)}):")
    for f in files:
        print(f"  {f.name:<{width}}  {_summary(f)}")
    print("Run one:   python -m reach.examples.logistics [AGENT_ID]   (reach demo runs them all)")
    print("Edit them: reach examples copy DIR")
    return 0


def _copy(args: argparse.Namespace, settings: ReachSettings) -> int:
    target = Path(args.dir)
    if target.exists() and not target.is_dir():
        raise ConfigurationError(f"{target} is a file: give a directory to copy the examples into")
    files = example_files()
    taken = [f.name for f in files if (target / f.name).exists()]
    if taken:
        raise ConfigurationError(
            f"{target} already has {', '.join(taken)}: give a new or empty directory "
            "(nothing was copied)"
        )
    target.mkdir(parents=True, exist_ok=True)
    for f in files:
        (target / f.name).write_bytes(f.read_bytes())
    print(f"copied {len(files)} examples into {target}: {', '.join(f.name for f in files)}")
    return 0


def add_examples_commands(sub: Any) -> None:
    """Add ``examples`` (list) and ``examples copy DIR`` to the ``reach`` subcommands."""
    p = sub.add_parser("examples", help="list the example agents shipped in the package")
    p.set_defaults(run=_list, is_async=False)
    actions = p.add_subparsers(dest="action")
    c = actions.add_parser("copy", help="copy the examples into DIR to read and edit")
    c.add_argument("dir", metavar="DIR")
    c.set_defaults(run=_copy, is_async=False)
