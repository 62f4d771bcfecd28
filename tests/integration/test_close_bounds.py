"""Closing is bounded: a background coroutine that swallows its cancellation (nats-py can, on
Python 3.11) no longer holds ``Registry.stop`` or ``Client.close`` forever. They wait at
most their bound, then log the coroutine by name and leave it behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from reach import Client, ReachSettings, Registry


def stubborn() -> tuple[Callable[[], Coroutine[Any, Any, None]], asyncio.Event, asyncio.Event]:
    """A coroutine that ignores every cancel until released; (factory, running, release)."""
    running, release = asyncio.Event(), asyncio.Event()

    async def run() -> None:
        running.set()
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    return run, running, release


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_registry_stop_is_bounded_and_names_what_did_not_end(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
):
    registry = Registry(settings=reach_settings, stop_timeout=0.5)
    await registry.start()
    run, running, release = stubborn()
    registry._owner.spawn(run(), "stubborn loop")
    await running.wait()
    try:
        with caplog.at_level(logging.ERROR):
            async with asyncio.timeout(30):  # (it never returned)
                await registry.stop()
        assert any("stubborn loop" in m and "did not end" in m for m in said(caplog))
    finally:
        release.set()


async def test_client_close_is_bounded_and_names_what_did_not_end(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
):
    client = Client(settings=reach_settings, name="bounded")
    await client.connect()
    await client.agents()  # its watches run: the close has tasks to end
    client._watches.close_timeout = 0.5
    run, running, release = stubborn()
    client._watches.owner.spawn(run(), "stubborn loop")
    await running.wait()
    try:
        with caplog.at_level(logging.ERROR):
            async with asyncio.timeout(30):  # (it never returned)
                await client.close()
        assert any("stubborn loop" in m and "did not end" in m for m in said(caplog))
        assert not client.connected
    finally:
        release.set()


async def test_client_close_is_bounded_by_its_streams_loop_too(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
):
    """The streams' keepalive owner is closed within the same bound as the watches."""
    client = Client(settings=reach_settings, name="bounded")
    await client.connect()
    client._watches.close_timeout = 0.5
    run, running, release = stubborn()
    client._streams._owner.spawn(run(), "stubborn stream loop")
    await running.wait()
    try:
        with caplog.at_level(logging.ERROR):
            async with asyncio.timeout(30):  # (it never returned)
                await client.close()
        assert any("stubborn stream loop" in m and "did not end" in m for m in said(caplog))
        assert not client.connected
    finally:
        release.set()


async def test_registry_stop_drops_a_heartbeat_backlog_instead_of_working_through_it(
    nats_server, monkeypatch
):
    """At 100,000 agents a registry holds tens of thousands of heartbeats not yet handled;
    working through them made SIGTERM take over 10 s. Heartbeats are soft state (the next
    one renews, at this replica or another), so stop drops the backlog: here the handler
    is stuck on the first one with 2,000 behind it, and stop ends at once, none handled."""
    import nats

    from reach._registry.heartbeats import Heartbeats

    stuck, handled = asyncio.Event(), []
    taken = asyncio.Event()

    async def slow(self: Heartbeats, msg: Any) -> None:
        handled.append(msg.subject)
        taken.set()
        await stuck.wait()

    monkeypatch.setattr(Heartbeats, "on_message", slow)
    from reach.testing import unique_prefix

    settings = ReachSettings(nats_url=nats_server.url, subject_prefix=unique_prefix())
    registry = Registry(settings=settings, stop_timeout=60)
    await registry.start()
    nc = await nats.connect(nats_server.url)
    try:
        for i in range(2000):
            await nc.publish(f"{settings.subject_prefix}.hb.a-{i}", b"{}")
        await nc.flush()
        await taken.wait()
        async with asyncio.timeout(10):  # a drain would wait the 60 s stop_timeout
            await registry.stop()
        assert len(handled) == 1
    finally:
        stuck.set()
        await nc.close()
