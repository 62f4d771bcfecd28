"""The chaos suite's own bounds: the suite has a deadline (scenarios that find no time left
FAIL unrun), and a scenario that blocks the event loop (where its asyncio deadline cannot
fire) is ended by a watchdog thread that prints where every thread was."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from chaos.run import main_async

ROOT = Path(__file__).parents[2]


async def test_scenarios_past_the_suite_deadline_fail_unrun():
    results = await main_async(["kill_instance"], short=True, deadline=300, suite_deadline=0)
    assert [r.passed for r in results] == [False]
    assert any("not run" in note for note in results[0].notes), results[0].notes


def test_a_scenario_that_blocks_the_loop_is_ended_with_the_stacks():
    script = textwrap.dedent(
        """
        import asyncio, sys, time, types
        import chaos.run as run

        module = types.ModuleType("chaos.scenarios.blocks")

        async def blocks_the_loop(work, short):
            time.sleep(120)  # no await: the loop never runs again

        module.run = blocks_the_loop
        sys.modules["chaos.scenarios.blocks"] = module
        run.STOP_GRACE = run.BLOCKED_GRACE = 0.5
        asyncio.run(run.run_one("blocks", True, __import__("pathlib").Path("."), 0.5))
        print("returned")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,  # (a watchdog that never fired: 120 s)
    )
    assert proc.returncode != 0
    assert "returned" not in proc.stdout
    assert "blocks_the_loop" in proc.stderr, proc.stderr[-2000:]
