"""A durable topic handler that ignores its cancellation at ``topic_timeout`` (review of
durable topics, reproduction ``repro_topic_stuck``): its message is settled anyway (nak, so
it comes back, counted as failed), the handler keeps its worker until it really returns,
counted and reported as stuck, and an ordered name goes on with its next messages on its
other instances instead of stopping for ever."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from reach import Agent, Client, ReachSettings, Status, Telemetry
from reach.testing import eventually


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(
        update={
            "topic_timeout": 0.3,
            "topic_ack_wait": 2.0,
            "topic_retry_base": 0.05,
            "topic_retry_cap": 0.1,
            "topic_max_deliver": 3,
            "drain_timeout": 0.5,
        }
    )


async def test_an_ordered_handler_that_ignores_its_timeout_lets_the_name_go_on(
    settings: ReachSettings,
) -> None:
    release = asyncio.Event()  # set: the stubborn handler returns at last
    started = asyncio.Event()
    seen: dict[str, list[int]] = {"a": [], "b": []}
    metrics = CollectorRegistry()

    def instance(tag: str, telemetry: Telemetry | None = None) -> Agent:
        agent = Agent("ledger", f"ledger-{tag}", settings=settings, telemetry=telemetry)

        @agent.on_topic("account.>", durable=True, ordered=True)
        async def on_entry(entry: dict[str, int]) -> None:
            seen[tag].append(entry["n"])
            if tag == "a" and entry["n"] == 1:
                started.set()
                while not release.is_set():
                    with contextlib.suppress(asyncio.CancelledError):  # the fault under test
                        await release.wait()

        return agent

    def gauge() -> float | None:
        labels = {"agent": "ledger", "kind": "topic"}
        return metrics.get_sample_value("reach_agent_handlers_stuck", labels)

    a, b = instance("a", Telemetry(metrics)), instance("b")
    try:
        async with a, Client(settings=settings) as client:
            await client.publish("account.1", {"n": 1}, durable=True)
            await started.wait()
            async with b:
                await client.publish("account.2", {"n": 2}, durable=True)
                # the old code kept message 1 in progress for as long as its handler ran:
                # nothing else of the name was ever delivered
                await eventually(lambda: seen["b"] == [1, 2], timeout=30)
                cells = a.topic_cells()["account.>"]
                assert (cells.delivered, cells.failed, cells.acked) == (1, 1, 0)
                assert (cells.stuck, cells.abandoned) == (1, 1)
                assert b.topic_cells()["account.>"].redelivered == 1
                assert cells.running == 1  # its only worker is still taken: it pulls nothing
                assert seen["a"] == [1]
                assert a.status is Status.DEGRADED
                assert "1 topic handler" in a.heartbeat().reason
                assert gauge() == 1

                release.set()
                await eventually(lambda: cells.stuck == 0, timeout=30)
                await eventually(lambda: a.status is Status.UP, timeout=30)
                assert gauge() == 0
                await client.publish("account.3", {"n": 3}, durable=True)
                await eventually(lambda: sorted(seen["a"] + seen["b"]) == [1, 1, 2, 3])
                assert cells.abandoned == 1
    finally:
        release.set()


async def test_a_handler_that_ignores_its_timeout_on_its_last_delivery_is_dead_lettered(
    settings: ReachSettings,
) -> None:
    """The timeout is the message's outcome even while the handler runs on: on the
    message's last delivery it goes to the DLQ (reason ``timeout``)."""
    release = asyncio.Event()
    runs: list[int] = []
    agent = Agent("sink", settings=settings.model_copy(update={"topic_max_deliver": 1}))

    @agent.on_topic("orders", durable=True)
    async def on_order(n: int) -> None:
        runs.append(n)
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    try:
        async with agent, Client(settings=settings) as client:
            await client.publish("orders", 7, durable=True)
            cells = agent.topic_cells()["orders"]
            await eventually(lambda: cells.dead_lettered == 1, timeout=30)
            [letter] = await client.dead_letters(topic="orders")
            assert letter.reason == "timeout"
            assert (cells.failed, cells.stuck, runs) == (1, 1, [7])
            release.set()
            await eventually(lambda: cells.stuck == 0, timeout=30)
    finally:
        release.set()
