"""Milliseconds in the gateway's answers are rounded to the microsecond: a duration
measured as ``338.9999999999418`` is sent as ``339.0`` (still a JSON number: the wire
does not change)."""

import json

import reach
from reach._gateway.errors import error_body
from reach._gateway.routes_call import answer_body
from reach.errors import Attempt


def test_attempt_durations_in_an_error_body_are_rounded():
    err = reach.RequestTimeout(
        "no answer",
        capability="a.b",
        attempts=[Attempt("a-1", "timeout", 338.9999999999418), Attempt("a-2", "ok", 0.0001)],
    )
    assert [a["duration_ms"] for a in error_body(err)["attempts"]] == [339.0, 0.0]


def test_an_answer_carries_rounded_latency_and_duration():
    body = json.loads(answer_body(b"{}", "a-1", "r1", 12.3456789, 338.9999999999418))
    assert (body["latency_ms"], body["duration_ms"]) == (12.346, 339.0)
    assert json.loads(answer_body(b"{}", "a-1", "r1", 1.0, None))["duration_ms"] is None
