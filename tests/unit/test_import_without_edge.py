"""``import reach`` (and the CLI module) leaves the ``edge`` and ``mcp`` extras unloaded:
FastAPI, Starlette, uvicorn, httpx, the A2A SDK and the MCP SDK load only with the commands
or packages that use them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EDGE = ("fastapi", "starlette", "uvicorn", "httpx", "a2a", "sse_starlette", "mcp", "mcp_types")
PROBE = f"""
import json, sys
import reach, reach.cli
edge = {EDGE!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in edge)))
"""


def run_probe(probe: str) -> subprocess.CompletedProcess[str]:
    """``probe`` in a fresh interpreter on this checkout, without REACH_* settings."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REACH_")},
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_import_reach_loads_none_of_the_edge_extra():
    proc = run_probe(PROBE)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_the_demo_and_the_test_helpers_need_no_pytest():
    """A pip install has no pytest: ``reach demo`` and ``reach.testing`` must not need it
    (only the fixtures' plugin, which pytest itself loads, does)."""
    proc = run_probe(
        "import sys; sys.modules['pytest'] = None\n"  # as if pytest were not installed
        "import reach.testing, reach.examples.demo\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_reach_mcp_without_the_mcp_extra_says_how_to_install_it():
    proc = run_probe(
        "import sys; sys.modules['mcp'] = None\n"  # as if the mcp extra were not installed
        "from reach.cli import main\n"
        "sys.exit(main(['mcp']))\n"
    )
    assert proc.returncode == 1
    assert "pip install 'agent-reach-nats[mcp]'" in proc.stderr
