"""Run the chaos scenarios, print one line each, write a Markdown report.

    python -m chaos.run [--short] [--only NAME ...] [--repeat N] [--report PATH]

``--short`` (``make chaos-short``) runs each scenario with less load and shorter phases.
Each scenario has a hard deadline (``--deadline``; 300 s short, 900 s full): past it, it
FAILs with a line naming where every task of the run was waiting, and is cancelled. A
scenario that does not stop within 30 s of that ends the run (exit status 2), so a hang
never eats CI's time. The suite has one too (``--suite-deadline``; 1,800 s short, 5,400 s
full): a scenario gets at most the time left, and those that find none FAIL unrun. Both
need a running event loop; one blocked in a call that never returns cannot see them, so a
watchdog thread (``faulthandler``) prints every thread's stack and ends the process 30 s
after a scenario's deadline and grace. Exit status 1 if any scenario failed.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import importlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType

from .harness import Result

#: scenario module names under chaos/scenarios, in the issue's order
SCENARIOS = [
    "kill_instance",  # 1
    "kill_task_consumer",  # 2
    "sigstop_agent",  # 3
    "server_restart",  # 4
    "cluster_failover",  # 5
    "registry_restart",  # 6
    "rolling_restart",  # 7
    "slow_handlers",  # 8
    "partition",  # 9
    "durable_topics",  # 10
    "schedules_failover",  # 11
]


#: seconds a cancelled scenario has to stop (its own cleanup: agents, servers)
STOP_GRACE = 30.0
#: seconds past a scenario's deadline and grace after which the watchdog thread ends the
#: process (only a blocked event loop gets there: the loop ends it at the grace)
BLOCKED_GRACE = 30.0


def waiting_in(skip: asyncio.Task[object] | None) -> str:
    """Where each unfinished task of the run waits: its innermost frame in our code."""
    places = []
    for task in asyncio.all_tasks():
        if task is skip or task.done():
            continue
        frames = [
            f
            for f in task.get_stack()
            if "/chaos/" in f.f_code.co_filename or "/reach/" in f.f_code.co_filename
        ]
        if frames:
            f = frames[-1]
            where = Path(f.f_code.co_filename)
            places.append(f"{where.parent.name}/{where.name}:{f.f_lineno} {f.f_code.co_name}")
    return "; ".join(sorted(set(places))) or "no task of ours"


async def run_one(name: str, short: bool, work: Path, deadline: float) -> Result:
    module = importlib.import_module(f"chaos.scenarios.{name}")
    started = time.monotonic()
    # the last resort, for a loop blocked in a call that never returns: stacks, then exit
    faulthandler.dump_traceback_later(deadline + STOP_GRACE + BLOCKED_GRACE, exit=True)
    try:
        return await _run_one(module, name, short, work, deadline, started)
    finally:
        faulthandler.cancel_dump_traceback_later()


async def _run_one(
    module: ModuleType, name: str, short: bool, work: Path, deadline: float, started: float
) -> Result:
    task = asyncio.ensure_future(module.run(work / name, short))
    done, _ = await asyncio.wait({task}, timeout=deadline)
    if task in done:
        try:
            result: Result = task.result()
        except Exception:
            result = Result(name)
            result.check("ran to the end", False, traceback.format_exc(limit=5))
    else:
        where = waiting_in(asyncio.current_task())
        task.cancel()
        stopped, _ = await asyncio.wait({task}, timeout=STOP_GRACE)
        result = Result(name)
        result.check(
            f"ended within its deadline of {deadline:.0f} s", False, f"waiting in: {where}"
        )
        if not stopped:
            result.check(f"stopped within {STOP_GRACE:.0f} s of being cancelled", False)
            result.notes.append(f"took {time.monotonic() - started:.1f} s")
            print(result.line(), flush=True)
            for note in result.notes:
                print(f"    {note}", flush=True)
            print(f"chaos: {name} did not stop; ending the run", flush=True)
            os._exit(2)  # its tasks will not end: nothing else can run in this loop
    result.notes.append(f"took {time.monotonic() - started:.1f} s")
    return result


def report(results: list[Result], short: bool) -> str:
    lines = [
        "# Chaos suite report",
        "",
        f"Mode: {'short' if short else 'full'}"
        f" (`python -m chaos.run{' --short' if short else ''}`).",
        "",
        "| scenario | result | sent | ok | failed | lost | duplicated | p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.scenario} | {'PASS' if r.passed else 'FAIL'} | {r.sent} | {r.ok} |"
            f" {r.failed} | {r.lost} | {r.duplicated} | {r.p99_ms:.1f} |"
        )
    lines.append("")
    for r in results:
        lines.append(f"## {r.scenario}")
        lines += [f"- {n}" for n in r.notes] or ["- (nothing to note)"]
        lines.append("")
    return "\n".join(lines)


async def main_async(
    names: list[str], short: bool, deadline: float, suite_deadline: float
) -> list[Result]:
    results = []
    ends = time.monotonic() + suite_deadline
    with tempfile.TemporaryDirectory(prefix="reach-chaos-") as tmp:
        for i, name in enumerate(names):
            left = ends - time.monotonic()
            if left > 0:
                result = await run_one(name, short, Path(tmp) / str(i), min(deadline, left))
            else:
                result = Result(name)
                result.check(
                    f"ran within the suite's deadline of {suite_deadline:.0f} s",
                    False,
                    "not run: the scenarios before it used the suite's time",
                )
            print(result.line(), flush=True)
            for note in result.notes:
                print(f"    {note}", flush=True)
            results.append(result)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--repeat", type=int, default=1, help="run each scenario N times")
    parser.add_argument("--deadline", type=float, default=None, help="seconds per scenario")
    parser.add_argument(
        "--suite-deadline", type=float, default=None, help="seconds for every scenario in all"
    )
    parser.add_argument("--report", type=Path, default=Path(__file__).with_name("REPORT.md"))
    args = parser.parse_args()
    names = [n for n in (args.only or SCENARIOS) for _ in range(max(1, args.repeat))]
    deadline = args.deadline or (300.0 if args.short else 900.0)
    suite_deadline = args.suite_deadline or (1800.0 if args.short else 5400.0)
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    results = asyncio.run(main_async(names, args.short, deadline, suite_deadline))
    args.report.write_text(report(results, args.short))
    print(f"report: {args.report}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
