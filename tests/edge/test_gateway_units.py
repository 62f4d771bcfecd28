"""The gateway's pure parts: settings, token scopes, input checks, the status table."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

import reach
from reach._gateway.auth import Auth
from reach._gateway.errors import STATUS_BY_CODE, EdgeError, error_body, http_status
from reach._gateway.inputs import CallOptions, call_options
from reach._gateway.settings import GatewaySettings, Scope
from reach._gateway.streams import Latest, StreamSlots
from reach.errors import Attempt

TOKEN = "0123456789abcdef0123"


def test_settings_read_tokens_as_json_from_the_environment(monkeypatch):
    monkeypatch.setenv("REACH_GATEWAY_TOKENS", json.dumps({TOKEN: ["call", "submit"]}))
    monkeypatch.setenv("REACH_GATEWAY_PORT", "9000")
    monkeypatch.setenv("REACH_GATEWAY_HOST", "0.0.0.0")
    settings = GatewaySettings(_env_file=None)
    assert settings.tokens == {TOKEN: frozenset({Scope.CALL, Scope.SUBMIT})}
    assert (settings.port, settings.max_body_bytes, settings.open) == (9000, 1 << 20, False)
    assert TOKEN not in repr(settings)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tokens": {"short": ["call"]}}, "at least 16"),
        ({"tokens": {TOKEN: []}}, "at least one scope"),
        ({"tokens": {TOKEN: ["root"]}}, "tokens"),
        ({"tokens": {TOKEN + " x": ["call"]}}, "spaces"),
        ({"host": "0.0.0.0"}, "REACH_GATEWAY_TOKENS"),
        ({"host": "192.0.2.7"}, "not loopback"),
        ({"default_timeout": 10, "max_timeout": 5}, "default_timeout"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"shutdown_grace": 0}, "shutdown_grace"),
        ({"max_streams": 0}, "max_streams"),
        ({"public_url": "gw.example"}, "http"),
        ({"public_url": "https://gw.example/?x=1"}, "query"),
    ],
)
def test_settings_refuse(kwargs, needle):
    with pytest.raises(ValidationError, match=needle):
        GatewaySettings(_env_file=None, **kwargs)


def test_open_is_allowed_on_loopback_or_when_said():
    for host in ("127.0.0.1", "::1", "localhost"):
        assert GatewaySettings(_env_file=None, host=host).open
    assert GatewaySettings(_env_file=None, host="0.0.0.0", allow_open=True).open


def test_scopes_admin_may_do_everything():
    auth = Auth({TOKEN: frozenset({Scope.CALL}), "a" * 16: frozenset({Scope.ADMIN})})
    auth.check(f"Bearer {TOKEN}", Scope.CALL)
    auth.check(f"bearer {TOKEN}", Scope.CALL)  # the scheme is case-insensitive
    with pytest.raises(EdgeError) as info:
        auth.check(f"Bearer {TOKEN}", Scope.SUBMIT)
    assert (info.value.status, info.value.code) == (403, "forbidden")
    for scope in Scope:
        auth.check("Bearer " + "a" * 16, scope)
    for header in (None, "", "Bearer", f"Token {TOKEN}", "Bearer wrong-token-xxxxxxxx"):
        with pytest.raises(EdgeError) as info:
            auth.check(header, Scope.CALL)
        assert info.value.status == 401
    assert Auth({}).scopes_of(None) == frozenset(Scope)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (reach.BadRequest("x"), 400),
        (reach.ConfigurationError("x"), 400),
        (reach.PayloadTooLarge("x", size=9, limit=5), 413),
        # by class, never by what the message says
        (reach.ConfigurationError("payload of 9 bytes is too large for a task: at most 5"), 400),
        (reach.Unauthorized("NATS refused connection 'gw' permission to publish"), 502),
        (reach.CapabilityNotFound("x"), 404),
        (reach.TaskNotFound("t1"), 404),
        (reach.DeadLetterNotFound(3, "S"), 404),
        (reach.Cancelled("x"), 409),
        (reach.ResourceExhausted("x"), 429),
        (reach.HandlerFailed("x"), 502),
        (reach.HandlerFailed("x", code="busy_now"), 502),
        (reach.InvalidReply("x"), 502),
        (reach.AgentUnavailable("x"), 503),
        (reach.CircuitOpen("x"), 503),
        (reach.ConnectionFailed("x"), 503),
        (reach.NotStarted("x"), 503),
        (reach.RequestTimeout("x"), 504),
        (reach.ReachError("x"), 500),
        (EdgeError(413, "payload_too_large", "x"), 413),
    ],
)
def test_every_reach_error_has_a_status(error, status):
    assert http_status(error) == status
    if status == 413:
        assert error_body(error)["code"] == "payload_too_large"
    if isinstance(error, reach.RemoteError) and error.code in STATUS_BY_CODE:
        assert STATUS_BY_CODE[error.code] == status


def test_the_error_body_carries_the_structured_fields():
    err = reach.HandlerFailed(
        "nope",
        capability="a.b",
        agent_id="a-1",
        request_id="r1",
        code="busy_now",
        attempts=[Attempt("a-1", "refused", 1.5)],
    )
    assert error_body(err) == {
        "code": "busy_now",
        "message": "nope",
        "retryable": False,
        "capability": "a.b",
        "agent_id": "a-1",
        "request_id": "r1",
        "application_code": True,
        "attempts": [{"agent_id": "a-1", "outcome": "refused", "duration_ms": 1.5}],
    }
    assert error_body(reach.TaskNotFound("t1"))["code"] == "task_not_found"


def test_call_options_from_query_and_headers():
    assert call_options({}, {}, 60) == CallOptions()
    opts = call_options(
        {"timeout": "2.5", "tags": "eu, gpu,", "routing": "affinity", "affinity_key": "s1"},
        {"x-reach-timeout": "9", "x-reach-priority": "low", "x-reach-version": "2"},
        60,
    )
    assert opts == CallOptions(
        timeout=2.5,
        priority=reach.Priority.LOW,
        tags=("eu", "gpu"),
        version="2",
        routing="affinity",
        affinity_key="s1",
    )
    with pytest.raises(EdgeError, match="61s is above"):
        call_options({"timeout": "61"}, {}, 60)
    with pytest.raises(EdgeError, match="tags"):
        call_options({"tags": ",".join(f"t{i}" for i in range(65))}, {}, 60)


async def test_latest_keeps_only_the_newest_and_never_the_end_before_it():
    latest: Latest[int] = Latest()
    for n in (1, 2, 3):
        latest.put(n)
    latest.end()
    assert (await latest.take(), latest.skipped) == (3, 2)  # the final one is kept
    assert await latest.take() is None  # then how the watch ended
    failed: Latest[int] = Latest()
    failed.put(1)
    failed.end(reach.ReachError("watch failed"))
    assert await failed.take() == 1
    assert isinstance(await failed.take(), reach.ReachError)


def test_stream_slots_refuse_past_the_limit_and_free_on_exit():
    slots = StreamSlots(1)
    with slots.slot():
        assert slots.full()
        with pytest.raises(EdgeError) as info, slots.slot():
            pass
        assert (info.value.status, info.value.retryable, slots.refused) == (503, True, 1)
    assert (slots.open, slots.full()) == (0, False)


def test_a_corrupt_task_record_is_500_with_its_code_and_task_id():
    """Not the base ReachError's anonymous 500: the code says what is wrong."""
    err = reach.CorruptRecord("t1", "Invalid enum value 'ARCHIVED'", revision=7)
    assert http_status(err) == 500
    body = error_body(err)
    assert (body["code"], body["task_id"], body["retryable"]) == ("corrupt_record", "t1", False)
    assert STATUS_BY_CODE["corrupt_record"] == 500
