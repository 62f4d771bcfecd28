"""Contracts in the routing table (issue 24): the schemas an agent derives from its
handlers reach the registry's records, so ``client.agents()``, once per registration,
and never the heartbeats."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from reach import Agent, Client, ReachSettings, Registry
from reach.testing import eventually
from reach.wire import AgentRecord, Heartbeat

from .registry_wire import fast_settings


class Ask(msgspec.Struct):
    question: str
    lang: str = "en"


@pytest.fixture
def settings(nats_server: Any) -> ReachSettings:
    return fast_settings(nats_server.url)


def described_agent(settings: ReachSettings) -> Agent:
    agent = Agent("helpdesk", settings=settings)

    @agent.capability("help.ask", version="1.1.0")
    async def ask(q: Ask) -> str:
        """Answer a question."""
        return q.question

    @agent.task("help.report")
    async def report(q: Ask) -> dict[str, Any]:
        return {}

    @agent.on_topic("help.*")
    async def heard(payload: dict[str, Any]) -> None:
        return None

    return agent


async def record_of(client: Client, agent_id: str) -> AgentRecord:
    async def listed() -> bool:
        return any(r.info.agent_id == agent_id for r in await client.agents())

    await eventually(listed, timeout=30)
    return next(r for r in await client.agents() if r.info.agent_id == agent_id)


async def test_the_routing_table_carries_each_capability_s_contract(
    settings: ReachSettings,
) -> None:
    agent = described_agent(settings)
    async with Registry(settings=settings), agent, Client(settings=settings) as client:
        record = await record_of(client, agent.agent_id)
        (cap,) = record.info.capabilities
        assert cap.description == "Answer a question."
        assert cap.payload_schema is not None
        assert cap.payload_schema["required"] == ["question"]
        assert cap.result_schema == {"type": "string"}
        (task,) = record.info.tasks
        assert (task.name, task.result_schema) == ("help.report", {"type": "object"})
        (topic,) = record.info.topics
        assert (topic.pattern, topic.payload_schema) == ("help.*", {"type": "object"})


async def test_heartbeats_carry_no_schema(settings: ReachSettings) -> None:
    agent = described_agent(settings)
    async with Registry(settings=settings), Client(settings=settings) as watcher:
        sub = await watcher.nc.subscribe(watcher.subjects.heartbeat(agent.agent_id))
        await watcher.flush()
        async with agent:
            msg = await sub.next_msg(timeout=10)
        await sub.unsubscribe()  # a subscription left with messages slows the close
        body = msgspec.json.decode(msg.data)
        assert set(body) == set(Heartbeat.__struct_fields__) | {"type"}
        assert b"schema" not in msg.data


async def test_a_registration_too_big_for_one_message_goes_without_its_schemas(
    settings: ReachSettings, nats_server: Any
) -> None:
    agent = Agent("wide", settings=settings)
    fields = [(f"field_{i:04d}_with_a_rather_long_name", int) for i in range(330)]
    for n in range(40):  # 40 schemas of ~30 KiB each: more than the server's 1 MiB
        Wide = msgspec.defstruct(f"Wide{n}", fields)

        async def handler(payload: Any) -> None:
            return None

        handler.__annotations__ = {"payload": Wide, "return": None}
        agent.capability(f"wide.c{n}", description=f"number {n}")(handler)
    async with Registry(settings=settings), agent, Client(settings=settings) as client:
        assert agent.info().capabilities[0].payload_schema is not None
        assert len(msgspec.json.encode(agent.info())) > client.nc.max_payload
        record = await record_of(client, agent.agent_id)
        assert len(record.info.capabilities) == 40
        assert {c.payload_schema for c in record.info.capabilities} == {None}
        assert record.info.capabilities[7].description == "number 7"
