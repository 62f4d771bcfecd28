"""How a capability becomes an MCP tool (issue 24): the input schema is the payload schema
(an object payload is the arguments; anything else is the argument ``payload``), task tools
take ``payload`` and ``wait``, several majors route to the newest, a streaming capability
is a tool of its own kind; and the pieces of the server that need no fleet: progress that
only increases, the answer of a stream, telling connections of a change, and what of a
routing-table record counts."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import msgspec
import pytest

pytest.importorskip("mcp", reason="reach mcp needs: pip install 'agent-reach-nats[mcp]'")

from mcp.server.session import ServerSession

from reach import Client, ReachSettings
from reach._contracts.catalogue import Offer, Variant
from reach._contracts.mcp_server import (
    FleetServer,
    _chunks,
    _Peer,
    _Progress,
    record_key,
    tool_of,
)
from reach._contracts.schemas import RAW_BYTES
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, Heartbeat, Status

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
    results: tuple[dict[str, Any] | None, ...] | None = None,
    streams: bool = False,
) -> Offer:
    variants = tuple(
        Variant(
            label=v,
            version=v,
            description="does it",
            payload=payload,
            result=results[i] if results is not None else result,
            agents=("a-1",),
            streams=streams,
        )
        for i, v in enumerate(versions)
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


LINES = {"type": "object", "properties": {"lines": {"type": "integer"}}}
TOTAL = {"type": "object", "properties": {"total": {"type": "number"}}}


def test_the_output_schema_covers_every_variant_a_call_may_reach() -> None:
    """A call goes to any instance of the newest's major: one result schema for all of
    them is the output schema; object schemas that differ give the open object schema; an
    older major's (never reached) does not count."""
    same, _ = tool_of(offer(ORDER, versions=("1.2.0", "1.1.0"), results=(LINES, LINES)))
    assert same.output_schema == LINES
    differ, _ = tool_of(offer(ORDER, versions=("1.2.0", "1.1.0"), results=(LINES, TOTAL)))
    assert differ.output_schema == {"type": "object"}
    other_major, _ = tool_of(offer(ORDER, versions=("2.0.0", "1.1.0"), results=(LINES, TOTAL)))
    assert other_major.output_schema == LINES
    text, _ = tool_of(
        offer(ORDER, versions=("1.2.0", "1.1.0"), results=(LINES, {"type": "string"}))
    )
    assert text.output_schema is None
    undescribed, _ = tool_of(offer(ORDER, versions=("1.2.0", "1.1.0"), results=(LINES, None)))
    assert undescribed.output_schema is None


def test_a_streaming_capability_is_a_tool_whose_chunks_are_its_progress() -> None:
    tool, call = tool_of(offer(ORDER, LINES, streams=True))
    assert call.kind == "stream"
    assert tool.meta is not None
    assert tool.meta["reach/kind"] == "stream"
    assert tool.output_schema is None  # text or a list, as the chunks come
    assert "in chunks" in (tool.description or "")
    assert tool.input_schema == ORDER


def test_a_streamed_answer_is_one_text_when_every_chunk_is_text_else_the_list() -> None:
    words = _chunks(["Thanks ", "ada", "."])
    assert [c.text for c in words.content] == ["Thanks ada."]  # type: ignore[union-attr]
    assert words.structured_content is None
    rows = _chunks([{"n": 1}, "two", 3])
    assert rows.structured_content == {"chunks": [{"n": 1}, "two", 3]}
    first = rows.content[0]
    assert msgspec.json.decode(first.text) == [{"n": 1}, "two", 3]  # type: ignore[union-attr]


class Session:
    """What the server uses of an SDK ``ServerSession``, recorded (or failing, or hung)."""

    def __init__(self, behaviour: str = "ok") -> None:
        self.behaviour = behaviour
        self.told = 0
        self.progress: list[tuple[float, float | None, str | None]] = []

    async def send_tool_list_changed(self) -> None:
        if self.behaviour == "fail":
            raise RuntimeError("the connection is gone")
        if self.behaviour == "hang":
            await asyncio.Event().wait()
        self.told += 1

    async def report_progress(
        self, progress: float, total: float | None = None, message: str | None = None
    ) -> None:
        self.progress.append((progress, total, message))


async def test_progress_values_only_increase() -> None:
    """MCP: each progress notification's value is above the last one's. A report at the
    same value, or lower (a retry starting again from 0), is not sent."""
    session = Session()
    progress = _Progress(cast(ServerSession, session), total=1.0)
    for value, note in [(0.0, "submitted"), (0.0, "RUNNING"), (0.5, "half"), (0.25, "again")]:
        await progress(value, note)
    await progress(1.0, "done")
    assert session.progress == [(0.0, 1.0, "submitted"), (0.5, 1.0, "half"), (1.0, 1.0, "done")]


async def test_one_connection_that_fails_or_hangs_holds_no_other_from_the_notice() -> None:
    """All connections are told at once, within one bound for all: one that fails is
    forgotten, one that hangs is left behind (it hears of the next change), and the others
    hear of it. The client is not even connected: telling needs no fleet."""
    fleet = FleetServer(Client(settings=ReachSettings(nats_url="nats://127.0.0.1:4222")))
    sessions = {key: Session(key) for key in ("fail", "hang", "ok")}
    now = time.monotonic()
    fleet._peers = {
        key: _Peer(session=cast(ServerSession, s), seen=now) for key, s in sessions.items()
    }
    async with asyncio.timeout(30):  # the hang guard: the bound itself is a second
        await fleet.tools_changed()
    assert sessions["ok"].told == 1
    assert sorted(fleet._peers) == ["hang", "ok"]
    assert fleet.sessions == 2


def record(*, registered_ms: int = 5, hb: int = 0, status: Status = Status.UP) -> AgentRecord:
    odd = {"type": "object", "default": object()}  # no encoder takes it: must not be encoded
    info = AgentInfo(
        agent_id="a-1",
        name="a",
        capabilities=[CapabilityInfo(name="shop.order", payload_schema=odd)],
    )
    return AgentRecord(
        info=info,
        status=status,
        heartbeat=Heartbeat(agent_id="a-1", seq=hb, load=hb / 10),
        registered_ms=registered_ms,
        last_seen_ms=hb,
    )


def test_a_heartbeat_changes_nothing_the_tools_depend_on_and_is_not_encoded() -> None:
    """The tools depend on the info (changed only by a registration, which sets
    ``registered_ms``) and on DOWN: a heartbeat is judged without encoding the schemas."""
    assert record(hb=1) != record(hb=2)
    assert record_key(record(hb=1)) == record_key(record(hb=2))
    assert record_key(record(hb=1, status=Status.DEGRADED)) == record_key(record(hb=1))
    assert record_key(record(status=Status.DOWN)) != record_key(record())
    assert record_key(record(registered_ms=6)) != record_key(record())
