"""A task agent run as a process of its own by the fault tests, to be SIGKILLed or SIGSTOPped.

    python task_agent.py DIR MODE      (settings from the REACH_* environment)

Every run of the handler first creates ``DIR/<task_id>.<attempt>.<pid>``: one file per
execution, so a test counts side effects, duplicates included. MODE "quick": each run takes
a moment; "hold": the first attempt of a task waits for a message on ``<prefix>.test.release`` (and
leaves ``DIR/cancelled.<task_id>.<pid>`` if it is cancelled instead). Once the
runner has refused a stale write (``task_stats.fenced``), ``DIR/fenced.<pid>`` appears.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import reach

CAPABILITY = "chaos.work"


async def main(root: Path, mode: str) -> None:
    agent = reach.Agent("chaos-worker", settings=reach.ReachSettings())
    pid = os.getpid()

    @agent.task(CAPABILITY)
    async def work(payload: dict[str, Any], ctx: reach.TaskContext) -> dict[str, Any]:
        released = asyncio.Event()

        async def on_release(_msg: Any) -> None:
            released.set()

        if mode == "hold" and ctx.attempt == 1:
            # listening before the run file appears, so the test's release is not missed
            nc = ctx.client.nc
            sub = await nc.subscribe(f"{ctx.client.subjects.prefix}.test.release", cb=on_release)
            await nc.flush()
        (root / f"{ctx.task_id}.{ctx.attempt}.{pid}").touch()
        if mode == "hold" and ctx.attempt == 1:
            try:
                await released.wait()
            except asyncio.CancelledError:
                (root / f"cancelled.{ctx.task_id}.{pid}").touch()
                raise
            finally:
                await sub.unsubscribe()
        else:
            await asyncio.sleep(0.01)
        return {"n": payload["n"], "pid": pid, "attempt": ctx.attempt}

    async def report_fence() -> None:
        while agent.task_stats.fenced == 0:  # noqa: ASYNC110 (a counter has no event)
            await asyncio.sleep(0.01)
        (root / f"fenced.{pid}").touch()

    fence = asyncio.create_task(report_fence())
    try:
        await agent.serve_forever()
    finally:
        fence.cancel()
        await asyncio.gather(fence, return_exceptions=True)  # owned: awaited at the end


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
