"""The fleet's catalogue and its AsyncAPI 3.0 document (issue 24), from records alone:
versions, selection, and schemas hoisted so that every reference resolves."""

from __future__ import annotations

from typing import Any

import msgspec

from reach import Agent, ReachSettings
from reach._contracts.asyncapi import asyncapi_document, fleet_document
from reach._contracts.catalogue import catalogue, version_key
from reach._subjects import Subjects
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Status

from ..asyncapi_schema import unresolved_refs, validation_errors
from ..demo_fleet import CAPABILITIES, TASKS, demo_agents


def record(
    agent_id: str, *caps: CapabilityInfo, status: Status = Status.UP, tags: tuple[str, ...] = ()
) -> AgentRecord:
    info = AgentInfo(agent_id=agent_id, name="a", capabilities=list(caps), tags=list(tags))
    return AgentRecord(info=info, status=status)


def cap(
    version: str, payload: dict[str, Any] | None, name: str = "text.translate"
) -> CapabilityInfo:
    return CapabilityInfo(name=name, version=version, payload_schema=payload, result_schema={})


def test_instances_with_other_versions_or_schemas_are_variants_newest_first() -> None:
    old = {"type": "string"}
    new = {"type": "object", "properties": {"text": {"type": "string"}}}
    cat = catalogue(
        [
            record("a-1", cap("1.9.0", old)),
            record("a-2", cap("1.10.0", new)),
            record("a-3", cap("1.10.0", new)),
            record("a-4", cap("1.10.0", old)),  # mid-rollout: same version, other schema
            record("a-5", cap("1.10.0", new), status=Status.DOWN),  # leaving: not counted
        ]
    )
    (offer,) = cat.capabilities
    assert [(v.label, v.agents) for v in offer.variants] == [
        ("1.10.0", ("a-2", "a-3")),
        ("1.10.0-2", ("a-4",)),
        ("1.9.0", ("a-1",)),
    ]
    assert offer.newest.payload == new
    assert cat.agents == ("a-1", "a-2", "a-3", "a-4")
    assert version_key("1.10.2") > version_key("1.9")


def test_names_and_tags_choose_what_is_exposed() -> None:
    records = [
        record("a-1", cap("1.0", None, "text.translate"), cap("1.0", None, "img.resize")),
        record("a-2", cap("1.0", None, "text.summarize"), tags=("gpu",)),
    ]
    names = lambda cat: [o.name for o in cat.capabilities]  # noqa: E731
    assert names(catalogue(records)) == ["img.resize", "text.summarize", "text.translate"]
    assert names(catalogue(records, names=["text.*"])) == ["text.summarize", "text.translate"]
    assert names(catalogue(records, tags=["gpu"])) == ["text.summarize"]
    assert names(catalogue(records, names=["img.*", "*.summarize"], tags=["gpu"])) == [
        "text.summarize"
    ]


def test_the_demo_fleet_s_document_is_valid_and_every_reference_resolves() -> None:
    settings = ReachSettings()
    records = [AgentRecord(info=a.info(), status=Status.UP) for a in demo_agents(settings)]
    doc = fleet_document(
        records, subjects=Subjects("acme.prod"), url="nats://user:secret@nats.example:4333"
    )
    assert validation_errors(doc) == []
    assert unresolved_refs(doc) == []
    assert doc["servers"] == {"nats": {"host": "nats.example:4333", "protocol": "nats"}}
    assert "secret" not in msgspec.json.encode(doc).decode()
    assert doc["channels"]["cap.support.ask"]["address"] == "acme.prod.cap.support.ask"
    assert doc["channels"]["topic.order.any"]["address"] == "acme.prod.topic.order.*"
    ops = doc["operations"]
    for name in CAPABILITIES:
        assert ops[f"cap.{name}"]["reply"]["messages"][0] == {
            "$ref": f"#/channels/cap.{name}.reply/messages/error"
        }
    for name in TASKS:
        assert ops[f"task.{name}"]["reply"]["channel"] == {"$ref": "#/channels/taskdone"}


class Order(msgspec.Struct):
    id: str
    lines: list[Line]


class Line(msgspec.Struct):
    sku: str


def test_two_shapes_under_one_name_stay_apart_and_one_shape_is_written_once() -> None:
    """Two capabilities' ``Order`` types differ: each keeps its own; ``Line`` is shared."""
    Other = msgspec.defstruct("Order", [("total", float), ("lines", list[Line])])
    agent = Agent("shop", settings=ReachSettings())

    async def place(orders: list[Order]) -> None:
        return None

    async def quote(orders: Any) -> None:
        return None

    quote.__annotations__ = {"orders": list[Other], "return": None}  # type: ignore[valid-type]
    agent.capability("shop.place")(place)
    agent.capability("shop.quote")(quote)
    cat = catalogue([AgentRecord(info=agent.info(), status=Status.UP)])
    doc = asyncapi_document(cat, subjects=Subjects("reach"))
    assert validation_errors(doc) == []
    assert unresolved_refs(doc) == []
    schemas = doc["components"]["schemas"]
    assert schemas["Line"]["properties"] == {"sku": {"type": "string"}}
    assert "Line-2" not in schemas
    assert set(schemas["Order"]["properties"]) == {"id", "lines"}
    assert set(schemas["Order-2"]["properties"]) == {"total", "lines"}
    for order in ("Order", "Order-2"):
        assert schemas[order]["properties"]["lines"]["items"] == {
            "$ref": "#/components/schemas/Line"
        }
    assert schemas["cap.shop.place.1.0.0.payload"]["items"] == {
        "$ref": "#/components/schemas/Order"
    }
    assert schemas["cap.shop.quote.1.0.0.payload"]["items"] == {
        "$ref": "#/components/schemas/Order-2"
    }


def test_an_empty_fleet_is_still_a_valid_document() -> None:
    doc = asyncapi_document(catalogue([]), subjects=Subjects("reach"), servers=["nats://h:1"])
    assert validation_errors(doc) == []
    assert doc["operations"] == {}
