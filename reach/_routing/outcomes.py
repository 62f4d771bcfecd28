"""What an attempt's outcome means to the router, and the shapes it trades in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ..wire import AgentRecord, Priority

__all__ = [
    "FAILOVER",
    "INSTANCE_FAILURE",
    "LOST",
    "NOT_COUNTED",
    "UNANSWERED",
    "Choice",
    "TableView",
    "look",
]

# Outcomes that say "try another instance" (the others end the request).
#: An attempt whose answer was lost with the connection, which is back: worth another
#: attempt at once, and no fault of the instance.
LOST = "connection_lost"

FAILOVER = frozenset(
    {"no_responders", "resource_exhausted", "circuit_open", "timeout", "agent_unavailable", LOST}
)

# Outcomes that count against an instance's breaker.
INSTANCE_FAILURE = (FAILOVER - {LOST}) | {"failed"}

# Attempts that got no answer of their own: cut short by the caller or a hedge ("cancelled"),
# or lost with the connection ("error", LOST). They teach nothing: no latency, no breaker
# outcome, no affinity; only the in-flight count goes down.
UNANSWERED = frozenset({"cancelled", "error", LOST})

#: Failed attempts that say nothing about the capability's health (its breaker).
NOT_COUNTED = frozenset({"no_responders", LOST})


class TableView(Protocol):
    """What the router reads from a routing table (the client's ``RoutingTable``)."""

    @property
    def records(self) -> Mapping[str, AgentRecord]: ...

    def follows(self, capability: str) -> bool: ...

    def offers(self, capability: str) -> bool: ...

    def offering(self, capability: str) -> list[AgentRecord]: ...

    def eligible_ids(
        self, capability: str, version: str | None, tags: tuple[str, ...], priority: Priority
    ) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Choice:
    """Where an attempt goes: an instance (``agent_id``) or the queue group (None)."""

    agent_id: str | None
    #: it took its breaker's probe slot: report it back with ``finished(probe=True)``
    probe: bool = False


def look(agent_id: str, now: float) -> Choice:
    """Where an attempt would go, without taking anything (a route query)."""
    return Choice(agent_id)
