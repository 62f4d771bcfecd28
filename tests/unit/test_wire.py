import msgspec
import pytest

from reach import errors
from reach._codec import PayloadDecoder, encode_payload, error_from_reply, error_reply
from reach.wire import (
    ERROR_CODES,
    AgentInfo,
    CapabilityInfo,
    ErrorBody,
    ErrorCode,
    Header,
    Heartbeat,
    Status,
)

SAMPLES = [
    ErrorBody(code=ErrorCode.BAD_REQUEST, message="missing field `text`", retryable=False),
    CapabilityInfo(name="text.translate", version="1.2", description="d"),
    AgentInfo(
        agent_id="translator-1",
        name="translator",
        capabilities=[CapabilityInfo(name="text.translate")],
        tags=["gpu", "eu"],
        started_ms=1,
        metadata={"k": "v"},
    ),
    Heartbeat(agent_id="a-1", status=Status.DEGRADED, seq=7, inflight=3, load=0.375),
]


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_round_trip(value):
    data = msgspec.json.encode(value)
    assert msgspec.json.decode(data, type=type(value)) == value


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_tag_is_explicit_and_unknown_fields_are_ignored(value):
    raw = msgspec.to_builtins(value)
    assert raw["type"].startswith("reach.")
    raw["added_in_v2"] = {"anything": [1, 2]}
    assert msgspec.convert(raw, type=type(value)) == value


def test_every_error_code_has_a_status_and_an_exception():
    for code in ErrorCode:
        assert code in ERROR_CODES
        assert errors.error_for_code(code.value).code == code.value


def test_error_reply_round_trip_maps_to_exception():
    body, headers = error_reply(ErrorCode.RESOURCE_EXHAUSTED, "queue full", "a-1")
    assert headers[Header.SERVICE_ERROR_CODE] == "429"
    assert headers[Header.SERVICE_ERROR] == "queue full"
    err = error_from_reply(body, headers, capability="x.y", request_id="r1")
    assert isinstance(err, errors.ResourceExhausted)
    assert err.retryable
    assert err.agent_id == "a-1"
    assert err.request_id == "r1"
    assert err.capability == "x.y"


def test_foreign_error_without_body_uses_headers():
    err = error_from_reply(
        b"",
        {Header.SERVICE_ERROR_CODE: "404", Header.SERVICE_ERROR: "nope"},
        capability="",
        request_id="",
    )
    assert isinstance(err, errors.CapabilityNotFound)
    assert err.message == "nope"


def test_timeout_error_is_a_timeout():
    assert issubclass(errors.RequestTimeout, TimeoutError)
    assert issubclass(errors.RequestTimeout, errors.ReachError)


class Point(msgspec.Struct):
    x: int
    y: int = 0


def test_payload_decoder_by_type():
    assert PayloadDecoder(bytes)(b"\x00raw") == b"\x00raw"
    assert PayloadDecoder(dict)(b'{"a": 1}') == {"a": 1}
    assert PayloadDecoder(Point)(b'{"x": 2}') == Point(2)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.x"):
        PayloadDecoder(Point)(b'{"x": "two"}')
    with pytest.raises(msgspec.ValidationError):
        PayloadDecoder(dict)(b"")


def test_encode_payload():
    assert encode_payload(None) == b""
    assert encode_payload(b"raw") == b"raw"
    assert encode_payload(Point(1)) == b'{"x":1,"y":0}'
    with pytest.raises(TypeError, match="cannot encode"):
        encode_payload(object())
