"""Agent cards from the routing table: one card per agent name, one skill per capability.

Pure: the routing table's records in, SDK ``AgentCard`` protos out. Cards are built per
request from the client's live table, so a name that leaves the table has no card at once
and nothing is cached.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import RequestHandler
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    HTTPAuthSecurityScheme,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    SecurityRequirement,
    SecurityScheme,
    StringList,
    TaskPushNotificationConfig,
)
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, TransportProtocol
from a2a.utils.errors import ExtendedAgentCardNotConfiguredError, PushNotificationNotSupportedError

from ..wire import AgentRecord, Status

__all__ = ["CALL", "MODES", "TASK", "Named", "NotOffered", "Skill", "card_of", "fleet"]

#: how a skill runs: a request/reply call (``@agent.capability``) or a durable task
#: (``@agent.task``)
CALL, TASK = "call", "task"
MODES = (CALL, TASK)
_HOW = {CALL: "a request/reply call", TASK: "a durable task"}
_IO_MODES = ["application/json", "text/plain"]


@dataclass(slots=True)
class Skill:
    """One capability as the instances of a name offer it."""

    capability: str
    modes: set[str] = field(default_factory=set)
    versions: set[str] = field(default_factory=set)
    tags: set[str] = field(default_factory=set)
    description: str = ""
    #: its calls answer with a stream of chunks (an instance registered it so)
    streams: bool = False

    def to_proto(self) -> AgentSkill:
        how = " or ".join(_HOW[m] for m in MODES if m in self.modes)
        if self.streams:
            how += ", answered in chunks (artifact updates when streamed)"
        extra = [f"mode:{m}" for m in MODES if m in self.modes]
        extra += ["streaming"] if self.streams else []
        extra += [f"version:{v}" for v in sorted(self.versions)]
        return AgentSkill(
            id=self.capability,
            name=self.capability,
            description=self.description or f"Reach capability {self.capability}, run as {how}.",
            tags=sorted(self.tags) + extra,
            input_modes=_IO_MODES,
            output_modes=_IO_MODES,
        )


@dataclass(slots=True)
class Named:
    """What the routing table knows of one agent name."""

    name: str
    version: str = ""
    description: str = ""
    instances: int = 0
    skills: dict[str, Skill] = field(default_factory=dict)


def fleet(records: Iterable[AgentRecord]) -> dict[str, Named]:
    """Every agent name with an instance that is not DOWN, and its skills. The newest
    registration gives the name's version and description (metadata ``description``)."""
    names: dict[str, Named] = {}
    for rec in sorted(records, key=lambda r: r.registered_ms):
        if rec.status is Status.DOWN:
            continue
        info = rec.info
        named = names.setdefault(info.name, Named(info.name))
        named.version = info.version
        named.description = info.metadata.get("description", "") or named.description
        named.instances += 1
        for mode, caps in ((CALL, info.capabilities), (TASK, info.tasks)):
            for cap in caps:
                skill = named.skills.setdefault(cap.name, Skill(cap.name))
                skill.modes.add(mode)
                skill.versions.add(cap.version)
                skill.tags.update(info.tags)
                skill.description = cap.description or skill.description
                skill.streams = skill.streams or (mode == CALL and cap.streams)
    return names


def card_of(named: Named, url: str, *, bearer: bool = False) -> AgentCard:
    """The A2A card of a name whose JSON-RPC endpoint is ``url`` (A2A 1.0, and 0.3 on the
    same endpoint for older clients); streaming on, push notifications off. ``bearer``:
    the card says a bearer token is required."""
    card = AgentCard(
        name=named.name,
        description=named.description or f"Agent-Reach agent {named.name!r}.",
        version=named.version or "0.0.0",
        supported_interfaces=[
            AgentInterface(
                url=url,
                protocol_binding=TransportProtocol.JSONRPC.value,
                protocol_version=PROTOCOL_VERSION_1_0,
            ),
            AgentInterface(
                url=url,
                protocol_binding=TransportProtocol.JSONRPC.value,
                protocol_version=PROTOCOL_VERSION_0_3,
            ),
        ],
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=_IO_MODES,
        default_output_modes=_IO_MODES,
        skills=[named.skills[c].to_proto() for c in sorted(named.skills)],
    )
    if bearer:
        card.security_schemes["bearer"].CopyFrom(
            SecurityScheme(http_auth_security_scheme=HTTPAuthSecurityScheme(scheme="Bearer"))
        )
        card.security_requirements.append(
            SecurityRequirement(schemes={"bearer": StringList(list=[])})
        )
    return card


class NotOffered(RequestHandler):
    """The A2A methods the gateway does not offer: push notifications (a Reach task's
    ``callback`` is the way to be told) and the extended card."""

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        raise ExtendedAgentCardNotConfiguredError
