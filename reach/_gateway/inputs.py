"""Checking what an HTTP request asks for, before anything reaches NATS: pure functions
raising ``EdgeError`` 400 with a sentence naming the field.

A call's options come from the query string or from ``X-Reach-*`` headers (the query
wins when both are given), so plain ``curl`` and proxies that add headers both work.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .._routing import Policy
from .._subjects import MAX_NAME, validate_agent_id, validate_capability
from ..wire import Priority
from .errors import EdgeError

__all__ = [
    "MAX_TAGS",
    "CallOptions",
    "as_value_error",
    "call_options",
    "check_body",
    "check_capability",
    "check_tags",
    "check_task_id",
    "check_timeout",
    "check_version",
    "is_task_id",
]

MAX_TAGS = 64
MAX_AFFINITY_KEY = 256
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,31}")
_TASK_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PRIORITIES = ", ".join(p.value for p in Priority)
_POLICIES = ", ".join(p.value for p in Policy)

#: option -> its header; the query parameter has the option's own name
HEADERS = {
    "timeout": "x-reach-timeout",
    "priority": "x-reach-priority",
    "agent_id": "x-reach-agent",
    "tags": "x-reach-tags",
    "version": "x-reach-version",
    "routing": "x-reach-routing",
    "affinity_key": "x-reach-affinity-key",
}


T = TypeVar("T")
R = TypeVar("R")


def as_value_error(check: Callable[[T], R], value: T) -> R:
    """For pydantic validators: only a ValueError becomes a field's error (422, located)."""
    try:
        return check(value)
    except EdgeError as exc:
        raise ValueError(exc.message) from None


def bad(message: str) -> EdgeError:
    return EdgeError(400, "bad_request", message)


@dataclass(frozen=True, slots=True)
class CallOptions:
    timeout: float | None = None
    priority: Priority = Priority.NORMAL
    agent_id: str | None = None
    tags: tuple[str, ...] = ()
    version: str | None = None
    routing: Policy | None = None
    affinity_key: str | None = None

    def routed(self) -> dict[str, Any]:
        """The arguments of ``Client.call`` or ``Client.stream`` that choose who answers,
        and how urgently (``timeout`` apart: the gateway's default fills it)."""
        return {
            "priority": self.priority,
            "agent_id": self.agent_id,
            "version": self.version,
            "required_tags": self.tags,
            "routing": self.routing,
            "affinity_key": self.affinity_key,
        }


_OCTETS = "application/octet-stream"
_validate = msgspec.json.Decoder()  # for checking: the decoded value is thrown away


def check_body(body: bytes, content_type: str) -> None:
    """A call's body is JSON, unless it is sent as raw bytes (octet-stream)."""
    if body and not content_type.startswith(_OCTETS):
        try:
            _validate.decode(body)
        except msgspec.DecodeError as exc:
            raise bad(
                f"the body is not JSON ({exc}); send application/octet-stream for raw bytes"
            ) from None


def check_capability(name: str) -> str:
    try:
        return validate_capability(name)
    except ValueError as exc:
        raise bad(str(exc)) from None


def check_timeout(value: float, limit: float, what: str = "timeout") -> float:
    if not math.isfinite(value) or value <= 0:
        raise bad(f"{what} must be a positive number of seconds")
    if value > limit:
        raise bad(f"{what} {value:g}s is above the gateway's limit of {limit:g}s")
    return value


def check_tags(tags: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    if len(tags) > MAX_TAGS:
        raise bad(f"{len(tags)} tags; at most {MAX_TAGS}")
    for tag in tags:
        if not tag or len(tag) > MAX_NAME or not tag.isprintable():
            raise bad(f"tag {tag[:40]!r} must be 1-{MAX_NAME} printable characters")
        if "," in tag or any(c.isspace() for c in tag):
            raise bad(f"tag {tag[:40]!r} contains a comma or a space")
    return tuple(tags)


def check_version(version: str) -> str:
    if not _VERSION.fullmatch(version):
        raise bad(f"version {version[:40]!r} is invalid; use e.g. '1' or '1.2'")
    return version


def is_task_id(task_id: str) -> bool:
    """What a task id looks like (the client's ids are NUIDs; replays keep theirs)."""
    return _TASK_ID.fullmatch(task_id) is not None


def check_task_id(task_id: str) -> str:
    if not is_task_id(task_id):
        raise bad(f"task id {task_id[:40]!r} is invalid: 1-128 letters, digits, '-' or '_'")
    return task_id


def check_priority(value: str) -> Priority:
    try:
        return Priority(value)
    except ValueError:
        raise bad(f"priority {value[:20]!r} is not one of {_PRIORITIES}") from None


def call_options(
    query: Mapping[str, str], headers: Mapping[str, str], max_timeout: float
) -> CallOptions:
    """The options of ``POST /v1/capabilities/{cap}`` from its query and headers."""

    def get(name: str) -> str | None:
        value = query.get(name)
        return value if value is not None else headers.get(HEADERS[name])

    timeout: float | None = None
    raw = get("timeout")
    if raw is not None:
        try:
            timeout = float(raw)
        except ValueError:
            raise bad(f"timeout {raw[:20]!r} is not a number of seconds") from None
        check_timeout(timeout, max_timeout)
    raw = get("priority")
    priority = check_priority(raw) if raw is not None else Priority.NORMAL
    agent_id = get("agent_id") or None
    if agent_id is not None:
        try:
            validate_agent_id(agent_id)
        except ValueError as exc:
            raise bad(str(exc)) from None
    raw = get("tags")
    tags = check_tags([t.strip() for t in raw.split(",") if t.strip()]) if raw else ()
    version = get("version") or None
    if version is not None:
        check_version(version)
    routing: Policy | None = None
    raw = get("routing")
    if raw:
        try:
            routing = Policy(raw)
        except ValueError:
            raise bad(f"routing {raw[:20]!r} is not one of {_POLICIES}") from None
        if routing is Policy.DIRECT and agent_id is None:
            raise bad("routing 'direct' needs agent_id (the instance to call)")
    affinity_key = get("affinity_key") or None
    if affinity_key is not None and (
        len(affinity_key) > MAX_AFFINITY_KEY or not affinity_key.isprintable()
    ):
        raise bad(f"affinity_key must be 1-{MAX_AFFINITY_KEY} printable characters")
    return CallOptions(timeout, priority, agent_id, tags, version, routing, affinity_key)


class Selection(BaseModel):
    """A body naming a capability and which instances may take it: the capability, version
    and tags are checked as the call route checks them, before anything reaches NATS."""

    model_config = ConfigDict(extra="forbid")

    capability: str
    version: str | None = None
    tags: list[str] = Field(default_factory=list, description="required tags (all of them)")

    @field_validator("capability")
    @classmethod
    def _capability(cls, value: str) -> str:
        return as_value_error(check_capability, value)

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        return list(as_value_error(check_tags, value))

    @field_validator("version")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        return None if value is None else as_value_error(check_version, value)
