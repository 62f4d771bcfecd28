"""A payload refused for its size is a ``PayloadTooLarge`` (code ``payload_too_large``), by
class, wherever it is refused: a request, a direct request, a publish, a task submit. It is
still a ``ConfigurationError`` (nothing was sent), and it says how big it was and the most
that fits, so a caller (or the gateway's 413) never reads the message to tell."""

from __future__ import annotations

import pytest

import reach
from reach import Agent, Client, ConfigurationError, PayloadTooLarge, ReachSettings

RECORD_OVERHEAD = 4096  # bytes of a task record besides its payload (submit.py)


def test_payload_too_large_is_a_configuration_error_with_its_own_code():
    exc = PayloadTooLarge("too big", size=10, limit=5)
    assert isinstance(exc, ConfigurationError)
    assert isinstance(exc, reach.ReachError)
    assert (exc.code, exc.size, exc.limit, exc.retryable) == ("payload_too_large", 10, 5, False)
    assert ConfigurationError("x").code == "bad_request"  # its parent keeps its own


async def test_requests_and_publishes_over_max_payload_raise_payload_too_large(
    reach_settings: ReachSettings, reach_client: Client
):
    agent = Agent("big", settings=reach_settings)

    @agent.capability("big.op")
    async def op(payload: bytes) -> dict[str, int]:
        return {}

    max_payload = reach_client.nc.max_payload
    big = b"x" * (max_payload + 1)
    edge = b"x" * (max_payload - 10)  # over only with its headers
    async with agent:
        for send in (
            lambda: reach_client.call("big.op", big),
            lambda: reach_client.request("big.op", big, agent_id=agent.agent_id),
            lambda: reach_client.publish("big.topic", big),
            lambda: reach_client.call("big.op", edge),
        ):
            with pytest.raises(PayloadTooLarge) as info:
                await send()
            assert info.value.code == "payload_too_large"
            assert info.value.limit == max_payload
            assert info.value.size in (len(big), len(edge))
        assert await reach_client.request("big.op", b"small") == {}


async def test_a_task_payload_too_large_for_its_record_raises_payload_too_large(
    reach_client: Client,
):
    max_payload = reach_client.nc.max_payload
    limit = (max_payload // 2 - RECORD_OVERHEAD) // 4 * 3
    with pytest.raises(PayloadTooLarge) as info:
        await reach_client.submit("size.op", b"x" * (limit + 3))
    assert (info.value.size, info.value.limit) == (limit + 3, limit)
    assert info.value.code == "payload_too_large"
    batch = await reach_client.submit_batch("size.op", [b"x" * (limit + 3)])
    assert isinstance(batch.items[0], PayloadTooLarge)
    # a periodic schedule's tasks are tasks: refused when it is defined, not at each firing
    with pytest.raises(PayloadTooLarge) as info:
        await reach_client.schedule("big", "size.op", b"x" * (limit + 3), every=60)
    assert (info.value.size, info.value.limit) == (limit + 3, limit)
    assert await reach_client.schedules() == []
