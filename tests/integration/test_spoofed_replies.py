"""A reply to a direct attempt counts only when it comes from the instance that was asked:
another instance's answer (forged, or misrouted) is dropped and counted, and the call
waits for the real one."""

import asyncio

import nats
import pytest

from reach import Agent, Client, ReachSettings
from reach.testing import unique_prefix
from reach.wire import Header


@pytest.mark.parametrize("named_by", ["reply_subject", "header"])
async def test_a_reply_naming_another_instance_is_ignored_and_counted(nats_server, named_by):
    settings = ReachSettings(nats_url=nats_server.url, subject_prefix=unique_prefix())
    forged = asyncio.Event()
    honest = Agent("echo", "echo-a", settings=settings)

    @honest.capability("spoof.echo")
    async def echo(payload: dict) -> dict:
        await forged.wait()  # the forger answers first
        return {"from": "echo-a", **payload}

    rogue = await nats.connect(nats_server.url)

    async def forge(msg) -> None:
        if named_by == "reply_subject":
            await rogue.publish(msg.reply, b'{"from": "rogue"}', reply=f"{prefix}echo-b.x")
        else:
            await rogue.publish(msg.reply, b'{"from": "rogue"}', headers={Header.AGENT: "echo-b"})
        # twice: nats-py's flush PING can overtake a buffered PUB (NATS-FACTS)
        await rogue.flush()
        await rogue.flush()
        forged.set()

    prefix = f"{settings.subject_prefix}.agent."
    try:
        await rogue.subscribe(f"{prefix}echo-a.spoof.echo", cb=forge)
        await rogue.flush()
        async with honest, Client(settings=settings) as client:
            reply = await client.call("spoof.echo", {"n": 1}, agent_id="echo-a", timeout=10)
            assert reply.value == {"from": "echo-a", "n": 1}
            assert reply.agent_id == "echo-a"
            assert client.stats.replies_ignored == 1
    finally:
        await rogue.close()
