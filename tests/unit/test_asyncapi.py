"""The fleet's catalogue and its AsyncAPI 3.0 document (issue 24), from records alone:
versions, selection, and schemas hoisted so that every reference resolves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from reach import Agent, ReachSettings
from reach._contracts.asyncapi import asyncapi_document, fleet_document
from reach._contracts.catalogue import catalogue, version_key
from reach._subjects import Subjects
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Header, Status

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
    assert catalogue(records, names=["img.*"]).agents == ("a-1",)  # only who serves it
    assert catalogue(records, names=["nomatch.*"]).agents == ()
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


def resolved(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its local ``$ref``s followed until it is a schema of its own."""
    while "$ref" in node:
        path = node["$ref"].removeprefix("#/").split("/")
        node = doc
        for part in path:
            node = node[part]
    return node


def nested(y: dict[str, Any]) -> dict[str, Any]:
    """An object whose ``x`` is ``X``, whose ``y`` is ``Y``: named parts in its ``$defs``."""
    return {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/X"}},
        "$defs": {
            "X": {"type": "object", "properties": {"y": {"$ref": "#/$defs/Y"}}},
            "Y": y,
        },
    }


def y_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    payload = doc["components"]["messages"][f"cap.{name}.1.0.request"]["payload"]
    x = resolved(doc, resolved(doc, payload)["properties"]["x"])
    return resolved(doc, x["properties"]["y"])


def test_parts_named_alike_keep_their_own_parts_down_to_the_last_reference() -> None:
    """``X`` looks the same in both, but its ``Y`` does not: each ``X`` must reach its own."""
    records = [
        record("a-1", cap("1.0", nested({"type": "string"}), "a.one")),
        record("a-2", cap("1.0", nested({"type": "integer"}), "a.two")),
    ]
    doc = asyncapi_document(catalogue(records), subjects=Subjects("reach"))
    assert validation_errors(doc) == []
    assert unresolved_refs(doc) == []
    assert y_of(doc, "a.one") == {"type": "string"}
    assert y_of(doc, "a.two") == {"type": "integer"}
    schemas = doc["components"]["schemas"]
    assert schemas["X"]["properties"]["y"] == {"$ref": "#/components/schemas/Y"}
    assert schemas["X-2"]["properties"]["y"] == {"$ref": "#/components/schemas/Y-2"}


def test_parts_that_are_the_same_all_the_way_down_are_written_once() -> None:
    records = [
        record("a-1", cap("1.0", nested({"type": "string"}), "a.one")),
        record("a-2", cap("1.0", nested({"type": "string"}), "a.two")),
    ]
    doc = asyncapi_document(catalogue(records), subjects=Subjects("reach"))
    assert unresolved_refs(doc) == []
    assert y_of(doc, "a.one") == y_of(doc, "a.two") == {"type": "string"}
    assert {"X", "Y"} <= set(doc["components"]["schemas"])
    assert not {"X-2", "Y-2"} & set(doc["components"]["schemas"])


def test_parts_that_refer_to_each_other_in_a_cycle_stay_apart_when_one_differs() -> None:
    """``A`` refers to ``B`` and ``B`` to ``A``; only ``B``'s ``v`` differs."""

    def cycle(v: str) -> dict[str, Any]:
        return {
            "$ref": "#/$defs/A",
            "$defs": {
                "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}},
                "B": {
                    "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/A"}, "v": {"type": v}},
                },
            },
        }

    records = [
        record("a-1", cap("1.0", cycle("string"), "a.one")),
        record("a-2", cap("1.0", cycle("integer"), "a.two")),
        record("a-3", cap("1.0", cycle("string"), "a.three")),
    ]
    doc = asyncapi_document(catalogue(records), subjects=Subjects("reach"))
    assert validation_errors(doc) == []
    assert unresolved_refs(doc) == []
    messages = doc["components"]["messages"]
    for name, v in (("a.one", "string"), ("a.two", "integer"), ("a.three", "string")):
        a = resolved(doc, resolved(doc, messages[f"cap.{name}.1.0.request"]["payload"]))
        b = resolved(doc, a["properties"]["b"])
        assert b["properties"]["v"] == {"type": v}
        again = resolved(doc, resolved(doc, b["properties"]["a"])["properties"]["b"])
        assert again["properties"]["v"] == {"type": v}
    assert {"A", "B", "A-2", "B-2"} <= set(doc["components"]["schemas"])
    assert "A-3" not in doc["components"]["schemas"]


def test_a_capability_that_streams_is_described_as_a_stream_of_frames() -> None:
    """PROTOCOL.md 3.3: the request needs ``Reach-Stream-Window``; the answer is the opened
    frame, the chunks (the result schema is one chunk's), then the end or an error frame;
    the caller speaks to the stream's subject. A capability that does not stream is as
    before."""
    agent = Agent("llm", settings=ReachSettings())

    @agent.capability("llm.complete")
    async def complete(prompt: str) -> AsyncIterator[int]:
        yield len(prompt)

    @agent.capability("llm.count")
    async def count(prompt: str) -> int:
        return len(prompt)

    cat = catalogue([AgentRecord(info=agent.info(), status=Status.UP)])
    doc = asyncapi_document(cat, subjects=Subjects("acme"))
    assert validation_errors(doc) == []
    assert unresolved_refs(doc) == []
    messages, ops, channels = doc["components"]["messages"], doc["operations"], doc["channels"]

    def headers(message: dict[str, Any]) -> dict[str, Any]:
        message = resolved(doc, message)
        if "headers" in message:
            return dict(message["headers"])
        (trait,) = message["traits"]
        return dict(resolved(doc, trait)["headers"])

    request = headers(messages["cap.llm.complete.1.0.0.request"])
    assert request["required"] == [Header.STREAM_WINDOW]
    assert {Header.STREAM_WINDOW, Header.STREAM_PATIENCE, Header.DEADLINE} <= set(
        request["properties"]
    )
    assert ops["cap.llm.complete"]["x-reach-streams"] is True
    assert ops["agent.llm.complete"]["x-reach-streams"] is True
    replies = channels["cap.llm.complete.reply"]["messages"]
    assert list(replies) == ["error", "opened", "1.0.0.chunk", "end"]
    chunk = resolved(doc, replies["1.0.0.chunk"])
    assert resolved(doc, chunk["payload"]) == {"type": "integer"}
    assert headers(chunk)["required"] == [Header.CHUNK]
    assert headers(replies["opened"])["properties"][Header.CHUNK]["const"] == "0"
    assert headers(replies["end"])["required"] == [Header.END]
    error = headers(replies["error"])
    assert error["required"] == [Header.SERVICE_ERROR_CODE]
    assert Header.END in error["properties"]
    assert [m["$ref"].rsplit("/", 1)[1] for m in ops["cap.llm.complete"]["reply"]["messages"]] == [
        "error",
        "opened",
        "1.0.0.chunk",
        "end",
    ]
    stream = channels["stream"]
    assert stream["address"] == "acme.agent.{agent_id}.$stream.{stream_id}"
    assert set(stream["parameters"]) == {"agent_id", "stream_id"}
    control = [resolved(doc, resolved(doc, m)["payload"]) for m in stream["messages"].values()]
    kinds = {body["properties"]["type"]["enum"][0] for body in control}
    assert kinds == {"reach.stream.credit", "reach.stream.cancel"}
    assert ops["stream"]["action"] == "receive"

    # a capability that does not stream: one reply, no stream header
    assert "x-reach-streams" not in ops["cap.llm.count"]
    assert "required" not in headers(messages["cap.llm.count.1.0.0.request"])
    assert list(channels["cap.llm.count.reply"]["messages"]) == ["error", "1.0.0.reply"]
    assert (
        Header.END
        not in headers(channels["cap.llm.count.reply"]["messages"]["error"])["properties"]
    )


def test_a_fleet_without_streams_has_no_stream_channel() -> None:
    doc = asyncapi_document(
        catalogue([record("a-1", cap("1.0", None))]), subjects=Subjects("reach")
    )
    assert "stream" not in doc["channels"]
    assert "streamRequest" not in doc["components"]["messageTraits"]


def test_instances_that_stream_and_instances_that_do_not_are_two_versions() -> None:
    """Mid-rollout, one name and version served both ways: each version says how it
    answers."""
    streaming = msgspec.structs.replace(cap("1.0", {"type": "string"}), streams=True)
    records = [record("a-1", cap("1.0", {"type": "string"})), record("a-2", streaming)]
    (offer,) = catalogue(records).capabilities
    assert [(v.label, v.streams, v.agents) for v in offer.variants] == [
        ("1.0", False, ("a-1",)),
        ("1.0-2", True, ("a-2",)),
    ]
    doc = asyncapi_document(catalogue(records), subjects=Subjects("reach"))
    assert validation_errors(doc) == []
    assert unresolved_refs(doc) == []
    messages = doc["components"]["messages"]
    assert "x-reach-streams" not in messages["cap.text.translate.1.0.request"]
    assert messages["cap.text.translate.1.0-2.request"]["x-reach-streams"] is True
    assert list(doc["channels"]["cap.text.translate.reply"]["messages"]) == [
        "error",
        "opened",
        "1.0.reply",
        "1.0-2.chunk",
        "end",
    ]
