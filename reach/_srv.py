"""The NATS services discovery protocol (ADR-32): ``$SRV.PING|INFO|STATS`` answers."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec

from ._codec import encode_json

if TYPE_CHECKING:
    from ._agent import Agent

_VERBS = ("PING", "INFO", "STATS")


def subjects(name: str, agent_id: str) -> list[str]:
    """The nine subjects one instance answers: all services, by name, by name and id."""
    return [
        s for v in _VERBS for s in (f"$SRV.{v}", f"$SRV.{v}.{name}", f"$SRV.{v}.{name}.{agent_id}")
    ]


class _Endpoint(msgspec.Struct, kw_only=True):
    name: str
    subject: str
    queue_group: str
    metadata: dict[str, str]


class _EndpointStats(msgspec.Struct, kw_only=True):
    name: str
    subject: str
    queue_group: str
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


def answer(subject: str, agent: Agent) -> bytes | None:
    verb = subject.split(".", 2)[1] if subject.count(".") >= 1 else ""
    meta = {"reach.tags": ",".join(agent.tags), **agent.metadata}
    common: dict[str, Any] = {
        "name": agent.name,
        "id": agent.agent_id,
        "version": agent.version,
        "metadata": meta,
    }
    subjects = agent.subjects
    if verb == "PING":
        return encode_json(_Ping(**common))
    if verb == "INFO":
        endpoints = [
            _Endpoint(
                name=c.name,
                subject=subjects.cap(c.name),
                queue_group=subjects.cap_queue(c.name),
                metadata={"version": c.version, "direct": subjects.agent(agent.agent_id, c.name)},
            )
            for c in agent.capabilities
        ]
        return encode_json(_Info(**common, description=agent.description, endpoints=endpoints))
    if verb == "STATS":
        stats = [
            _EndpointStats(
                name=info.name,
                subject=subjects.cap(info.name),
                queue_group=subjects.cap_queue(info.name),
                num_requests=requests,
                num_errors=errors,
                last_error=last_error,
                processing_time=ns,
                average_processing_time=ns // requests if requests else 0,
            )
            for info, requests, errors, ns, last_error in agent.endpoint_stats()
        ]
        started = datetime.fromtimestamp(agent.info().started_ms / 1000, UTC)
        stamp = started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        return encode_json(_Stats(**common, started=stamp, endpoints=stats))
    return None
