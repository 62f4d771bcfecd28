"""The fleet's contract, read from routing-table records: pure and synchronous.

Every live instance (any status but DOWN) says what it serves; the catalogue groups that by
name: capabilities served by request, durable task capabilities, and topic patterns. The
instances of one name that describe it differently (another version, other schemas, a
stream or not) make the variants of that name, newest version first, so documents show
them as versions.
``names`` (globs) and ``tags`` choose what is exposed: an instance counts only if it
carries every tag asked for.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any, Literal

from .._codec import canonical
from ..wire import AgentRecord, CapabilityInfo, Status, TopicInfo

__all__ = ["Catalogue", "Kind", "Offer", "Variant", "catalogue", "chosen", "version_key"]

Kind = Literal["request", "task", "topic"]

_NUMBERS = re.compile(r"\d+")


@dataclass(frozen=True, slots=True)
class Variant:
    """One way a name is served: its version and schemas, and the instances serving it."""

    label: str  # unique within its offer: the version, "-2", "-3"... when schemas differ
    version: str
    description: str
    payload: dict[str, Any] | None  # None: not described (an older agent)
    result: dict[str, Any] | None  # None for topics
    agents: tuple[str, ...]  # agent ids, sorted
    streams: bool = False  # capabilities only: answers with a stream of chunks
    durable: bool = False  # topics only
    ordered: bool = False


@dataclass(frozen=True, slots=True)
class Offer:
    """A capability, task capability or topic pattern, as the fleet serves it now."""

    kind: Kind
    name: str
    variants: tuple[Variant, ...]  # newest version first

    @property
    def newest(self) -> Variant:
        return self.variants[0]

    @property
    def description(self) -> str:
        return next((v.description for v in self.variants if v.description), "")

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(sorted({a for v in self.variants for a in v.agents}))


@dataclass(frozen=True, slots=True)
class Catalogue:
    capabilities: tuple[Offer, ...] = ()
    tasks: tuple[Offer, ...] = ()
    topics: tuple[Offer, ...] = ()
    agents: tuple[str, ...] = ()  # ids of the instances serving what it holds

    def offers(self) -> tuple[Offer, ...]:
        return self.capabilities + self.tasks + self.topics


def version_key(version: str) -> tuple[int, ...]:
    """``"1.10.2"`` sorts after ``"1.9"``: the numbers in it, in order."""
    return tuple(int(n) for n in _NUMBERS.findall(version))


def chosen(name: str, names: Sequence[str]) -> bool:
    """Whether ``names`` (globs; none: every name) take ``name``."""
    return not names or any(fnmatchcase(name, g) for g in names)


def catalogue(
    records: Iterable[AgentRecord], *, names: Sequence[str] = (), tags: Sequence[str] = ()
) -> Catalogue:
    """What ``records`` serve, by name; only names matching one of ``names`` (globs; none:
    every name) and instances with every tag in ``tags``."""
    live = sorted(
        (r for r in records if r.status is not Status.DOWN and all(t in r.info.tags for t in tags)),
        key=lambda r: r.info.agent_id,
    )

    caps: dict[str, dict[bytes, list[tuple[CapabilityInfo, str]]]] = {}
    tasks: dict[str, dict[bytes, list[tuple[CapabilityInfo, str]]]] = {}
    topics: dict[str, dict[bytes, list[tuple[TopicInfo, str]]]] = {}
    for r in live:
        agent_id = r.info.agent_id
        for into, infos in ((caps, r.info.capabilities), (tasks, r.info.tasks)):
            for c in infos:
                if chosen(c.name, names):
                    key = canonical((c.version, c.streams, c.payload_schema, c.result_schema))
                    into.setdefault(c.name, {}).setdefault(key, []).append((c, agent_id))
        for t in r.info.topics:
            if chosen(t.pattern, names):
                key = canonical((t.payload_schema, t.durable, t.ordered))
                topics.setdefault(t.pattern, {}).setdefault(key, []).append((t, agent_id))
    cat = Catalogue(
        capabilities=tuple(_offer("request", n, g) for n, g in sorted(caps.items())),
        tasks=tuple(_offer("task", n, g) for n, g in sorted(tasks.items())),
        topics=tuple(_topic(p, g) for p, g in sorted(topics.items())),
    )
    return replace(cat, agents=tuple(sorted({a for o in cat.offers() for a in o.agents})))


def _offer(kind: Kind, name: str, groups: dict[bytes, list[tuple[CapabilityInfo, str]]]) -> Offer:
    variants = [
        Variant(
            label="",
            version=members[0][0].version,
            description=next((c.description for c, _ in members if c.description), ""),
            payload=members[0][0].payload_schema,
            result=members[0][0].result_schema,
            agents=tuple(a for _, a in members),
            streams=members[0][0].streams,
        )
        for members in groups.values()
    ]
    # newest first; within a version, the variant most instances serve, then by first id
    variants.sort(key=lambda v: (_desc(version_key(v.version)), v.version, -len(v.agents)))
    return Offer(kind, name, _labelled(variants))


def _topic(pattern: str, groups: dict[bytes, list[tuple[TopicInfo, str]]]) -> Offer:
    variants = [
        Variant(
            label="",
            version="",
            description=next((t.description for t, _ in members if t.description), ""),
            payload=members[0][0].payload_schema,
            result=None,
            agents=tuple(a for _, a in members),
            durable=members[0][0].durable,
            ordered=members[0][0].ordered,
        )
        for members in groups.values()
    ]
    variants.sort(key=lambda v: (-len(v.agents), v.agents))
    return Offer("topic", pattern, _labelled(variants))


def _desc(key: tuple[int, ...]) -> tuple[int, ...]:
    return (*(-n for n in key), 1)  # the 1: "1.0" after "1.0.1", newest first


def _labelled(variants: list[Variant]) -> tuple[Variant, ...]:
    seen: dict[str, int] = {}
    out = []
    for v in variants:
        base = v.version or "default"
        seen[base] = seen.get(base, 0) + 1
        label = base if seen[base] == 1 else f"{base}-{seen[base]}"
        out.append(replace(v, label=label))
    return tuple(out)
