"""An agent process for the chaos suite (settings from REACH_*).

    python agent_proc.py AGENT_ID RUNS_DIR [slow_ms]

Serves ``chaos.echo`` (answers at once, naming itself), ``chaos.slow`` (sleeps ``slow_ms``,
default 0, then answers) and the durable task ``chaos.job``, whose every execution first
creates ``RUNS_DIR/<task_id>.<attempt>.<pid>``: a scenario counts executions, duplicates
included. With ``CHAOS_DURABLE_TOPIC=1`` in its environment it also subscribes durably to
``chaos.report.>``, and each report it handles creates ``RUNS_DIR/r<n>.<count>.<pid>``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import reach


def build(agent_id: str, runs: Path, slow_ms: int) -> reach.Agent:
    agent = reach.Agent("chaos", agent_id)
    pid = os.getpid()

    @agent.capability("chaos.echo")
    async def echo(req: dict[str, Any]) -> dict[str, Any]:
        return {"by": agent_id, **req}

    @agent.capability("chaos.slow")
    async def slow(req: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(req.get("ms", slow_ms) / 1000)
        return {"by": agent_id}

    @agent.task("chaos.job", timeout=10)
    async def job(req: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        (runs / f"{ctx.task_id}.{ctx.attempt}.{pid}").touch()
        await asyncio.sleep(req.get("ms", 20) / 1000)
        return {"by": agent_id, "n": req.get("n")}

    if os.environ.get("CHAOS_DURABLE_TOPIC") == "1":
        handled = iter(range(1 << 62))

        @agent.on_topic("chaos.report.>", durable=True)
        async def report(body: dict[str, Any]) -> None:
            (runs / f"r{body['n']}.{next(handled)}.{pid}").touch()

    return agent


if __name__ == "__main__":
    slow = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    asyncio.run(build(sys.argv[1], Path(sys.argv[2]), slow).serve_forever())
