"""What a delayed task costs to submit: ``client.submit(..., delay=...)`` against an
immediate ``client.submit(...)``, as a ratio.

One nats-server from the shipped `nats-server.conf` (file storage, `sync_interval: always`)
on a random loopback port, no agent: a submit counts when the server has acknowledged the
task (the work-queue message, or the `@at` schedule the delayed one waits as). Submits per
second in a closed loop with 1 and N (default 64) in flight; the delayed tasks are due an
hour later, so none fires during the run.

Variants (`--variants`, default all):
- `immediate`: `client.submit(cap, body)`, the task PENDING on its work queue;
- `delayed`: `client.submit(cap, body, delay=3600)`, SCHEDULED (one publish as well: the
  message is a schedule the server holds, with two more headers).

Rounds interleave the variants (rotating their order); ratios are computed within each
round and the median over rounds is reported. 256-byte JSON bodies.

    python bench/schedules.py [--quick] [--rounds 5] [--seconds 2] [--inflight 64]
                              [--variants immediate,delayed] [--json]
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _fleet import (
    closed_loop,
    defaults,
    interleaved,
    median_ratio,
    parse_rounds,
    rate_table,
    round_parser,
    round_setup,
    shown,
    summary,
)
from request_reply import SIZE

import reach
from reach.testing import NatsServer, config_with_store

VARIANTS = ("immediate", "delayed")
CONFIG = Path(__file__).resolve().parents[1] / "nats-server.conf"
CAP = "bench.later"
BODY = {"data": "x" * (SIZE - 12)}


async def measure(args: Any, url: str) -> dict[str, Any]:
    async with reach.Client(settings=defaults(url, "bench")) as client:
        await client.submit(CAP, BODY, delay=3600)  # streams made, schedules allowed

        async def immediate() -> None:
            await client.submit(CAP, BODY)

        async def delayed() -> None:
            await client.submit(CAP, BODY, delay=3600)

        calls = {"immediate": immediate, "delayed": delayed}
        calls = {k: v for k, v in calls.items() if k in args.variants}
        levels = sorted({1, args.inflight})
        for fn in calls.values():
            for n in levels:
                await closed_loop(fn, args.warmup, n)
        per_round, lat = await interleaved(calls, levels, args.rounds, args.seconds)
    out: dict[str, Any] = {"levels": levels, "rounds": per_round}
    out["variants"] = summary(per_round, lat)
    out["ratios"] = (
        {
            "delayed / immediate": {
                str(n): median_ratio(per_round, "delayed", "immediate", str(n)) for n in levels
            }
        }
        if len(calls) == 2
        else {}
    )
    return out


def main() -> int:
    args = parse_rounds(round_parser(__doc__, VARIANTS), VARIANTS)
    with tempfile.TemporaryDirectory(prefix="reach-bench-schedules-") as data:
        config = config_with_store(CONFIG, Path(data))
        with NatsServer(config_file=config, extra_args=("-m", "-1")) as server:
            url = server.url
            out = asyncio.run(measure(args, url))
    out["setup"] = round_setup(args, payload_bytes=SIZE, agent_settings=shown(defaults(url)))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"submit of a delayed task (an @at schedule the server holds) vs an immediate one,"
        f" {SIZE}-byte bodies; nats-server from {CONFIG.name} (file storage,"
        f" sync_interval: always); {args.rounds} interleaved rounds x {args.seconds:g} s"
    )
    print()
    print(rate_table(out, "submits"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
