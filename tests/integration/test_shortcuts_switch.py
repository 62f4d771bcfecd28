"""The request path's shortcuts through nats-py's internals are fenced: a setting turns
them off, an untested nats-py turns them off with one warning, and a connection reach did
not make never gets them. Off, requests take nats-py's public path and still work."""

import logging

import msgspec
import nats
import pytest

from reach import Agent, Client
from reach._delivery import DirectQueue, publish, shortcuts_allowed, subscribe_direct


def echo(settings) -> Agent:
    agent = Agent("echo", "echo-1", settings=settings)

    @agent.capability("echo.say")
    async def say(job: dict) -> dict:
        return job

    return agent


def _reads_direct(nc) -> bool:
    return getattr(nc._process_msg, "reads_direct", False)


@pytest.mark.parametrize("on", [True, False])
async def test_requests_work_with_the_shortcuts_on_and_off(reach_settings, on):
    settings = reach_settings.model_copy(update={"nats_shortcuts": on})
    async with echo(settings) as agent, Client(settings=settings) as client:
        replies = [await client.request("echo.say", {"n": n}) for n in range(20)]
        nc = client.nc
        assert nc.reach_shortcuts is on
        assert agent._nc.reach_shortcuts is on
        assert _reads_direct(nc) is on  # the replaced reader only when on
        queue = client._inbox._sub._pending_queue
        assert isinstance(queue, DirectQueue) is on
        assert publish(nc, "x.y", b"{}") is on  # off: always nats-py's own publish
    assert replies == [{"n": n} for n in range(20)]


async def test_a_connection_reach_did_not_make_gets_no_shortcut(reach_settings):
    nc = await nats.connect(reach_settings.nats_url)
    try:
        got: list[bytes] = []
        sub = await subscribe_direct(nc, "plain.a", lambda m: got.append(m.data))
        assert not isinstance(sub._pending_queue, DirectQueue)
        assert not _reads_direct(nc)
        assert not publish(nc, "plain.a", b"1")
        await nc.publish("plain.a", b"2")
        await nc.flush()
        await sub.drain()
    finally:
        await nc.close()
    assert got == [b"2"]


def test_an_untested_nats_py_turns_them_off_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="reach.nats")
    nc = nats.NATS()
    assert shortcuts_allowed(nc)  # the installed, tested version
    assert not shortcuts_allowed(nc, version="9.9.9")
    assert not shortcuts_allowed(nc, version="9.9.9")
    warned = [r for r in caplog.records if "9.9.9" in r.getMessage()]
    assert len(warned) == 1


def test_a_connection_missing_an_attribute_they_read_gets_none():
    class Thin:
        """What a future nats-py might look like: an internal renamed."""

    assert not shortcuts_allowed(Thin(), version=sorted(_tested())[0])  # type: ignore[arg-type]


def _tested() -> frozenset[str]:
    from reach._delivery import TESTED_NATS_PY

    return TESTED_NATS_PY


def test_the_setting_is_read_from_the_environment(monkeypatch):
    from reach import ReachSettings

    monkeypatch.setenv("REACH_NATS_SHORTCUTS", "false")
    assert ReachSettings().nats_shortcuts is False
    assert msgspec.json.decode(b"true") is True
