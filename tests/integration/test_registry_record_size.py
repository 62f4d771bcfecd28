"""Records near the server's max_payload: nothing the registry writes may be over it.

The server counts a message's headers in max_payload (nats-py does not) and closes the
connection of a client that sends more, so one agent with large schemas could take the
registry's connection, and with it the whole routing table. On a server whose
max_payload is 64 KiB: the agent registers without the schemas that do not fit (warned),
the registry answers a registration its record cannot hold with ``bad_request``, never
sends a heartbeat write that would not fit, and a registry whose connection the server
closes anyway serves again on a new one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

import reach
from reach import Agent, Client, Registry
from reach._codec import encode_json, error_reply, now_ms
from reach._contracts.schemas import described
from reach._kv import write as kv_write
from reach.testing import NatsServer, eventually
from reach.wire import (
    RECORD_ROOM,
    AgentRecord,
    Control,
    Heartbeat,
    RegisterReply,
    Registration,
    Status,
    Transition,
)

from .registry_wire import ERROR, WireAgent, beat, fast_settings, heartbeat, info, register

MAX_PAYLOAD = 64 * 1024


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server whose max_payload is 64 KiB (JetStream on)."""
    where = tmp_path_factory.mktemp("small-payload")
    config = where / "server.conf"
    config.write_text(f'max_payload: {MAX_PAYLOAD}\njetstream {{ store_dir: "{where / "js"}" }}\n')
    with NatsServer(config_file=Path(config)) as server:
        yield server


@pytest.fixture
def settings(small_server: NatsServer) -> reach.ReachSettings:
    return fast_settings(small_server.url)


def documented(chars: int) -> type:
    """A struct whose JSON Schema takes about ``chars`` bytes (its docstring)."""

    class Doc(msgspec.Struct):
        x: int

    Doc.__doc__ = "d" * chars
    return Doc


def agent_of_size(settings: reach.ReachSettings, agent_id: str, size: int) -> Agent:
    """An agent serving ``big.one`` (large schemas) and ``small.two`` (small ones) whose
    registration, once started, takes ``size`` bytes."""

    def make(chars: int) -> Agent:
        agent = Agent("big", agent_id, settings=settings)

        async def one(payload: Any) -> Any:
            return payload

        big = documented(chars)
        one.__annotations__ = {"payload": big, "return": big}
        agent.capability("big.one")(one)

        @agent.capability("small.two")
        async def two(payload: int) -> int:
            return payload

        return agent

    def measured(agent: Agent) -> int:
        started = msgspec.structs.replace(agent.info(), started_ms=now_ms())
        return len(encode_json(Registration(info=started)))

    base = measured(make(1000))
    agent = make(1000 + (size - base) // 2)  # the docstring is in both schemas
    assert abs(measured(agent) - size) <= 1
    return agent


async def registry_serves(settings: reach.ReachSettings, registry: Registry, agent_id: str) -> None:
    """The registry still answers: another agent registers and every client sees it."""
    assert registry._core.nc is not None
    assert registry._core.nc.is_connected
    async with Client(settings=settings) as client, WireAgent(client.nc, settings, agent_id):

        async def listed() -> bool:
            return agent_id in {r.info.agent_id for r in await client.agents()}

        await eventually(listed)


@pytest.mark.parametrize(
    ("under", "schemas_kept"),
    [(40, False), (400, False), (RECORD_ROOM // 2, False), (RECORD_ROOM + 2048, True)],
)
async def test_an_agent_whose_registration_nears_max_payload_registers_and_the_registry_lives(
    settings: reach.ReachSettings, caplog: pytest.LogCaptureFixture, under: int, schemas_kept: bool
) -> None:
    """A registration ``under`` bytes below max_payload: the registry's record is bigger
    (heartbeat, transitions, KV headers). Within ``RECORD_ROOM`` of the limit the agent
    leaves out the largest schemas (one warning naming them and their size), registers,
    heartbeats, and the registry keeps serving everyone else."""
    caplog.set_level(logging.WARNING, "reach.agent")
    agent = agent_of_size(settings, "big-1", MAX_PAYLOAD - under)
    async with Registry(settings=settings) as registry, agent:

        def heartbeats_stored() -> bool:
            record = registry.records().get("big-1")
            return record is not None and record.heartbeat is not None and record.heartbeat.seq > 3

        await eventually(heartbeats_stored)
        assert agent.presence.registered
        caps = {c.name: c for c in registry.records()["big-1"].info.capabilities}
        assert caps["small.two"].payload_schema == {"type": "integer"}
        warned = [r.getMessage() for r in caplog.records if "schemas" in r.getMessage()]
        if schemas_kept:
            assert caps["big.one"].payload_schema is not None
            assert warned == []
        else:
            assert (caps["big.one"].payload_schema, caps["big.one"].result_schema) == (None, None)
            (message,) = warned
            assert "big.one (" in message
            assert "small.two" not in message
            assert str(MAX_PAYLOAD) in message
        await registry_serves(settings, registry, "geo-after")
        assert registry.stats.write_errors == 0


async def test_an_agent_that_cannot_register_even_without_schemas_is_refused_at_start(
    settings: reach.ReachSettings,
) -> None:
    agent = Agent("wordy", "wordy-1", settings=settings)
    for i in range(60):

        @agent.capability(f"wordy.c{i}", description="w" * 1000)
        async def c(payload: int) -> int:
            return payload

    with pytest.raises(reach.PayloadTooLarge) as info_:
        await agent.start()
    message = str(info_.value)
    assert "even without" in message
    assert str(MAX_PAYLOAD - RECORD_ROOM) in message
    assert info_.value.limit == MAX_PAYLOAD - RECORD_ROOM
    assert info_.value.size > info_.value.limit


async def test_an_agent_a_registry_refuses_as_bad_request_asks_again_without_schemas(
    settings: reach.ReachSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry may see a smaller max_payload than the agent (another server of a
    cluster): when it refuses a registration with schemas as ``bad_request``, the agent
    asks once more without them, rather than retrying the same forever."""
    caplog.set_level(logging.WARNING, "reach.agent")
    seen: list[Registration] = []
    async with Client(settings=settings) as client:

        async def registry(msg: Msg) -> None:  # a registry of plain NATS
            reg = msgspec.json.decode(msg.data, type=Registration)
            seen.append(reg)
            if described(reg.info):
                body, headers = error_reply("bad_request", "record too large (9 bytes > limit 8)")
            else:
                reply = RegisterReply(lease_ttl=60, heartbeat_interval=0.2, registry="plain")
                body, headers = encode_json(reply), None
            await client.nc.publish(msg.reply, body, headers=headers)

        sub = await client.nc.subscribe(client.subjects.register("*"), cb=registry)
        await client.flush()
        agent = agent_of_size(settings, "big-2", 4096)
        async with agent:
            assert agent.presence.registered
        await sub.unsubscribe()
    assert [described(reg.info) for reg in seen] == [True, False]
    assert any("record too large (9 bytes > limit 8)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("under", [RECORD_ROOM - 100, 400, 40])
async def test_a_registration_its_record_cannot_hold_is_bad_request(
    settings: reach.ReachSettings, under: int
) -> None:
    """Whatever sent it (an agent of another SDK, an older one): ``bad_request`` saying
    "record too large", never ``agent_unavailable``, and nothing reaches the server."""
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        big = msgspec.structs.replace(info("geo-big"), metadata={"m": "x"})
        padding = MAX_PAYLOAD - under - len(encode_json(Registration(info=big)))
        big = msgspec.structs.replace(big, metadata={"m": "x" * (padding + 1)})
        assert len(encode_json(Registration(info=big))) == MAX_PAYLOAD - under
        reply = await register(client.nc, settings, big)
        assert reply.headers is not None
        assert reply.headers[ERROR] == "400", reply.headers
        text = reply.headers["Nats-Service-Error"]
        assert text.startswith("record too large (")
        assert f"> limit {MAX_PAYLOAD - RECORD_ROOM}" in text
        assert registry.records() == {}
        await registry_serves(settings, registry, "geo-after")


async def test_a_heartbeat_whose_record_would_not_fit_is_not_sent(
    settings: reach.ReachSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A record stored near the limit (by another writer, an older registry): a heartbeat
    that would take it over max_payload with its headers is not written (counted, logged),
    and the registry's connection lives."""
    agent_id = "geo-near"
    hb = msgspec.json.decode(beat(agent_id, 5, reason="r" * 200), type=Heartbeat)
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        now = now_ms()

        def record(padding: int, heartbeat: Heartbeat | None) -> AgentRecord:
            base = msgspec.structs.replace(info(agent_id), metadata={"m": "x" * padding})
            t = Transition(old=None, new=Status.UP, reason="registered", at_ms=now)
            return AgentRecord(
                info=base,
                status=Status.UP,
                heartbeat=heartbeat,
                registered_ms=now,
                last_seen_ms=now,
                transitions=[t],
                registry=registry.registry_id,
            )

        # The record the heartbeat would write: under max_payload alone, over it with the
        # KV headers (what nats-py lets through and the server closes the connection for).
        target = MAX_PAYLOAD - 30
        padding = target - len(encode_json(record(0, hb)))
        assert len(encode_json(record(padding, hb))) == target
        stored_before = record(padding, None)
        bucket = client.subjects.bucket("agents")
        await kv_write(
            client.nc.jetstream(), bucket, agent_id, encode_json(stored_before), last=None, ttl=60
        )
        await eventually(lambda: agent_id in registry.records())
        errors = registry.stats.write_errors
        ctl = await client.nc.subscribe(client.subjects.ctl(agent_id))
        await client.flush()
        await heartbeat(client.nc, settings, agent_id, encode_json(hb))
        asked = await ctl.next_msg(timeout=10)  # to register again: that is size-checked
        assert msgspec.json.decode(asked.data, type=Control).command == "register"
        assert registry.stats.write_errors == errors + 1
        assert registry.records()[agent_id].heartbeat is None
        assert any("too large" in r.getMessage() for r in caplog.records)
        await registry_serves(settings, registry, "geo-after")


async def test_a_registry_whose_connection_the_server_closes_serves_again(
    settings: reach.ReachSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-py gives a connection up for good when the server closes it for a protocol
    error (it does not reconnect): the registry opens a new one and serves again, its view
    rebuilt from the bucket, rather than living on with a dead connection."""
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        async with WireAgent(client.nc, settings, "geo-before"):
            await eventually(lambda: "geo-before" in registry.records())
            old = registry._core.nc
            assert old is not None
            # Within max_payload alone, over it with the header: the server closes the
            # connection, and nats-py does not reconnect.
            headers: dict[str, Any] = {"X-Pad": "p" * 64}
            await old.publish("nowhere", b"x" * (MAX_PAYLOAD - 16), headers=headers)
            await eventually(lambda: old.is_closed)
            await eventually(lambda: registry.stats.connections_replaced == 1)
            assert registry._core.nc is not old
            assert "geo-before" in registry.records()
            await registry_serves(settings, registry, "geo-after")
        assert any("closed" in r.getMessage() for r in caplog.records)
    assert registry.footprint()["background"] == 0
