"""Run the chaos scenarios, print one line each, write a Markdown report.

    python -m chaos.run [--short] [--only NAME ...] [--report PATH]

``--short`` (``make chaos-short``) runs each scenario with less load and shorter phases.
Exit status 1 if any scenario failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
import tempfile
import time
import traceback
from pathlib import Path

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
]


async def run_one(name: str, short: bool, work: Path) -> Result:
    module = importlib.import_module(f"chaos.scenarios.{name}")
    started = time.monotonic()
    try:
        result: Result = await module.run(work / name, short)
    except Exception:
        result = Result(name)
        result.check("ran to the end", False, traceback.format_exc(limit=5))
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


async def main_async(names: list[str], short: bool) -> list[Result]:
    results = []
    with tempfile.TemporaryDirectory(prefix="reach-chaos-") as tmp:
        for name in names:
            result = await run_one(name, short, Path(tmp))
            print(result.line(), flush=True)
            for note in result.notes:
                print(f"    {note}", flush=True)
            results.append(result)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--report", type=Path, default=Path(__file__).with_name("REPORT.md"))
    args = parser.parse_args()
    names = args.only or SCENARIOS
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    results = asyncio.run(main_async(names, args.short))
    args.report.write_text(report(results, args.short))
    print(f"report: {args.report}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
