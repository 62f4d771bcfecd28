"""An AsyncAPI 3.0 document of the fleet's contract (a ``Catalogue``): pure.

The document describes the fleet as one application. It *receives* each capability's
requests, in the capability's queue group (and on each instance's direct subject), and
answers on the request's reply subject: a request/reply operation with a ``reply``. It
receives durable tasks from the task stream and tells the submitter on its notice subject
when one ends, and it receives the topics its agents subscribe to. A capability that
streams answers with frames (opened, chunks, end or error) and hears its caller's credit
and cancel on the stream's subject (sdk/PROTOCOL.md 3.3). Headers are
``sdk/PROTOCOL.md``'s. Each schema is hoisted into ``components.schemas`` with its
``$defs`` beside it and its references rewritten, so every ``$ref`` resolves in the
document; a name taken by another shape gets a suffix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec

from .._codec import canonical
from .._subjects import Subjects
from .._urls import check_servers
from ..wire import (
    PROTOCOL_VERSION,
    AgentRecord,
    ErrorBody,
    Header,
    Priority,
    StreamCancel,
    StreamCredit,
    TaskRecord,
    TaskSubmit,
)
from .catalogue import Catalogue, Offer, Variant, catalogue
from .schemas import RAW_BYTES

__all__ = ["ASYNCAPI_VERSION", "asyncapi_document", "fleet_document"]

ASYNCAPI_VERSION = "3.0.0"
_NATS_BINDING = "0.1.0"
_SCHEMAS = "#/components/schemas/"
_DEFS = "#/$defs/"

_UNSAFE = re.compile(r"[^\w.\-]")


def _header(description: str, **schema: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **schema}


_TRACE = {
    Header.TRACEPARENT: _header("W3C trace context"),
    Header.TRACESTATE: _header("W3C trace context"),
}
_REQUEST_HEADERS: dict[str, Any] = {
    "type": "object",
    "description": "All optional: send only those that carry information.",
    "properties": {
        Header.DEADLINE: _header(
            "absolute deadline, unix epoch milliseconds; none: no deadline", pattern="^[0-9]+$"
        ),
        Header.PRIORITY: _header(
            "queue priority", enum=[p.value for p in Priority], default=Priority.NORMAL.value
        ),
        Header.REQUEST_ID: _header(
            "opaque id for logs and traces; default: the reply subject without _INBOX."
        ),
        Header.CALLER: _header("the calling agent's id or a client name"),
        Header.ATTEMPT: _header("1-based attempt number of a retry", pattern="^[1-9][0-9]*$"),
        **_TRACE,
    },
}
_REPLY_HEADERS: dict[str, Any] = {
    "type": "object",
    "description": "None by default: the reply's own reply-to subject names the instance"
    " (reach.agent.<agent_id>.<capability>); agents configured so add these.",
    "properties": {
        Header.AGENT: _header("the answering agent's id"),
        Header.DURATION_MS: _header("handler time, decimal milliseconds"),
    },
}
_ERROR_HEADERS: dict[str, Any] = {
    "type": "object",
    "required": [Header.SERVICE_ERROR_CODE],
    "properties": {
        Header.SERVICE_ERROR_CODE: _header(
            "numeric status of the error code (400 bad_request, 404 capability_not_found,"
            " 408 timeout, 429 resource_exhausted, 500 failed, 503 agent_unavailable, ...)",
            pattern="^[1-5][0-9][0-9]$",
        ),
        Header.SERVICE_ERROR: _header("a short human message"),
        Header.AGENT: _header("the answering agent's id"),
    },
}
_COUNT = "^(0|[1-9][0-9]*)$"
_STREAM_REQUEST_HEADERS: dict[str, Any] = {
    "type": "object",
    "description": "A stream request (sdk/PROTOCOL.md 3.3): without Reach-Stream-Window a"
    " capability that streams answers bad_request; the others as for any request.",
    "required": [Header.STREAM_WINDOW],
    "properties": {
        **_REQUEST_HEADERS["properties"],
        Header.STREAM_WINDOW: _header(
            "the first window: how many chunks the agent may send before the caller grants"
            " more; 1..1024",
            pattern="^[1-9][0-9]*$",
        ),
        Header.STREAM_PATIENCE: _header(
            "milliseconds of the caller's silence after which the agent stops the stream;"
            " 500..600000, default 5000",
            pattern="^[1-9][0-9]*$",
        ),
    },
}
_OPENED_HEADERS: dict[str, Any] = {
    "type": "object",
    "required": [Header.CHUNK],
    "properties": {Header.CHUNK: _header("0: the stream is open, no chunk yet", const="0")},
}
_CHUNK_HEADERS: dict[str, Any] = {
    "type": "object",
    "required": [Header.CHUNK],
    "properties": {Header.CHUNK: _header("the chunk's number, from 1", pattern="^[1-9][0-9]*$")},
}
_END_HEADERS: dict[str, Any] = {
    "type": "object",
    "required": [Header.END],
    "properties": {Header.END: _header("how many chunks the stream sent", pattern=_COUNT)},
}
_STREAM_ERROR_HEADERS: dict[str, Any] = {
    **_ERROR_HEADERS,
    "properties": {
        **_ERROR_HEADERS["properties"],
        Header.END: _header(
            "how many chunks came before the error; absent when the agent refused the"
            " request before it opened the stream",
            pattern=_COUNT,
        ),
    },
}
_EMPTY: dict[str, Any] = {"type": "string", "maxLength": 0, "description": "an empty body"}
_TASK_HEADERS: dict[str, Any] = {
    "type": "object",
    "required": ["Nats-Msg-Id", "Reach-Task-Id"],
    "properties": {
        "Nats-Msg-Id": _header("the task id: a resent publish is dropped by the server"),
        "Reach-Task-Id": _header("the task id, [A-Za-z0-9_-]{1,128}"),
        Header.CALLER: _header("the submitter"),
        Header.IDEMPOTENCY_KEY: _header("the submitter's deduplication key"),
        **_TRACE,
    },
}


def fleet_document(
    records: Sequence[AgentRecord],
    *,
    subjects: Subjects,
    url: str,
    names: Sequence[str] = (),
    tags: Sequence[str] = (),
) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the fleet in ``records`` (a client's routing table):
    the names matching ``names`` (globs; none: all), served by instances with every tag in
    ``tags``, on the NATS servers of ``url``."""
    return asyncapi_document(
        catalogue(records, names=names, tags=tags), subjects=subjects, servers=check_servers(url)
    )


def asyncapi_document(
    cat: Catalogue,
    *,
    subjects: Subjects,
    servers: Sequence[str] = (),
    title: str = "Agent-Reach fleet",
) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``cat`` under ``subjects``' prefix; ``servers`` are
    NATS URLs (credentials are never written). ``info.version`` is the wire protocol's."""
    return _Document(subjects).build(cat, servers, title, PROTOCOL_VERSION)


class _Document:
    def __init__(self, subjects: Subjects) -> None:
        self.subjects = subjects
        self.channels: dict[str, Any] = {}
        self.operations: dict[str, Any] = {}
        self.schemas: dict[str, Any] = {}
        self.messages: dict[str, Any] = {}
        self.traits: dict[str, Any] = {
            "request": {"headers": _REQUEST_HEADERS},
            "reply": {"headers": _REPLY_HEADERS},
        }

    def build(
        self, cat: Catalogue, servers: Sequence[str], title: str, version: str
    ) -> dict[str, Any]:
        self.messages["error"] = {
            "name": "error",
            "title": "Error reply",
            "summary": "The request failed: the body names the code (sdk/PROTOCOL.md 3.2).",
            "headers": _ERROR_HEADERS,
            "payload": self.schema(msgspec.json.schema(ErrorBody), "reach.ErrorBody"),
        }
        for offer in cat.capabilities:
            self.capability(offer)
        if any(v.streams for offer in cat.capabilities for v in offer.variants):
            self.stream_frames()
        if cat.tasks:
            self.task_notices()
        for offer in cat.tasks:
            self.task(offer)
        for offer in cat.topics:
            self.topic(offer)
        prefix = self.subjects.prefix
        counts = (
            f"{_count(cat.capabilities, 'capability', 'capabilities')},"
            f" {_count(cat.tasks, 'task capability', 'task capabilities')} and"
            f" {_count(cat.topics, 'topic', 'topics')} served by"
            f" {_count(cat.agents, 'instance', 'instances')}"
        )
        doc: dict[str, Any] = {
            "asyncapi": ASYNCAPI_VERSION,
            "info": {
                "title": title,
                "version": version,
                "description": (
                    f"The live Agent-Reach fleet under subject prefix `{prefix}`: {counts}."
                    " Generated from the routing table; the wire is sdk/PROTOCOL.md."
                ),
            },
            "defaultContentType": "application/json",
            "servers": _servers(servers),
            "channels": self.channels,
            "operations": self.operations,
            "components": {
                "schemas": self.schemas,
                "messages": self.messages,
                "messageTraits": self.traits,
            },
        }
        if not doc["servers"]:
            del doc["servers"]
        return doc

    # -- capabilities: request/reply ---------------------------------------------------

    def capability(self, offer: Offer) -> None:
        name = offer.name
        streams = any(v.streams for v in offer.variants)
        key = self.key(self.channels, f"cap.{name}")
        requests: dict[str, Any] = {}
        error = "stream.error" if streams else "error"
        replies: dict[str, Any] = {"error": {"$ref": f"#/components/messages/{error}"}}
        if streams:
            replies["opened"] = {"$ref": "#/components/messages/stream.opened"}
        for v in offer.variants:
            base = f"{key}.{v.label}"
            trait = "streamRequest" if v.streams else "request"
            requests[f"{v.label}.request"] = self.message(
                f"{base}.request",
                {
                    "name": name,
                    "title": f"{name} {v.version} request",
                    **_describe(v),
                    **_content(v.payload),
                    "payload": self.schema(v.payload, f"{base}.payload"),
                    "correlationId": {"location": f"$message.header#/{Header.REQUEST_ID}"},
                    "traits": [{"$ref": f"#/components/messageTraits/{trait}"}],
                    "x-reach-version": v.version,
                    "x-reach-agents": list(v.agents),
                    **({"x-reach-streams": True} if v.streams else {}),
                },
            )
            if v.streams:
                replies[f"{v.label}.chunk"] = self.message(
                    f"{base}.chunk",
                    {
                        "name": f"{name}.chunk",
                        "title": f"{name} {v.version} chunk",
                        "summary": "One chunk of the answer, in order (sdk/PROTOCOL.md 3.3).",
                        "headers": _CHUNK_HEADERS,
                        **_content(v.result),
                        "payload": self.schema(v.result, f"{base}.result"),
                    },
                )
                continue
            replies[f"{v.label}.reply"] = self.message(
                f"{base}.reply",
                {
                    "name": f"{name}.reply",
                    "title": f"{name} {v.version} answer",
                    **_content(v.result),
                    "payload": self.schema(v.result, f"{base}.result"),
                    "traits": [{"$ref": "#/components/messageTraits/reply"}],
                },
            )
        if streams:
            replies["end"] = {"$ref": "#/components/messages/stream.end"}
        self.channels[key] = {
            "address": self.subjects.cap(name),
            "title": name,
            **_describe(offer),
            "messages": requests,
        }
        direct = self.key(self.channels, f"agent.{name}")
        self.channels[direct] = {
            "address": self.subjects.agent("{agent_id}", name),
            "title": f"{name}, one instance",
            "summary": "This instance only: never substituted.",
            "parameters": {
                "agent_id": {
                    "description": "the instance's agent id",
                    "examples": list(offer.agents[:10]),
                }
            },
            "messages": requests,
        }
        reply = self.key(self.channels, f"{key}.reply")
        self.channels[reply] = {
            "address": None,
            "title": f"{name} replies",
            "description": "The request's NATS reply subject (an inbox the caller chose). A"
            " success reply's own reply-to subject is the answering instance's direct subject."
            + (_STREAM_REPLIES if streams else ""),
            "messages": replies,
        }
        answer = {
            "channel": {"$ref": f"#/channels/{reply}"},
            "messages": [{"$ref": f"#/channels/{reply}/messages/{m}"} for m in replies],
        }
        for channel, queue in ((key, True), (direct, False)):
            op: dict[str, Any] = {
                "action": "receive",
                "channel": {"$ref": f"#/channels/{channel}"},
                "title": name if queue else f"{name} (one instance)",
                **_describe(offer),
                "messages": [{"$ref": f"#/channels/{channel}/messages/{m}"} for m in requests],
                "reply": answer,
            }
            if queue:
                op["bindings"] = {
                    "nats": {"queue": Subjects.cap_queue(name), "bindingVersion": _NATS_BINDING}
                }
            if streams:
                op["x-reach-streams"] = True
            self.operations[self.key(self.operations, channel)] = op

    def stream_frames(self) -> None:
        """What every capability that streams shares: the request trait with
        ``Reach-Stream-Window``, the opened, end and error frames, and the stream's subject
        where the agent hears its caller (sdk/PROTOCOL.md 3.3)."""
        self.traits["streamRequest"] = {"headers": _STREAM_REQUEST_HEADERS}
        self.messages["stream.opened"] = {
            "name": "stream.opened",
            "title": "Stream opened",
            "summary": "Sent at once, before the handler runs: its reply-to subject is the"
            " stream's, where the caller grants credit and may cancel. Not a chunk.",
            "headers": _OPENED_HEADERS,
            "contentType": "application/octet-stream",
            "payload": _EMPTY,
        }
        self.messages["stream.end"] = {
            "name": "stream.end",
            "title": "Stream end",
            "summary": "The last frame: every chunk was sent. Fewer chunks received than"
            " it says, or one out of order, means frames were lost: the stream is broken.",
            "headers": _END_HEADERS,
            "contentType": "application/octet-stream",
            "payload": _EMPTY,
        }
        self.messages["stream.error"] = {
            "name": "error",
            "title": "Error reply or error frame",
            "summary": "Before the opened frame: a refusal, as for any request. After it: the"
            " stream ended in an error, after Reach-End chunks (sdk/PROTOCOL.md 3.3).",
            "headers": _STREAM_ERROR_HEADERS,
            "payload": self.schema(msgspec.json.schema(ErrorBody), "reach.ErrorBody"),
        }
        control: dict[str, Any] = {}
        for kind, struct, summary in (
            ("credit", StreamCredit, "Grant `credit` more chunks; 0 is a keepalive."),
            ("cancel", StreamCancel, "Stop now: the agent cancels the handler."),
        ):
            control[kind] = self.message(
                f"stream.{kind}",
                {
                    "name": f"reach.stream.{kind}",
                    "title": f"Stream {kind}",
                    "summary": summary,
                    "payload": self.schema(msgspec.json.schema(struct), f"reach.{struct.__name__}"),
                },
            )
        self.channels["stream"] = {
            "address": self.subjects.streams("{agent_id}") + "{stream_id}",
            "title": "Streams",
            "summary": "Where an agent hears the caller of one of its streams: the reply-to"
            " subject of every frame.",
            "parameters": {
                "agent_id": {"description": "the streaming instance's agent id"},
                "stream_id": {"description": "the stream's id, chosen by the agent"},
            },
            "messages": control,
        }
        self.operations["stream"] = {
            "action": "receive",
            "channel": {"$ref": "#/channels/stream"},
            "title": "Stream credit, keepalive and cancel",
            "description": "While a stream is open the caller publishes here well within the"
            " agent's patience (Reach-Stream-Patience, 5 s by default): credit it owes or a"
            " keepalive (credit 0); otherwise the agent stops the stream with `cancelled`.",
            "messages": [{"$ref": f"#/channels/stream/messages/{m}"} for m in control],
        }

    # -- durable tasks -----------------------------------------------------------------

    def task_notices(self) -> None:
        record = self.message(
            "reach.task.record",
            {
                "name": "reach.task.record",
                "title": "Final task record",
                "summary": "A task ended: its record (sdk/PROTOCOL.md 8.5), best effort.",
                "payload": self.schema(msgspec.json.schema(TaskRecord), "reach.TaskRecord"),
            },
        )
        self.channels["taskdone"] = {
            "address": self.subjects.task_done("{client}"),
            "title": "Task notices",
            "summary": "A submitter's own subject for the final records of its tasks.",
            "parameters": {"client": {"description": "the submitter's client name"}},
            "messages": {"record": record},
        }

    def task(self, offer: Offer) -> None:
        name = offer.name
        key = self.key(self.channels, f"task.{name}")
        submits: dict[str, Any] = {}
        submit = msgspec.json.schema(TaskSubmit)
        for v in offer.variants:
            base = f"{key}.{v.label}"
            submits[f"{v.label}.submit"] = self.message(
                f"{base}.submit",
                {
                    "name": name,
                    "title": f"{name} {v.version} task",
                    **_describe(v),
                    "summary": "A reach.task.submit body; its base64 `payload` holds the"
                    " capability's payload (x-reach-payload), its record's `result` the"
                    " result (x-reach-result).",
                    "headers": _TASK_HEADERS,
                    "payload": self.schema(submit, "reach.TaskSubmit"),
                    "x-reach-payload": self.schema(v.payload, f"{base}.payload"),
                    "x-reach-result": self.schema(v.result, f"{base}.result"),
                    "x-reach-version": v.version,
                    "x-reach-agents": list(v.agents),
                },
            )
        self.channels[key] = {
            "address": self.subjects.task("{task_id}", name, "{priority}"),
            "title": f"{name} tasks",
            **_describe(offer),
            "parameters": {
                "task_id": {"description": "the task id, [A-Za-z0-9_-]{1,128}"},
                "priority": {"enum": [p.value for p in Priority], "default": "normal"},
            },
            "messages": submits,
        }
        self.operations[self.key(self.operations, key)] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{key}"},
            "title": f"{name} (durable task)",
            "description": (
                (offer.description + "\n\n" if offer.description else "")
                + "Published through JetStream (stream <PREFIX>_TASKS); one instance runs"
                " it to the end, whoever fails (sdk/PROTOCOL.md 8)."
            ),
            "messages": [{"$ref": f"#/channels/{key}/messages/{m}"} for m in submits],
            "reply": {
                "channel": {"$ref": "#/channels/taskdone"},
                "messages": [{"$ref": "#/channels/taskdone/messages/record"}],
            },
        }

    # -- topics ------------------------------------------------------------------------

    def topic(self, offer: Offer) -> None:
        pattern = offer.name
        readable = pattern.replace("*", "any").replace(">", "all")
        key = self.key(self.channels, f"topic.{readable}")
        messages: dict[str, Any] = {}
        for n, v in enumerate(offer.variants, 1):
            label = "message" if n == 1 else f"message-{n}"
            how = "durable, ordered" if v.ordered else "durable" if v.durable else "plain"
            messages[label] = self.message(
                f"{key}.{label}",
                {
                    "name": pattern,
                    "title": f"{pattern} ({how})",
                    **_describe(v),
                    **_content(v.payload),
                    "payload": self.schema(v.payload, f"{key}.{label}.payload"),
                    "x-reach-agents": list(v.agents),
                },
            )
        self.channels[key] = {
            "address": self.subjects.topic(pattern),
            "title": pattern,
            **_describe(offer),
            "messages": messages,
        }
        self.operations[self.key(self.operations, key)] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{key}"},
            "title": f"{pattern} subscribers",
            "summary": "Broadcast: every subscriber gets every message (sdk/PROTOCOL.md 6).",
            "messages": [{"$ref": f"#/channels/{key}/messages/{m}"} for m in messages],
        }

    # -- components --------------------------------------------------------------------

    @staticmethod
    def key(taken: dict[str, Any], name: str) -> str:
        """A key for ``name`` that is safe in a JSON pointer and not yet in ``taken``."""
        base = _UNSAFE.sub("_", name)
        key, n = base, 1
        while key in taken:
            n += 1
            key = f"{base}-{n}"
        return key

    def message(self, name: str, message: dict[str, Any]) -> dict[str, str]:
        key = self.key(self.messages, name)
        self.messages[key] = message
        return {"$ref": f"#/components/messages/{key}"}

    def schema(self, schema: dict[str, Any] | None, name: str) -> dict[str, Any]:
        """``schema`` hoisted: its ``$defs`` under names of their own, its references
        rewritten; a reference to it. None (not described) is any value."""
        if schema is None:
            return {"description": "not described by the agent (an older agent)"}
        top = dict(schema)
        defs: dict[str, Any] = top.pop("$defs", {})
        names = self._names(defs)
        for d, body in defs.items():
            self.schemas[names[d]] = _rewrite(body, names)
        body = _rewrite(top, names)
        key = self._free(name, body)
        self.schemas[key] = body
        return {"$ref": _SCHEMAS + key}

    def _names(self, defs: dict[str, Any]) -> dict[str, str]:
        """A name in ``components.schemas`` for each of one schema's ``defs``: its own, or
        ``-2``, ``-3``... while that name holds another shape. A part is the same shape
        only with every reference rewritten, so renaming one part can make another that
        refers to it differ: repeat until no name moves (names only move forward, so this
        ends). Two parts of ``defs`` share a name only when they are the same."""
        base = {d: _UNSAFE.sub("_", d) for d in defs}
        n = dict.fromkeys(defs, 1)
        names = dict(base)
        moved = True
        while moved:
            moved = False
            claimed: dict[str, bytes] = {}
            for d, body in defs.items():
                mine = canonical(_rewrite(body, names))
                while self._held(names[d], claimed) not in (None, mine):
                    n[d] += 1
                    names[d] = f"{base[d]}-{n[d]}"
                    moved = True
                    mine = canonical(_rewrite(body, names))
                claimed[names[d]] = mine
        return names

    def _held(self, key: str, claimed: dict[str, bytes]) -> bytes | None:
        """The canonical form of what ``key`` holds: a part of the schema being hoisted
        (``claimed``) or one already written; None when it is free."""
        if key in claimed:
            return claimed[key]
        return canonical(self.schemas[key]) if key in self.schemas else None

    def _free(self, name: str, body: Any) -> str:
        """``name`` unless another schema holds it, then ``name-2``...; the same schema
        under the same name is written once."""
        base = _UNSAFE.sub("_", name)
        key, n = base, 1
        while key in self.schemas and canonical(self.schemas[key]) != canonical(body):
            n += 1
            key = f"{base}-{n}"
        return key


def _rewrite(node: Any, names: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {k: _rewrite(v, names) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith(_DEFS):
            target = ref[len(_DEFS) :]
            out["$ref"] = _SCHEMAS + _UNSAFE.sub("_", names.get(target, target))
        return out
    if isinstance(node, list):
        return [_rewrite(v, names) for v in node]
    return node


_STREAM_REPLIES = (
    " For a capability that streams (x-reach-streams): the opened frame, the chunks in"
    " order, then the end frame or an error frame. Every frame's own reply-to subject is"
    " the stream's (channel `stream`), where the caller grants credit, keeps the stream"
    " alive and cancels it (sdk/PROTOCOL.md 3.3)."
)


def _count(items: Sequence[object], one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}"


def _describe(item: Offer | Variant) -> dict[str, str]:
    return {"description": item.description} if item.description else {}


def _content(schema: dict[str, Any] | None) -> dict[str, str]:
    if schema is not None and schema.get("contentMediaType") == RAW_BYTES["contentMediaType"]:
        return {"contentType": "application/octet-stream"}
    return {}


def _servers(urls: Sequence[str]) -> dict[str, Any]:
    """One server object per NATS URL: host and port only, never credentials."""
    out: dict[str, Any] = {}
    for n, url in enumerate(urls, 1):
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        host = parts.hostname or "localhost"
        if ":" in host:
            host = f"[{host}]"
        server: dict[str, Any] = {
            "host": f"{host}:{parts.port or 4222}",
            "protocol": "nats" if parts.scheme in ("nats", "tls") else parts.scheme,
        }
        if parts.scheme == "tls":
            server["description"] = "TLS"
        out["nats" if n == 1 else f"nats-{n}"] = server
    return out
