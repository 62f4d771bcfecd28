"""The NATS services discovery protocol (ADR-32): ``$SRV.PING|INFO|STATS`` answers,
built from a snapshot of the agent (so this module knows nothing of the Agent)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec

from .._codec import encode_json
from .._subjects import Subjects
from ..wire import AgentInfo
from .model import Served

__all__ = ["Endpoint", "ServiceSnapshot", "answer", "snapshot", "subjects"]

_VERBS = ("PING", "INFO", "STATS")


def subjects(name: str, agent_id: str) -> list[str]:
    """The nine subjects one instance answers: all services, by name, by name and id."""
    return [
        s for v in _VERBS for s in (f"$SRV.{v}", f"$SRV.{v}.{name}", f"$SRV.{v}.{name}.{agent_id}")
    ]


class _EndpointBase(msgspec.Struct, kw_only=True):
    """What INFO and STATS both say of an endpoint (``_where``)."""

    name: str
    subject: str
    queue_group: str


class _Endpoint(_EndpointBase, kw_only=True):
    metadata: dict[str, str]


class _EndpointStats(_EndpointBase, kw_only=True):
    num_requests: int
    num_errors: int
    last_error: str
    processing_time: int
    average_processing_time: int
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class _Ping(msgspec.Struct, kw_only=True):
    type: str = "io.nats.micro.v1.ping_response"
    name: str
    id: str
    version: str
    metadata: dict[str, str]


class _Info(_Ping, kw_only=True):
    type: str = "io.nats.micro.v1.info_response"
    description: str
    endpoints: list[_Endpoint]


class _Stats(_Ping, kw_only=True):
    type: str = "io.nats.micro.v1.stats_response"
    started: str
    endpoints: list[_EndpointStats]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One capability as a $SRV endpoint, with its counters."""

    name: str
    version: str
    subject: str
    queue_group: str
    direct: str
    requests: int
    errors: int
    processing_ns: int
    last_error: str


@dataclass(frozen=True, slots=True)
class ServiceSnapshot:
    """What $SRV answers need to know about one agent instance, taken when asked."""

    name: str
    agent_id: str
    version: str
    description: str
    metadata: dict[str, str]
    started_ms: int
    endpoints: list[Endpoint]


def snapshot(
    info: AgentInfo, description: str, subjects: Subjects, caps: dict[str, Served]
) -> ServiceSnapshot:
    return ServiceSnapshot(
        name=info.name,
        agent_id=info.agent_id,
        version=info.version,
        description=description,
        metadata={"reach.tags": ",".join(info.tags), **info.metadata},
        started_ms=info.started_ms,
        endpoints=[
            Endpoint(
                name=name,
                version=c.info.version,
                subject=subjects.cap(name),
                queue_group=subjects.cap_queue(name),
                direct=subjects.agent(info.agent_id, name),
                requests=c.requests,
                errors=c.errors,
                processing_ns=c.processing_ns,
                last_error=c.last_error,
            )
            for name, c in caps.items()
        ],
    )


def answer(subject: str, snap: ServiceSnapshot) -> bytes | None:
    verb = subject.split(".", 2)[1] if subject.count(".") >= 1 else ""
    common: dict[str, Any] = {
        "name": snap.name,
        "id": snap.agent_id,
        "version": snap.version,
        "metadata": snap.metadata,
    }
    if verb == "PING":
        return encode_json(_Ping(**common))
    if verb == "INFO":
        endpoints = [
            _Endpoint(**_where(e), metadata={"version": e.version, "direct": e.direct})
            for e in snap.endpoints
        ]
        return encode_json(_Info(**common, description=snap.description, endpoints=endpoints))
    if verb == "STATS":
        stats = [
            _EndpointStats(
                **_where(e),
                num_requests=e.requests,
                num_errors=e.errors,
                last_error=e.last_error,
                processing_time=e.processing_ns,
                average_processing_time=e.processing_ns // e.requests if e.requests else 0,
            )
            for e in snap.endpoints
        ]
        started = datetime.fromtimestamp(snap.started_ms / 1000, UTC)
        stamp = started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        return encode_json(_Stats(**common, started=stamp, endpoints=stats))
    return None


def _where(e: Endpoint) -> dict[str, Any]:
    """An endpoint's name and subjects, as INFO and STATS both give them."""
    return {"name": e.name, "subject": e.subject, "queue_group": e.queue_group}
