"""Outside tools some tests run (promtool, prometheus, docker-compose, chromium, node with
npm packages).

``need(tool, install)`` is the path of the first of ``tool``'s names on PATH. Without it the
test is skipped, with a reason that names the tool and the command that installs it, so
``make test`` passes on a machine that lacks them. CI installs them (``.ci/run``) and sets
``REACH_REQUIRE_TOOLS=1``, which turns that skip into a failure: there, a missing tool must
not pass for a checked file. ``need_npm(package, where, install)`` is the same for a Node
package installed under ``where`` (its ``node_modules``), and returns the path of ``node``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import pytest

__all__ = ["REQUIRE", "need", "need_npm"]

#: the variable that makes a missing tool fail the test instead of skipping it
REQUIRE = "REACH_REQUIRE_TOOLS"


def need(tool: str | Sequence[str], install: str) -> str:
    """The path of ``tool`` (or of the first of several names found); skip (or, with
    ``REACH_REQUIRE_TOOLS=1``, fail) naming it and ``install``, the command that installs
    it."""
    names = [tool] if isinstance(tool, str) else list(tool)
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    _missing(f"{' or '.join(names)} not found: {install}")


def need_npm(package: str, where: Path, install: str) -> str:
    """The path of ``node``, once ``package`` is installed in ``where/node_modules``; skip
    (or, with ``REACH_REQUIRE_TOOLS=1``, fail) naming what is missing and ``install``."""
    node = need("node", f"apt-get install nodejs npm && {install}")
    if not (where / "node_modules" / package / "package.json").is_file():
        _missing(f"npm package {package} not found in {where / 'node_modules'}: {install}")
    return node


def _missing(why: str) -> NoReturn:
    if os.environ.get(REQUIRE, "") not in ("", "0"):
        pytest.fail(f"{why} ({REQUIRE} is set: CI runs every test)", pytrace=False)
    pytest.skip(why)
