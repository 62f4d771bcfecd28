"""Subject names, built and validated in one place so nothing malformed is ever sent."""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_NAME = 128
_TOKEN = re.compile(r"[a-z0-9_-]+")
_ID = re.compile(r"[A-Za-z0-9_-]+")
_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def _check_tokens(kind: str, name: str, *, wildcards: bool) -> None:
    if not isinstance(name, str):
        raise ValueError(f"{kind} must be a string, got {type(name).__name__}")
    if not name:
        raise ValueError(f"{kind} is empty")
    if len(name) > MAX_NAME:
        raise ValueError(f"{kind} {name[:40]!r}... is {len(name)} characters; at most {MAX_NAME}")
    tokens = name.split(".")
    for i, token in enumerate(tokens):
        if not token:
            raise ValueError(f"{kind} {name!r} has an empty token")
        if token in ("*", ">"):
            if not wildcards:
                raise ValueError(f"{kind} {name!r} contains wildcard {token!r}")
            if token == ">" and i != len(tokens) - 1:
                raise ValueError(f"{kind} {name!r}: '>' must be the last token")
            continue
        if not _TOKEN.fullmatch(token):
            bad = next(c for c in token if not _TOKEN.fullmatch(c))
            what = "a space" if bad.isspace() else f"{bad!r}"
            raise ValueError(
                f"{kind} {name!r} contains {what}; use lowercase tokens [a-z0-9_-] joined by dots"
            )


def validate_capability(name: str) -> str:
    """Return ``name`` if it is a valid capability name, else raise ValueError saying why."""
    _check_tokens("capability", name, wildcards=False)
    return name


def validate_topic(name: str, *, wildcards: bool = False) -> str:
    """Validate a topic; subscriptions may pass ``wildcards=True`` to allow ``*`` and ``>``."""
    _check_tokens("topic", name, wildcards=wildcards)
    return name


def validate_agent_id(agent_id: str) -> str:
    """An agent id is one subject token and a KV key: letters, digits, '-' and '_'."""
    if not isinstance(agent_id, str) or not _ID.fullmatch(agent_id) or len(agent_id) > MAX_NAME:
        raise ValueError(
            f"agent_id {agent_id!r} is invalid; use 1-{MAX_NAME} letters, digits, '-' or '_'"
        )
    return agent_id


def validate_prefix(prefix: str) -> str:
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"subject prefix {prefix!r} is invalid; use dot-joined [A-Za-z0-9_-] tokens"
        )
    return prefix


@dataclass(frozen=True, slots=True)
class Subjects:
    """Every subject of the protocol under one prefix (``reach`` unless multi-tenant)."""

    prefix: str = "reach"

    def __post_init__(self) -> None:
        validate_prefix(self.prefix)

    def cap(self, capability: str) -> str:
        return f"{self.prefix}.cap.{capability}"

    @staticmethod
    def cap_queue(capability: str) -> str:
        return f"cap.{capability}"

    def agent(self, agent_id: str, capability: str) -> str:
        return f"{self.prefix}.agent.{agent_id}.{capability}"

    def ping(self, agent_id: str) -> str:
        return f"{self.prefix}.agent.{agent_id}.$ping"

    def ctl(self, agent_id: str) -> str:
        return f"{self.prefix}.agent.{agent_id}.$ctl"

    def streams(self, agent_id: str) -> str:
        """Where an agent hears the callers of its streams (credit, keepalive, cancel):
        ``<prefix>.agent.<id>.$stream.<stream id>``; this is the subject's stem."""
        return f"{self.prefix}.agent.{agent_id}.$stream."

    def heartbeat(self, agent_id: str) -> str:
        return f"{self.prefix}.hb.{agent_id}"

    def topic(self, topic: str) -> str:
        return f"{self.prefix}.topic.{topic}"

    def topic_of(self, subject: str) -> str:
        """The topic name a broadcast subject carries."""
        return subject[len(self.prefix) + len(".topic.") :]

    def topic_redo(self, consumer: str, topic: str) -> str:
        """A dead-lettered topic message replayed to the one durable consumer that gave
        up on it (stream ``REACH_TOPICS``): only that agent name's subscription sees it."""
        return f"{self.prefix}.topicredo.{consumer}.{topic}"

    def topic_dlq(self, topic: str) -> str:
        """Where a durable topic message's dead letter goes (stream ``REACH_DLQ``); the
        ``$`` keeps it apart from every capability's ``dlq.<capability>``."""
        return f"{self.prefix}.dlq.$topic.{topic}"

    def registry(self, verb: str) -> str:
        """The registry's queries (``route``, ``list``); also the old register and
        deregister subjects without an id, which registries still answer."""
        return f"{self.prefix}.registry.{verb}"

    def register(self, agent_id: str) -> str:
        """Where an agent registers: its id in the subject, so a server can allow each
        user its own (``*`` for the registry's subscription)."""
        return f"{self.prefix}.registry.register.{agent_id}"

    def deregister(self, agent_id: str) -> str:
        return f"{self.prefix}.registry.deregister.{agent_id}"

    def event(self, agent_id: str) -> str:
        return f"{self.prefix}.evt.agent.{agent_id}"

    def task(self, task_id: str, capability: str, priority: str) -> str:
        """Where a durable task waits (stream ``REACH_TASKS``). The id comes first, so one
        task's message is found by ``reach.task.<id>.>``."""
        return f"{self.prefix}.task.{task_id}.{capability}.{priority}"

    def task_queue(self, capability: str, priority: str) -> str:
        """The filter of the one consumer per capability and priority (disjoint: the
        priority is always the last token)."""
        return f"{self.prefix}.task.*.{capability}.{priority}"

    def task_lookup(self, task_id: str) -> str:
        return f"{self.prefix}.task.{task_id}.>"

    def task_at(self, task_id: str, capability: str) -> str:
        """Where a delayed task (or one its handler asked to retry later) waits: a
        schedule the server holds in stream ``REACH_TASKS`` until its due time, then
        publishes as the task's message. A ``$`` token is never a capability's, so no
        consumer of the work queue takes it; ``task_lookup`` finds it."""
        return f"{self.prefix}.task.{task_id}.$at.{capability}"

    def task_at_all(self) -> str:
        """Every waiting delayed task (to count them)."""
        return f"{self.prefix}.task.*.$at.>"

    def schedule(self, name: str) -> str:
        """A periodic schedule's definition (one message, replaced by a new one: the
        schedule's name is its identity), in stream ``REACH_TASKS``."""
        return f"{self.prefix}.task.$sched.{name}.$def"

    def schedules(self) -> str:
        return f"{self.prefix}.task.$sched.*.$def"

    def schedule_fire(self, name: str, capability: str, priority: str) -> str:
        """Where the server puts a periodic schedule's firings: on the work queue of its
        capability and priority, so an agent that serves it turns each into a task."""
        return f"{self.prefix}.task.$fire-{name}.{capability}.{priority}"

    def dlq(self, capability: str) -> str:
        return f"{self.prefix}.dlq.{capability}"

    def task_cancel(self) -> str:
        """Core NATS: "stop running this task now" (the record says it for good)."""
        return f"{self.prefix}.taskctl.cancel"

    def task_done(self, client: str) -> str:
        """Core NATS: a submitter's own subject for the final records of its tasks."""
        return f"{self.prefix}.taskdone.{client}"

    def bucket(self, name: str) -> str:
        """KV bucket for this prefix: ``reach_agents`` by default, one per tenant prefix."""
        return f"{self.prefix.replace('.', '_')}_{name}"

    def stream(self, name: str) -> str:
        """JetStream stream for this prefix: ``REACH_TASKS`` by default (``TASKS``, the
        task work queue; ``TASK_EVENTS``, ``DLQ``, ``TOPICS``), one per tenant prefix."""
        return f"{self.prefix.replace('.', '_').upper()}_{name}"
