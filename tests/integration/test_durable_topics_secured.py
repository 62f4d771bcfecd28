"""Durable topics on the shipped secured config (services/nats/nats-server.conf): the
``client`` user (and agent ``logistics-1``, as a caller) publishes durably, ``client``
reads history (``since``), agent ``aftersales-1`` subscribes durably as itself, a failing
message goes to the DLQ and admin's ``reach dlq replay`` brings it back to that agent,
with no permission refused anywhere (the server's log included)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from nats.aio.msg import Msg

from reach import Agent, Client
from reach.testing import NatsServer, eventually
from tests.integration.test_auth import PASSWORDS, as_user, secured, violations

__all__ = ["secured"]  # the module-scoped server fixture, as test_auth has it

#: short retries, so a failing message reaches the DLQ in well under a second
QUICK = {
    "topic_ack_wait": 2.0,
    "topic_retry_base": 0.05,
    "topic_retry_cap": 0.1,
    "topic_max_deliver": 2,
    "topic_lag_interval": 0.2,
}
PAD = "x" * 100_000  # 30 of these: past the 2 MB after which the server asks for flow control


async def as_admin(server: NatsServer, *args: str) -> str:
    """``reach ARGS`` as admin, as a deployment or an operator runs it; its stdout."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        *args,
        env={
            **os.environ,
            "REACH_NATS_URL": server.url,
            "REACH_NATS_USER": "admin",
            "REACH_NATS_PASSWORD": PASSWORDS["admin"],
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_durable_topics_work_with_their_own_users(secured: NatsServer):
    """Durable publishes as ``client`` and ``logistics-1``; a durable subscription as
    ``aftersales-1``: its consumer, pulls, acks (one after two ``in_progress``, on one
    reply subject: past what ``allow_responses`` lets through), lag, a dead letter;
    admin's ``reach dlq replay`` of it; a ``since`` history long enough for flow control.
    All through the shipped permissions, with no refusal."""
    streams = json.loads(await as_admin(secured, "topics", "init", "--json"))["streams"]
    assert streams == ["REACH_TOPICS", "REACH_DLQ"]
    before = len(violations(secured))
    fixed, release = asyncio.Event(), asyncio.Event()
    seen: list[int] = []
    agent = Agent("aftersales", "aftersales-1", settings=as_user(secured, "aftersales-1", **QUICK))

    @agent.on_topic("order.*", durable=True)
    async def on_status(update: dict, topic: str) -> None:
        if update.get("fail") and not fixed.is_set():
            raise RuntimeError(f"cannot read {topic}")
        if update.get("hold"):
            await release.wait()
        seen.append(update["n"])

    spied: list[tuple[str, bytes]] = []  # what reached the acks' and flow control's subjects

    async def spy(msg: Msg) -> None:
        spied.append((msg.subject, msg.data))

    def sent(body: bytes) -> list[str]:
        return [subject for subject, data in spied if data == body]

    async with (
        agent,
        Client(settings=as_user(secured, "client"), name="shopper") as client,
        Client(settings=as_user(secured, "admin"), name="admin") as admin,
    ):
        for subject in ("$JS.ACK.REACH_TOPICS.>", "$JS.FC.REACH_TOPICS.>"):
            await admin.nc.subscribe(subject, cb=spy)
        await admin.flush()
        cells = agent.topic_cells()["order.*"]
        assert await client.publish("order.status", {"n": 1}, durable=True) > 0
        await eventually(lambda: seen == [1], 10)

        async with Client(settings=as_user(secured, "logistics-1"), name="logistics-1") as own:
            await own.publish("order.status", {"n": 2, "fail": True}, durable=True)
            await own.flush()
            assert own.stats.permission_violations == 0
        await eventually(lambda: cells.dead_lettered == 1, 10)
        assert cells.failed == 2
        [letter] = await admin.dead_letters(topic="order.*")
        assert (letter.kind, letter.topic, letter.group) == ("topic", "order.status", "aftersales")
        fixed.set()
        assert int(await as_admin(secured, "dlq", "replay", str(letter.seq))) > 0
        await eventually(lambda: seen == [1, 2], 10)

        await client.publish("order.status", {"n": 3, "hold": True}, durable=True)
        await eventually(lambda: len(sent(b"+WPI")) >= 2, 10)  # every topic_ack_wait/3
        release.set()
        await eventually(lambda: seen == [1, 2, 3], 10)
        [held] = set(sent(b"+WPI"))
        await eventually(lambda: held in sent(b""), 10)  # its ack (nats-py's has no body)
        await eventually(lambda: cells.acked == 3 and cells.lag == 0, 10)  # lag: consumer info

        for n in range(4, 34):
            await client.publish("order.bulk", {"n": n, "pad": PAD}, durable=True)
        async with await client.subscribe("order.*", since=1) as sub:
            history = [(await sub.next(timeout=10)).json()["n"] for _ in range(33)]
        assert history == list(range(1, 34))
        await eventually(lambda: any(s.startswith("$JS.FC.REACH_TOPICS.") for s, _ in spied))
        await eventually(lambda: cells.acked == 33, 20)
        await client.flush()
        assert client.stats.permission_violations == 0
        assert agent.client.stats.permission_violations == 0
    assert violations(secured)[before:] == []
