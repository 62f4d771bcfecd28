"""1. SIGKILL one of 3 agent instances under steady request load.

Goal: 0 failed requests (failover covers the dead one), and the dead instance goes
UNKNOWN or DOWN, then leaves, within the lease TTL plus the probe.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import reach
from reach.testing import NatsServer, eventually

from ..harness import AgentProc, Ledger, Result, known, settings_for, steady_load


async def run(work: Path, short: bool) -> Result:
    result = Result("kill_instance")
    ledger = Ledger()
    async with NatsServer() as server:
        settings = settings_for(server.url, "chaos")
        agents = [AgentProc(settings, f"echo-{i}", work / "runs") for i in range(3)]
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            for a in agents:
                await a.start()
            try:
                await eventually(lambda: known(client, "chaos.echo", 3), timeout=30)
                stop = asyncio.Event()
                load = asyncio.ensure_future(steady_load(client, "chaos.echo", ledger, stop))
                await asyncio.sleep(1 if short else 5)  # steady state before the fault
                killed_at = time.monotonic()
                await agents[0].kill()

                async def gone() -> bool:
                    records = {r.info.agent_id: r.status for r in await client.agents()}
                    return records.get("echo-0") in (None, reach.Status.DOWN)

                await eventually(gone, timeout=30)
                noticed = time.monotonic() - killed_at
                limit = (
                    settings.lease_ttl + settings.probe_timeout + 2 * settings.heartbeat_interval
                )
                result.check(
                    "the dead instance is DOWN or gone within lease TTL + probe",
                    noticed <= limit,
                    f"{noticed:.1f} s (limit {limit:.1f} s)",
                )
                await asyncio.sleep(1 if short else 5)  # load goes on after the fault
                stop.set()
                await load
            finally:
                for a in agents:
                    await a.stop()
    ledger.into(result)
    result.check("no failed request", result.failed == 0)
    return result
