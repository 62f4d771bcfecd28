"""8. Slow handlers that miss their deadlines: one of two instances of ``chaos.slow`` takes
longer than the request timeout, under steady load; then it is fast again.

Each instance sleeps its own ``slow_ms`` (20 ms, and 4 s on the slow one) unless a request
names ``ms``. The load sends ``ms: 20`` while all is well (a service time, so the load
spreads over both), leaves it out during the fault (the slow instance overruns every
deadline), and sends it again for the recovery (the slow instance's dependency is back):
the same process must clear its own DEGRADED.

Goals: no retry storm (the client's attempts beyond its requests stay within the retry
budget: ``retry_budget`` of the requests plus the budget's floor of 10 per 10 s window);
the client's breaker for the slow instance opens, then closes after the recovery; the slow
instance reports DEGRADED, then UP again.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from pathlib import Path

import reach
from reach.testing import NatsServer, eventually

from ..harness import AgentProc, Ledger, Result, known, settings_for
from ..tools_a import StatusLog, calls, client_metric

S = reach.Status
CAP = "chaos.slow"
BUDGET_FLOOR, BUDGET_WINDOW = 10, 10.0  # reach's RetryBudget defaults


async def run(work: Path, short: bool) -> Result:
    result = Result("slow_handlers")
    ledger = Ledger()
    steady, fault = (1.0, 3.0) if short else (5.0, 15.0)
    timeout, slow_ms, service_ms = 1.5, 4000, 20
    async with NatsServer() as server:
        settings = settings_for(server.url, "chaos")
        fast = AgentProc(settings, "fast-0", work / "runs", str(service_ms))
        slow = AgentProc(settings, "slow-1", work / "runs", str(slow_ms))
        async with reach.Registry(settings=settings), reach.Client(settings=settings) as client:
            for a in (fast, slow):
                await a.start()
            try:
                await eventually(lambda: known(client, CAP, 2), timeout=30)

                def tally(name: str, **labels: str) -> float:
                    return client_metric(client, name, capability=CAP, **labels)

                def breaker(name: str) -> float:
                    return client_metric(client, name, agent_id=slow.agent_id)

                async with StatusLog(client) as status:
                    stop, by = asyncio.Event(), Counter[str]()
                    payload = {"ms": service_ms}
                    load = asyncio.ensure_future(
                        calls(client, CAP, ledger, stop, payload, by, timeout=timeout)
                    )
                    await asyncio.sleep(steady)  # steady state: both answer in 20 ms
                    requests0 = tally("reach_client_requests_total")
                    attempts0 = tally("reach_client_attempts_total")
                    began = time.monotonic()
                    del payload["ms"]  # the fault: slow-1 overruns every deadline
                    await eventually(lambda: status.ever(slow.agent_id, S.DEGRADED), timeout=60)
                    degraded_after = time.monotonic() - began
                    await eventually(
                        lambda: breaker("reach_client_breaker_openings_total") >= 1, timeout=60
                    )
                    opened_after = time.monotonic() - began
                    await asyncio.sleep(fault)  # the fault goes on under load
                    openings = breaker("reach_client_breaker_openings_total")
                    mark = status.mark(slow.agent_id)
                    answered_by_slow = by[slow.agent_id]
                    payload["ms"] = service_ms  # recovery: slow-1 is fast again
                    recovered_at = time.monotonic()

                    def recovered() -> bool:
                        return (
                            S.UP in status.statuses(slow.agent_id, mark)
                            and status.now(slow.agent_id) is S.UP
                            and breaker("reach_client_breaker_open") == 0
                            and by[slow.agent_id] > answered_by_slow
                        )

                    await eventually(recovered, timeout=90)
                    back = recovered()
                    recovery = time.monotonic() - recovered_at
                    await asyncio.sleep(steady)  # load goes on after the recovery
                    stop.set()
                    await load
                    elapsed = time.monotonic() - began
                    requests = tally("reach_client_requests_total") - requests0
                    attempts = tally("reach_client_attempts_total") - attempts0
                    exhausted = tally("reach_client_retry_budget_exhausted_total")
            finally:
                for a in (fast, slow):
                    await a.stop()
    ledger.into(result)
    retries = attempts - requests
    windows = math.ceil(elapsed / BUDGET_WINDOW) + 1
    allowed = settings.retry_budget * requests + BUDGET_FLOOR * windows
    result.check(
        "no retry storm: retries within the retry budget",
        retries <= allowed,
        f"{attempts:.0f} attempts for {requests:.0f} requests: {retries:.0f} retries,"
        f" budget {allowed:.0f} ({settings.retry_budget:.0%} + {BUDGET_FLOOR} x {windows}"
        f" windows); {exhausted:.0f} retries refused by the budget",
    )
    result.check(
        "the slow instance's breaker opens",
        openings >= 1,
        f"first after {opened_after:.1f} s; {openings:.0f} openings during the fault",
    )
    result.check(
        "DEGRADED is reported",
        status.ever(slow.agent_id, S.DEGRADED),
        f"after {degraded_after:.1f} s; seen {status.story(slow.agent_id, began)}",
    )
    result.check(
        "after recovery: DEGRADED cleared, breaker closed, the instance serves again",
        back,
        f"{recovery:.1f} s after it was fast again; answered by {dict(sorted(by.items()))}",
    )
    return result
