"""A handler's contract (issue 24): JSON Schemas of payload and result from its annotations,
its description from the docstring, and what a registration carries of them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from reach import Agent, Context, ReachSettings
from reach._contracts.schemas import (
    MAX_SCHEMA_BYTES,
    RAW_BYTES,
    contract_of,
    json_schema,
    within,
    without_schemas,
)
from reach._registry.checks import check_registration
from reach.wire import AgentInfo, CapabilityInfo, Registration, Status, TopicInfo


class Line(msgspec.Struct, frozen=True):
    sku: str
    qty: int = 1


class Order(msgspec.Struct, frozen=True):
    """An order to place."""

    order_id: str
    lines: list[Line]


class Tree(msgspec.Struct):
    value: int
    children: list[Tree] = []


@dataclasses.dataclass
class Quote:
    price: float


async def place(order: Order, ctx: Context) -> Quote:
    """Place an order.

    Answers with its price."""
    return Quote(1.0)


def test_a_struct_payload_is_an_inlined_object_with_its_parts_in_defs() -> None:
    c = contract_of(place, None, "capability 'order.place'")
    assert c.payload["type"] == "object"
    assert c.payload["title"] == "Order"
    assert c.payload["description"] == "An order to place."
    assert c.payload["required"] == ["order_id", "lines"]
    assert c.payload["properties"]["lines"] == {"type": "array", "items": {"$ref": "#/$defs/Line"}}
    assert set(c.payload["$defs"]) == {"Line"}  # Order itself lives at the top only
    assert c.result["title"] == "Quote"
    assert c.result["properties"] == {"price": {"type": "number"}}
    assert "$defs" not in c.result


def test_the_docstring_is_the_description_unless_one_is_given() -> None:
    assert contract_of(place, None, "x").description == "Place an order.\n\nAnswers with its price."
    assert contract_of(place, "prices orders", "x").description == "prices orders"
    assert contract_of(place, "", "x").description == ""  # said: no description


def test_a_recursive_type_keeps_itself_in_defs() -> None:
    schema = json_schema(Tree)
    assert schema["type"] == "object"
    assert schema["$defs"]["Tree"]["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (Any, {}),
        (dict, {"type": "object"}),
        (dict[str, int], {"type": "object", "additionalProperties": {"type": "integer"}}),
        (str, {"type": "string"}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (int | None, {"anyOf": [{"type": "integer"}, {"type": "null"}]}),
        (bytes, RAW_BYTES),
    ],
)
def test_schemas_of_plain_types(annotation: Any, expected: dict[str, Any]) -> None:
    assert json_schema(annotation) == expected


async def untyped(payload):  # type: ignore[no-untyped-def]
    return payload


async def returns_dict(payload: dict[str, Any]) -> dict:  # type: ignore[type-arg]
    return payload


def test_no_annotation_or_dict_gives_an_open_schema() -> None:
    bare = contract_of(untyped, None, "x")
    assert (bare.payload, bare.result, bare.description) == ({}, {}, "")
    assert contract_of(returns_dict, None, "x").result == {"type": "object"}


async def chunks(payload: str) -> AsyncIterator[Line]:
    yield Line(payload)


def test_a_streaming_handler_is_described_by_one_chunk() -> None:
    assert contract_of(chunks, None, "x").result["title"] == "Line"


def test_a_schema_msgspec_cannot_write_is_open_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Opaque:
        pass

    with caplog.at_level(logging.WARNING, logger="reach.agent"):
        assert json_schema(Opaque) == {}
    assert "described as any value" in caplog.text


def test_an_oversized_schema_is_sent_open(caplog: pytest.LogCaptureFixture) -> None:
    fields = [(f"field_{i:05d}_with_a_long_name", int) for i in range(2000)]
    Big = msgspec.defstruct("Big", fields)

    async def big(payload: Any) -> None:
        return None

    big.__annotations__ = {"payload": Big, "return": None}  # a local type, resolved

    assert len(msgspec.json.encode(json_schema(Big))) > MAX_SCHEMA_BYTES
    with caplog.at_level(logging.WARNING, logger="reach.agent"):
        c = contract_of(big, None, "capability 'big'")
    assert c.payload == {}
    assert c.result == {"type": "null"}
    assert "capability 'big' payload" in caplog.text


def agent_with_everything() -> Agent:
    agent = Agent("shop", settings=ReachSettings())
    agent.capability("order.place", version="2.1.0")(place)

    @agent.task("order.ship", description="ships an order")
    async def ship(order: Order) -> str:
        return order.order_id

    @agent.on_topic("order.*", durable=True)
    async def seen(order: Order) -> None:
        """Every order event."""

    return agent


def test_the_agent_info_carries_every_contract() -> None:
    info = agent_with_everything().info()
    (cap,) = info.capabilities
    assert (cap.name, cap.version) == ("order.place", "2.1.0")
    assert cap.description.startswith("Place an order.")
    assert cap.payload_schema is not None
    assert cap.payload_schema["title"] == "Order"
    assert cap.result_schema is not None
    assert cap.result_schema["title"] == "Quote"
    (task,) = info.tasks
    assert task.description == "ships an order"
    assert task.result_schema == {"type": "string"}
    assert info.topics == [
        TopicInfo(
            pattern="order.*",
            description="Every order event.",
            durable=True,
            ordered=False,
            payload_schema=json_schema(Order),
        )
    ]
    check_registration(Registration(info=info))  # a registry stores it


def test_the_heartbeat_carries_no_contract() -> None:
    """Schemas travel in registrations only: a heartbeat is the same size with them."""
    plain = Agent("shop", "shop-1", settings=ReachSettings())
    described = agent_with_everything()
    described.agent_id = "shop-1"
    a = msgspec.json.decode(msgspec.json.encode(plain.heartbeat(7)))
    b = msgspec.json.decode(msgspec.json.encode(described.heartbeat(7)))
    a.pop("sent_ms")
    b.pop("sent_ms")
    assert a == b


def test_without_schemas_keeps_the_descriptions() -> None:
    info = without_schemas(agent_with_everything().info())
    assert [(c.payload_schema, c.result_schema) for c in [*info.capabilities, *info.tasks]] == [
        (None, None),
        (None, None),
    ]
    assert info.capabilities[0].description.startswith("Place an order.")
    assert [(t.pattern, t.payload_schema) for t in info.topics] == [("order.*", None)]


def test_within_leaves_out_the_largest_schemas_until_the_registration_fits() -> None:
    def cap(name: str, size: int) -> CapabilityInfo:
        schema = {"description": "d" * size}
        return CapabilityInfo(name=name, payload_schema=schema, result_schema=schema)

    info = AgentInfo(
        agent_id="a-1",
        name="a",
        capabilities=[cap("small", 100), cap("large", 5000), cap("middle", 3000)],
        topics=[TopicInfo(pattern="t.*", payload_schema={"description": "t" * 8000})],
    )
    whole = len(msgspec.json.encode(Registration(info=info, status=Status.UP)))
    assert within(info, Status.UP, whole) == (msgspec.json.encode(Registration(info=info)), [])
    body, left_out = within(info, Status.UP, whole - 15_000)
    assert [name for name, _ in left_out] == ["large", "t.*"]
    assert [size for _, size in left_out] == [10_028, 8014]  # what leaving them out saved
    assert len(body) == whole - sum(size for _, size in left_out)
    sent = msgspec.json.decode(body, type=Registration).info
    assert [c.payload_schema is not None for c in sent.capabilities] == [True, False, True]
    assert sent.topics[0].payload_schema is None
    body, left_out = within(info, Status.UP, 100)  # not even without any schema
    assert len(body) > 100
    assert {name for name, _ in left_out} == {"small", "large", "middle", "t.*"}
    assert msgspec.json.decode(body, type=Registration).info == without_schemas(info)


def test_a_registry_refuses_a_bad_topic_pattern() -> None:
    info = AgentInfo(
        agent_id="a-1", name="a", topics=[TopicInfo(pattern="order.>.x", payload_schema={})]
    )
    with pytest.raises(ValueError, match="order"):
        check_registration(Registration(info=info))
