"""How a capability becomes an MCP tool (issue 24): the input schema is the payload schema
(an object payload is the arguments; anything else is the argument ``payload``), task tools
take ``payload`` and ``wait``, and several majors route to the newest."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("mcp", reason="reach mcp needs: pip install 'agent-reach-nats[mcp]'")

from reach._contracts.catalogue import Offer, Variant
from reach._contracts.mcp_server import tool_of
from reach._contracts.schemas import RAW_BYTES

ORDER = {
    "title": "Order",
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"$ref": "#/$defs/Line"}}},
    "required": ["lines"],
    "$defs": {"Line": {"type": "object", "properties": {"sku": {"type": "string"}}}},
}


def offer(
    payload: dict[str, Any] | None,
    result: dict[str, Any] | None = None,
    *,
    kind: str = "request",
    versions: tuple[str, ...] = ("1.0.0",),
) -> Offer:
    variants = tuple(
        Variant(
            label=v,
            version=v,
            description="does it",
            payload=payload,
            result=result,
            agents=("a-1",),
        )
        for v in versions
    )
    return Offer(kind, "shop.order", variants)  # type: ignore[arg-type]


def test_an_object_payload_is_the_input_schema_and_the_arguments_are_the_payload() -> None:
    tool, call = tool_of(offer(ORDER, {"type": "object"}))
    assert tool.input_schema == ORDER
    assert tool.output_schema == {"type": "object"}
    assert tool.description == "does it"
    assert call.payload({"lines": []}) == {"lines": []}
    assert call.version is None


def test_any_other_payload_is_the_argument_payload_with_its_defs_at_the_root() -> None:
    listed = {"type": "array", "items": {"$ref": "#/$defs/Line"}, "$defs": ORDER["$defs"]}
    tool, call = tool_of(offer(listed, {"type": "string"}))
    assert tool.input_schema == {
        "type": "object",
        "properties": {"payload": {"type": "array", "items": {"$ref": "#/$defs/Line"}}},
        "required": ["payload"],
        "$defs": ORDER["$defs"],
    }
    assert tool.output_schema is None  # not an object: the answer is text
    assert call.payload({"payload": [1]}) == [1]


def test_raw_and_undescribed_payloads() -> None:
    raw, call = tool_of(offer(dict(RAW_BYTES)))
    assert raw.input_schema["properties"]["payload"]["type"] == "string"
    assert call.payload({"payload": "héllo"}) == "héllo".encode()
    old, call = tool_of(offer(None))  # an older agent describes nothing
    assert "required" not in old.input_schema
    assert call.payload({}) is None


def test_a_task_tool_takes_payload_and_wait() -> None:
    tool, call = tool_of(offer(ORDER, kind="task"))
    assert set(tool.input_schema["properties"]) == {"payload", "wait"}
    assert tool.input_schema["required"] == ["payload"]
    assert tool.input_schema["$defs"] == ORDER["$defs"]
    assert "durable task" in (tool.description or "")
    assert call.kind == "task"


def test_several_majors_route_to_the_newest_and_are_named() -> None:
    tool, call = tool_of(offer(ORDER, versions=("2.1.0", "1.4.0")))
    assert call.version == "2.1.0"
    assert "also served: 1.4.0" in (tool.description or "")
    _, same_major = tool_of(offer(ORDER, versions=("1.5.0", "1.4.0")))
    assert same_major.version is None
