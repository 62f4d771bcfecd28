"""sdk/ is the contract for other languages: schemas must match reach.wire, vectors decode."""

import json
import re
from pathlib import Path

import msgspec
import pytest

from reach._subjects import validate_agent_id, validate_capability, validate_topic
from reach.wire import (
    ERROR_CODES,
    AgentEvent,
    AgentInfo,
    AgentRecord,
    Control,
    Deregistration,
    ErrorBody,
    Header,
    Heartbeat,
    RegisterReply,
    Registration,
    StreamCancel,
    StreamCredit,
)
from sdk.gen_schemas import SCHEMAS, render

VECTORS = sorted((Path(__file__).parents[2] / "sdk" / "vectors").glob("*.json"))
KNOWN_HEADERS = {v for k, v in vars(Header).items() if not k.startswith("_")} | {
    "Nats-TTL",
    "Nats-Expected-Last-Subject-Sequence",
}
BODY_TYPES = {
    "registration": Registration,
    "register-reply": RegisterReply,
    "agent-record": AgentRecord,
    "agent-event": AgentEvent,
    "control": Control,
    "deregistration": Deregistration,
    "stream-credit": StreamCredit,
    "stream-cancel": StreamCancel,
}
#: a stream's subject, where its caller speaks (PROTOCOL.md 3.3)
STREAM_SUBJECT = re.compile(r"reach\.agent\.[A-Za-z0-9_-]+\.\$stream\.[A-Za-z0-9_-]+")


def test_schemas_match_wire():
    rendered = render()
    on_disk = {p.name: p.read_text() for p in SCHEMAS.glob("*.json")}
    assert on_disk == rendered, "sdk/schemas drifted from reach.wire: run `make schemas`"


def test_there_are_vectors_of_every_kind():
    kinds = {json.loads(p.read_text())["kind"] for p in VECTORS}
    assert kinds >= {
        "request",
        "reply",
        "error",
        "heartbeat",
        "agent-info",
        "broadcast",
        "registration",
        "deregistration",
        "stream-opened",
        "stream-chunk",
        "stream-end",
        "stream-credit",
        "stream-cancel",
    }


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_vector_decodes(path):
    v = json.loads(path.read_text())
    body = msgspec.json.encode(v["body"])
    headers = v["headers"]
    assert set(headers) <= KNOWN_HEADERS
    kind = v["kind"]
    if kind in BODY_TYPES:
        decoded = msgspec.json.decode(body, type=BODY_TYPES[kind])
        assert msgspec.json.decode(msgspec.json.encode(decoded)) == v["body"]
        # registration names its agent in the subject too, and the two must agree
        if isinstance(decoded, Registration):
            assert v["subject"] == f"reach.registry.register.{decoded.info.agent_id}"
        elif isinstance(decoded, Deregistration):
            assert v["subject"] == f"reach.registry.deregister.{decoded.agent_id}"
        elif isinstance(decoded, StreamCredit | StreamCancel):
            assert STREAM_SUBJECT.fullmatch(v["subject"])
    elif kind == "error":
        if "reply" in v:  # a stream's error frame, from its subject
            assert STREAM_SUBJECT.fullmatch(v["reply"])
            assert int(headers[Header.END]) >= 0
        err = msgspec.json.decode(body, type=ErrorBody)
        if err.code in ERROR_CODES:
            status, retryable = ERROR_CODES[err.code]
            assert headers[Header.SERVICE_ERROR_CODE] == str(status)
            assert err.retryable == retryable
        else:  # an application's own code
            assert re.fullmatch(r"[a-z][a-z0-9_]{0,63}", err.code)
            assert 400 <= int(headers[Header.SERVICE_ERROR_CODE]) <= 599
    elif kind == "heartbeat":
        hb = msgspec.json.decode(body, type=Heartbeat)
        assert v["subject"] == f"reach.hb.{hb.agent_id}"
    elif kind == "agent-info":
        info = msgspec.json.decode(body, type=AgentInfo)
        validate_agent_id(info.agent_id)
        for cap in info.capabilities:
            validate_capability(cap.name)
    elif kind == "request":
        parts = v["subject"].split(".")
        assert parts[0] == "reach"
        if parts[1] == "cap":
            validate_capability(".".join(parts[2:]))
        else:
            assert parts[1] == "agent"
            validate_agent_id(parts[2])
            validate_capability(".".join(parts[3:]))
        assert v["reply"]
        if Header.DEADLINE in headers:
            assert int(headers[Header.DEADLINE]) > 0
        if Header.STREAM_WINDOW in headers:
            assert 1 <= int(headers[Header.STREAM_WINDOW]) <= 1024
        assert headers.get(Header.PRIORITY, "normal") in {"high", "normal", "low"}
    elif kind in ("stream-opened", "stream-chunk", "stream-end"):
        assert v["subject"].startswith("_INBOX.")
        assert STREAM_SUBJECT.fullmatch(v["reply"])
        if kind == "stream-opened":
            assert headers == {Header.CHUNK: "0"}
            assert v["body"] is None  # an empty body
        elif kind == "stream-chunk":
            assert int(headers[Header.CHUNK]) >= 1
            assert Header.END not in headers
        else:
            assert int(headers[Header.END]) >= 0
            assert v["body"] is None  # an empty body
    elif kind == "broadcast":
        assert v["subject"].startswith("reach.topic.")
        validate_topic(v["subject"].removeprefix("reach.topic."))
    else:
        assert kind == "reply"
        assert Header.SERVICE_ERROR_CODE not in headers
        parts = v["reply"].split(".")
        assert parts[:2] == ["reach", "agent"]
        validate_agent_id(parts[2])
        validate_capability(".".join(parts[3:]))
        if Header.AGENT in headers:
            assert headers[Header.AGENT] == parts[2]
