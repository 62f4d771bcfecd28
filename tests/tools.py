"""Outside tools some tests run (promtool, prometheus, docker-compose, chromium).

``need(tool, install)`` is the path of the first of ``tool``'s names on PATH. Without it the
test is skipped, with a reason that names the tool and the command that installs it, so
``make test`` passes on a machine that lacks them. CI installs them (``.ci/run``) and sets
``REACH_REQUIRE_TOOLS=1``, which turns that skip into a failure: there, a missing tool must
not pass for a checked file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

import pytest

__all__ = ["REQUIRE", "need"]

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
    why = f"{' or '.join(names)} not found: {install}"
    if os.environ.get(REQUIRE, "") not in ("", "0"):
        pytest.fail(f"{why} ({REQUIRE} is set: CI runs every test)", pytrace=False)
    pytest.skip(why)
