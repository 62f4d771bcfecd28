"""Closing with something left open: a client whose topic subscriptions (plain, or with
``since`` history) still hold unread messages closes at once, without a false "lost ...
reconnecting" line; an agent and a registry whose server is gone stop without an error."""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import pytest

from reach import Agent, Client, ReachSettings, Registry
from reach._nats import NatsConnection, ReachConnection, _Link
from reach._permissions import Permissions
from reach._runtime import loop_factory
from reach.testing import NatsServer, unique_prefix


async def closes_promptly(client: Client) -> None:
    """``client.close()`` ends within 10 s (nats-py's drain gave up after 30). Not by
    ``wait_for``: nats-py's drain swallows the cancel, and a late close would pass."""
    closing = asyncio.ensure_future(client.close())
    done, _ = await asyncio.wait({closing}, timeout=10)
    if closing not in done:
        closing.cancel()
        await asyncio.wait({closing})
        pytest.fail("client.close() took over 10 s")
    closing.result()


def reconnecting(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "reconnecting" in r.getMessage()]


async def test_close_with_an_open_subscription_holding_unread_messages_is_prompt(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
):
    client = Client(settings=reach_settings, name="leaky")
    await client.connect()
    sub = await client.subscribe("leak.>")
    for n in range(3):
        await client.publish(f"leak.{n}", {"n": n})
    await client.flush()
    with caplog.at_level(logging.DEBUG, logger="reach"):
        await closes_promptly(client)
    assert not client.connected
    assert reconnecting(caplog) == []
    await sub.unsubscribe()  # closing it again later is harmless


async def test_close_with_an_open_since_subscription_holding_history_is_prompt(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
):
    client = Client(settings=reach_settings, name="leaky-history")
    await client.connect()
    for n in range(3):
        assert await client.publish("kept.one", {"n": n}, durable=True) > 0
    sub = await client.subscribe("kept.>", since=1)
    first = await sub.next(timeout=10)  # history is arriving; two are left unread
    assert first.seq >= 1
    with caplog.at_level(logging.DEBUG, logger="reach"):
        await closes_promptly(client)
    assert not client.connected
    assert reconnecting(caplog) == []


def test_an_error_of_our_own_close_is_not_logged_as_a_lost_connection(
    caplog: pytest.LogCaptureFixture,
):
    """nats-py reports a drain that timed out (a TimeoutError) to the error callback; while
    we close, that is not "lost ...; reconnecting" (nothing reconnects)."""
    nc = ReachConnection(Permissions("closing"))
    link = _Link("closing", "nats://127.0.0.1:4222", Permissions("closing"), nc)
    link.connected()
    nc._status = NatsConnection.CONNECTED
    nc.reach_closing = True
    with caplog.at_level(logging.DEBUG, logger="reach"):
        link.error(nats.errors.DrainTimeoutError())
    assert reconnecting(caplog) == []
    assert link.down_since is None
    nc.reach_closing = False  # the same error on a live connection is a loss
    with caplog.at_level(logging.DEBUG, logger="reach"):
        link.error(nats.errors.DrainTimeoutError())
    assert len(reconnecting(caplog)) == 1


def test_an_agent_and_a_registry_whose_server_is_gone_stop_without_an_error(
    caplog: pytest.LogCaptureFixture,
):
    """On the loop a program runs on (uvloop when installed), nats-py's close of a connection
    whose server was killed raises RuntimeError ("the handler is closed"): stopping logs
    no error and no traceback."""
    server = NatsServer().start()

    async def run() -> None:
        settings = ReachSettings(nats_url=server.url, subject_prefix=unique_prefix())
        registry = Registry(settings=settings, stop_timeout=2)
        agent = Agent("doomed", settings=settings, drain_timeout=1)

        @agent.capability("noop")
        async def noop(x: int) -> int:
            return x

        await registry.start()
        await agent.start()
        server.kill()  # by PID
        await agent.stop()
        await registry.stop()

    try:
        with caplog.at_level(logging.DEBUG):
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                runner.run(run())
    finally:
        server.close()
    # (the registry's task loops log their failed requests while the server is away:
    # another matter; here, what stopping itself logs)
    bad = [
        r
        for r in caplog.records
        if "stop failed" in r.getMessage()
        or ("clos" in r.getMessage() and (r.levelno >= logging.ERROR or r.exc_info))
        or (r.exc_info and isinstance(r.exc_info[1], RuntimeError))
    ]
    assert bad == [], [r.getMessage() for r in bad]
