"""Application error codes on the wire: validation, status, and the way back to an exception."""

import pytest

from reach import errors
from reach._codec import error_from_reply, error_reply, wire_error
from reach.wire import ERROR_CODES, Header


class Busy(errors.RemoteError):
    code = "busy_now"
    status = 503
    retryable = True


class Plain(errors.RemoteError):
    code = "out_of_stock"


class BadStatus(errors.RemoteError):
    code = "teapot_ish"
    status = 999


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (Busy("x"), ("busy_now", 503, True)),
        (Plain("x"), ("out_of_stock", 500, False)),
        (BadStatus("x"), ("teapot_ish", 500, False)),
        # protocol codes keep the protocol's status and retryability
        (errors.ResourceExhausted("x", retryable=False), ("resource_exhausted", 429, True)),
        (errors.BadRequest("x"), ("bad_request", 400, False)),
    ],
)
def test_wire_error_of_a_refusal(exc, expected):
    assert wire_error(exc) == expected


@pytest.mark.parametrize("code", ["Busy", "busy now", "1busy", "", "x" * 65, "busy-now", "é"])
def test_invalid_codes_are_not_sent(code):
    exc = errors.RemoteError("x", code=code)
    assert wire_error(exc) is None


def test_longest_valid_code():
    assert wire_error(errors.RemoteError("x", code="a" * 64)) == ("a" * 64, 500, False)


def test_application_code_round_trip():
    body, headers = error_reply("busy_now", "come back later", "a-1", status=503, retryable=True)
    assert headers[Header.SERVICE_ERROR_CODE] == "503"
    err = error_from_reply(body, headers, capability="x.y", request_id="r1")
    assert isinstance(err, errors.HandlerFailed)
    assert err.code == "busy_now"
    assert err.outcome == "refused"  # never one of the client's own outcome names
    assert err.retryable
    assert err.agent_id == "a-1"
    assert type(err).code == "failed"  # the class is untouched


def test_a_garbled_code_from_a_foreign_agent_reads_as_failed():
    body = b'{"type":"reach.error","code":"Not A Code!","message":"m","retryable":false}'
    err = error_from_reply(body, {Header.SERVICE_ERROR_CODE: "500"}, capability="", request_id="")
    assert err.code == "failed"


def test_every_protocol_error_class_states_its_protocol_status():
    for code, (status, retryable) in ERROR_CODES.items():
        cls = errors.error_for_code(code)
        assert (cls.status, cls.retryable) == (status, retryable), code


@pytest.mark.parametrize("code", ["ok", "error", "no_responders", "refused", "busy_now", "failed"])
def test_an_application_code_never_takes_a_client_outcome_name(code):
    body, headers = error_reply(code, "nope", "a-1", status=500)
    err = error_from_reply(body, headers, capability="c", request_id="r")
    assert err.outcome in ("refused", "failed")
    assert errors.RemoteError("x", code=code).outcome in ("refused", "failed")


@pytest.mark.parametrize("code", ["ok", "error", "no_responders", "refused"])
def test_the_client_outcome_names_are_reserved_and_sent_as_failed(code):
    assert wire_error(errors.RemoteError("x", code=code)) is None
    body, headers = error_reply(code, "nope", "a-1", status=500)
    assert error_from_reply(body, headers, capability="c", request_id="r").code == "failed"


def test_protocol_codes_keep_their_outcome():
    for code in ERROR_CODES:
        assert errors.error_for_code(code)("x").outcome == code
