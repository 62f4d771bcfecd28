"""A handler's contract: the JSON Schemas of its payload and result, derived from its
annotations with msgspec, and its description (the docstring unless one is given).

Pure and computed once, when a capability, task or topic handler is declared; the agent
sends the result in its registration (``reach.wire.CapabilityInfo``, ``TopicInfo``).
A schema is self-contained: its named parts are in its own ``$defs``, and a top-level
object type is inlined, so ``{"type": "object", ...}`` is what a tool's input schema needs.
"""

from __future__ import annotations

import inspect
import logging
import typing
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from .._codec import encode_json
from ..wire import AgentInfo, CapabilityInfo, Registration, Status, TopicInfo

__all__ = [
    "MAX_SCHEMA_BYTES",
    "RAW_BYTES",
    "Contract",
    "capability_info",
    "contract_of",
    "described",
    "json_schema",
    "topic_info",
    "within",
    "without_schemas",
]

log = logging.getLogger("reach.agent")

#: a schema larger than this (encoded) is sent as the open schema ``{}``: registrations
#: must fit in one NATS message, with every other capability's
MAX_SCHEMA_BYTES = 32 * 1024

#: the schema of a ``bytes`` payload or result: the body as sent, not JSON
RAW_BYTES: dict[str, Any] = {
    "description": "raw bytes: the message body as sent, not JSON",
    "contentMediaType": "application/octet-stream",
}

_STREAMS = (AsyncIterator, AsyncGenerator, AsyncIterable)
_REF = "#/$defs/"


@dataclass(frozen=True, slots=True)
class Contract:
    """What one handler promises: a description and the schemas of payload and result."""

    description: str
    payload: dict[str, Any]
    result: dict[str, Any]


def contract_of(fn: Callable[..., Any], description: str | None, what: str) -> Contract:
    """``fn``'s contract; ``description`` None takes its docstring. ``fn`` has passed
    ``inspect_handler`` already, so its annotations resolve."""
    hints = typing.get_type_hints(fn)
    params = list(inspect.signature(fn).parameters.values())
    payload = hints.get(params[0].name, Any) if params else Any
    result = hints.get("return", Any)
    if inspect.isasyncgenfunction(fn):  # a streaming reply: the schema of one chunk
        args = typing.get_args(result)
        result = args[0] if typing.get_origin(result) in _STREAMS and args else Any
    return Contract(
        description=inspect.getdoc(fn) or "" if description is None else description,
        payload=_bounded(json_schema(payload), f"{what} payload"),
        result=_bounded(json_schema(result), f"{what} result"),
    )


def capability_info(
    name: str,
    version: str,
    fn: Callable[..., Any],
    description: str | None,
    what: str,
    *,
    streams: bool = False,
) -> CapabilityInfo:
    """What a registration says of a capability or task served by ``fn`` (``streams``:
    an async generator, whose result schema describes one chunk)."""
    c = contract_of(fn, description, what)
    return CapabilityInfo(
        name=name,
        version=version,
        description=c.description,
        streams=streams,
        payload_schema=c.payload,
        result_schema=c.result,
    )


def topic_info(
    pattern: str, fn: Callable[..., Any], description: str | None, *, durable: bool, ordered: bool
) -> TopicInfo:
    """What a registration says of a topic subscription served by ``fn``."""
    c = contract_of(fn, description, f"topic {pattern!r}")
    return TopicInfo(
        pattern=pattern,
        description=c.description,
        durable=durable,
        ordered=ordered,
        payload_schema=c.payload,
    )


def json_schema(type_: Any) -> dict[str, Any]:
    """A self-contained JSON Schema of ``type_``: ``{}`` (any value) for ``Any`` or a type
    msgspec cannot describe, ``RAW_BYTES`` for ``bytes``."""
    if type_ is Any:
        return {}
    if type_ is bytes:
        return dict(RAW_BYTES)
    try:
        (schema,), components = msgspec.json.schema_components(
            [type_], ref_template=_REF + "{name}"
        )
    except (TypeError, ValueError) as exc:
        log.warning("no JSON Schema for %r (%s): described as any value", type_, exc)
        return {}
    ref = schema.get("$ref")
    if isinstance(ref, str) and len(schema) == 1 and ref.startswith(_REF):
        name = ref[len(_REF) :]
        inlined = dict(components[name])
        defs = dict(components)
        if _REF + name not in msgspec.json.encode(components).decode():
            del defs[name]  # nothing refers to it: it lives only at the top
        if defs:
            inlined["$defs"] = defs
        return inlined
    if components:
        schema["$defs"] = components
    return dict(schema)


def _bounded(schema: dict[str, Any], what: str) -> dict[str, Any]:
    size = len(msgspec.json.encode(schema))
    if size <= MAX_SCHEMA_BYTES:
        return schema
    log.warning(
        "%s: its JSON Schema takes %d bytes, more than %d; sent as any value",
        what,
        size,
        MAX_SCHEMA_BYTES,
    )
    return {}


def without_schemas(info: AgentInfo) -> AgentInfo:
    """``info`` with no schema (descriptions kept)."""
    return msgspec.structs.replace(
        info,
        capabilities=[_bare(c) for c in info.capabilities],
        tasks=[_bare(c) for c in info.tasks],
        topics=[_bare(t) for t in info.topics],
    )


def within(info: AgentInfo, status: Status, budget: int) -> tuple[bytes, list[tuple[str, int]]]:
    """The registration of ``info`` in at most ``budget`` bytes if it can be: the largest
    schemas are left out first, until it fits; with what was left out (the capability,
    task or topic, and the bytes its schemas took). Still over ``budget`` when even
    without any schema it does not fit (the caller refuses it)."""
    body = encode_json(Registration(info=info, status=status))
    size = len(body)
    if size <= budget:
        return body, []
    parts: dict[str, list[Any]] = {
        "capabilities": list(info.capabilities),
        "tasks": list(info.tasks),
        "topics": list(info.topics),
    }
    savings = [
        (len(encode_json(item)) - len(encode_json(_bare(item))), kind, i)
        for kind, items in parts.items()
        for i, item in enumerate(items)
    ]
    savings.sort(key=lambda s: s[0], reverse=True)  # a stable sort: equal ones in order
    left_out: list[tuple[str, int]] = []
    for saving, kind, i in savings:
        if size <= budget or saving <= 0:
            break
        item = parts[kind][i]
        parts[kind][i] = _bare(item)
        size -= saving  # an item's encoding is a part of the whole one
        left_out.append((item.pattern if isinstance(item, TopicInfo) else item.name, saving))
    fitted = msgspec.structs.replace(info, **parts)
    return encode_json(Registration(info=fitted, status=status)), left_out


def described(info: AgentInfo) -> bool:
    """Whether ``info`` carries any schema."""
    return info != without_schemas(info)


@typing.overload
def _bare(item: CapabilityInfo) -> CapabilityInfo: ...
@typing.overload
def _bare(item: TopicInfo) -> TopicInfo: ...
def _bare(item: CapabilityInfo | TopicInfo) -> CapabilityInfo | TopicInfo:
    if isinstance(item, TopicInfo):
        return msgspec.structs.replace(item, payload_schema=None)
    return msgspec.structs.replace(item, payload_schema=None, result_schema=None)
