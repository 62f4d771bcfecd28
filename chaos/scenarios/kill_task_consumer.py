"""2. SIGKILL the only instance consuming durable tasks while a batch is in flight, and
restart it 5 s later.

Goal: every task SUCCEEDED, and duplicates (executions beyond one per task, counted from
the run files) no more than the tasks in flight at the kill (those that had started and
were not SUCCEEDED: the dead instance could not record them).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import reach
from reach.testing import NatsServer, eventually

from ..harness import AgentProc, Ledger, Result, known, settings_for
from ..tools_a import duplicates, executions, settle_tasks


async def run(work: Path, short: bool) -> Result:
    result = Result("kill_task_consumer")
    ledger = Ledger()
    runs = work / "runs"
    n_tasks, job_ms, down_for = (60, 300, 2.0) if short else (200, 300, 5.0)
    async with NatsServer() as server:
        settings = settings_for(server.url, "chaos")
        worker = AgentProc(settings, "worker-0", runs)
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            await worker.start()
            try:
                await eventually(lambda: known(client, "chaos.echo", 1), timeout=30)
                batch = await client.submit_batch(
                    "chaos.job", [{"n": i, "ms": job_ms} for i in range(n_tasks)]
                )
                ledger.sent += len(batch)
                for item in batch.items:
                    if not isinstance(item, reach.TaskRef):
                        ledger.refused(f"submit {getattr(item, 'code', 'error')}")
                # the fault hits with a third of the batch started
                await eventually(lambda: len(executions(runs)) >= n_tasks // 3, timeout=60)
                await worker.kill()
                started = set(executions(runs))
                states = await asyncio.gather(
                    *(client.task_record(t) for t in sorted(started)), return_exceptions=True
                )
                in_flight = sum(
                    1
                    for s in states
                    if not isinstance(s, reach.TaskRecord)
                    or s.state is not reach.TaskState.SUCCEEDED
                )
                await asyncio.sleep(down_for)  # the fault: the consumer stays dead this long
                await worker.start()
                final = await settle_tasks(client, batch.refs, ledger, timeout=120)
            finally:
                await worker.stop()
    ledger.into(result)
    result.duplicated = duplicates(runs)
    succeeded = sum(r.state is reach.TaskState.SUCCEEDED for r in final.values())
    result.check(
        "every task SUCCEEDED",
        succeeded == n_tasks,
        f"{succeeded} of {n_tasks}; {len(started)} had started at the kill",
    )
    result.check(
        "duplicates no more than were in flight at the kill",
        result.duplicated <= in_flight,
        f"{result.duplicated} duplicated, {in_flight} in flight",
    )
    return result
