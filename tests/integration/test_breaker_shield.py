"""An open breaker shields a live instance whose handler fails, for unversioned calls too.
(A fallback to the queue group when every breaker was open sent every call to the broken
handler: the queue group was that same instance.)"""

import pytest

import reach
from reach import Client, Registry, Status
from tests.integration.registry_wire import fast_settings
from tests.integration.test_registry import wait_status
from tests.integration.test_resilience import worker


async def test_an_open_breaker_still_shields_a_failing_single_instance(nats_server):
    settings = fast_settings(nats_server.url, breaker_cooldown=60.0)
    calls: list[str] = []
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with worker(settings, "w-broken", calls, fail=True):
            await wait_status(client, "w-broken", Status.UP)
            for _ in range(20):
                with pytest.raises((reach.HandlerFailed, reach.CircuitOpen)):
                    await client.request("work.do", {})
    # 5 failures in a row open the instance's breaker, one early probe (it might have been
    # a dead instance) fails too; within the 60 s cooldown the rest fail fast on the client
    assert len(calls) == 6
