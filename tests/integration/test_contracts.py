"""Contracts (issue 24): the schemas an agent derives from its handlers reach the registry's
records, so ``client.agents()``, once per registration and never in heartbeats; ``reach
asyncapi`` writes them as an AsyncAPI 3.0 document that the official schema accepts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import msgspec
import pytest

from reach import Agent, Client, ReachSettings, Registry
from reach.testing import eventually
from reach.wire import RECORD_ROOM, AgentRecord, Heartbeat

from ..asyncapi_schema import unresolved_refs, validation_errors
from ..demo_fleet import CAPABILITIES, demo_fleet
from .registry_wire import fast_settings
from .test_fleet_view import reach_cli


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


async def test_a_registration_too_big_for_one_message_goes_without_its_largest_schemas(
    settings: ReachSettings, nats_server: Any
) -> None:
    """The largest schemas are left out until the registration fits (max_payload less
    the room the registry's record needs); the others and every description stay."""
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
        bare = [c.name for c in record.info.capabilities if c.payload_schema is None]
        assert 0 < len(bare) < 40
        # Wide10..Wide39 have schemas one byte longer (their title): they go first
        assert set(bare) <= {f"wide.c{n}" for n in range(10, 40)}
        assert len(msgspec.json.encode(record)) <= client.nc.max_payload - RECORD_ROOM // 2
        assert record.info.capabilities[7].description == "number 7"


# -- reach asyncapi ------------------------------------------------------------------------


async def test_reach_asyncapi_writes_a_valid_document_of_the_demo_fleet(
    settings: ReachSettings, tmp_path: Path
) -> None:
    out = tmp_path / "fleet.json"
    async with demo_fleet(settings) as agents:
        code, stdout, err = await reach_cli(settings, "asyncapi", "-o", str(out))
        assert code == 0, err
        assert stdout == ""
        assert f"wrote {out}" in err
        doc = json.loads(out.read_text())
        assert validation_errors(doc) == []
        assert unresolved_refs(doc) == []
        assert doc["asyncapi"] == "3.0.0"
        prefix = settings.subject_prefix
        addresses = {ch["address"] for ch in doc["channels"].values()}
        for cap in CAPABILITIES:
            assert f"{prefix}.cap.{cap}" in addresses
            op = doc["operations"][f"cap.{cap}"]
            assert op["action"] == "receive"
            assert op["bindings"]["nats"]["queue"] == f"cap.{cap}"
            assert op["reply"]["channel"] == {"$ref": f"#/channels/cap.{cap}.reply"}
        assert f"{prefix}.task.{{task_id}}.logistics.reroute.{{priority}}" in addresses
        assert f"{prefix}.topic.order.*" in addresses
        track = doc["components"]["messages"]["cap.logistics.track.1.0.request"]
        assert track["description"] == "where is an order"
        assert doc["components"]["schemas"]["cap.logistics.track.1.0.payload"]["required"] == [
            "order_id"
        ]
        headers = doc["components"]["messageTraits"]["request"]["headers"]["properties"]
        assert {"Reach-Deadline", "Reach-Priority", "Reach-Request-Id", "traceparent"} <= set(
            headers
        )
        serving = {
            a for m in doc["components"]["messages"].values() for a in m.get("x-reach-agents", [])
        }
        assert serving == {a.agent_id for a in agents}

        # one capability, to stdout
        code, stdout, err = await reach_cli(settings, "asyncapi", "--capability", "logistics.*")
        assert code == 0, err
        doc = json.loads(stdout)
        assert validation_errors(doc) == []
        assert sorted(doc["operations"]) == [
            "agent.logistics.track",
            "cap.logistics.track",
            "task.logistics.reroute",
        ]


async def test_reach_asyncapi_says_when_nothing_matches_and_counts_only_what_matched(
    settings: ReachSettings,
) -> None:
    """A glob or tag that matches nothing gives the empty document (rc 0) and one warning
    line; the document's count of instances is of those serving what it shows."""
    helpdesk = described_agent(settings)
    shop = Agent("shop", settings=settings)

    @shop.capability("shop.quote")
    async def quote(order: dict[str, Any]) -> float:
        return 1.0

    async with Registry(settings=settings):
        code, stdout, err = await reach_cli(settings, "asyncapi")
        assert code == 0, err
        assert json.loads(stdout)["operations"] == {}
        assert err == "warning: the fleet serves nothing now; the document is empty\n"
    async with Registry(settings=settings), helpdesk, shop, Client(settings=settings) as client:
        await record_of(client, helpdesk.agent_id)
        await record_of(client, shop.agent_id)

        code, stdout, err = await reach_cli(settings, "asyncapi", "--capability", "shop.*")
        assert (code, err) == (0, "")
        doc = json.loads(stdout)
        assert sorted(doc["operations"]) == ["agent.shop.quote", "cap.shop.quote"]
        assert "served by 1 instance." in doc["info"]["description"]

        for selection in (("--capability", "nomatch.*"), ("--tag", "nosuchtag")):
            code, stdout, err = await reach_cli(settings, "asyncapi", *selection)
            assert code == 0, err
            doc = json.loads(stdout)
            assert validation_errors(doc) == []
            assert doc["operations"] == {}
            assert "served by 0 instances." in doc["info"]["description"]
            (line,) = err.splitlines()
            assert line == (
                f"warning: nothing matches {selection[0]} {shlex.quote(selection[1])} (the fleet"
                " serves 4 capabilities, tasks and topics: `reach asyncapi` alone shows them);"
                " the document is empty"
            )
