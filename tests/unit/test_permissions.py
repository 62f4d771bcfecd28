"""Reading the server's refusals and choosing the credentials: pure logic, no server."""

from __future__ import annotations

import logging

import nats.errors
import pytest

from reach import ReachSettings, Unauthorized
from reach._nats import credentials, redact
from reach._permissions import Permissions, Violation, auth_refused, parse


def test_the_servers_refusals_are_read_from_nats_pys_errors():
    # nats-py lowercases the whole -ERR line before the error callback sees it
    pub = nats.errors.Error('nats: permissions violation for publish to "reach.hb.other"')
    sub = nats.errors.Error(
        'nats: permissions violation for subscription to "reach.cap.x" using queue "cap.x"'
    )
    assert parse(pub) == Violation("publish", "reach.hb.other")
    assert parse(sub) == Violation("subscribe", "reach.cap.x")
    assert parse(nats.errors.Error("nats: stale connection")) is None
    assert auth_refused(nats.errors.Error("nats: 'Authorization Violation'"))
    assert not auth_refused(pub)


def test_each_subject_is_logged_once_and_every_refusal_counted(caplog: pytest.LogCaptureFixture):
    perms = Permissions("agent-1")
    heard: list[Violation] = []
    perms.listen(heard.append)
    err = nats.errors.Error('nats: permissions violation for publish to "reach.hb.b"')
    with caplog.at_level(logging.DEBUG, logger="reach.nats"):
        for _ in range(3):
            assert perms.record(err)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "reach.hb.b" in warnings[0].getMessage()
    assert perms.count == 3
    assert len(heard) == 3
    assert perms.publish_refused("REACH.HB.B")  # compared as the server reports: lowercased
    assert not perms.publish_refused("reach.hb.a")
    assert not perms.record(nats.errors.Error("nats: slow consumer"))


def test_check_names_what_was_refused_since_a_mark():
    perms = Permissions("shopper")
    perms.check(0, "flush")  # nothing refused: nothing raised
    perms.record(nats.errors.Error('nats: permissions violation for publish to "a.b"'))
    mark = perms.count
    perms.record(nats.errors.Error('nats: permissions violation for subscription to "c.d"'))
    with pytest.raises(Unauthorized, match=r"subscribe 'c\.d'") as info:
        perms.check(mark, "flush")
    assert info.value.subject == "c.d"
    assert "a.b" not in str(info.value)


def test_credentials_come_from_settings_unless_the_url_has_its_own():
    s = ReachSettings(nats_user="agent-1", nats_password="pw")
    assert credentials(s, "nats://127.0.0.1:4222") == {"user": "agent-1", "password": "pw"}
    assert credentials(s, "nats://other:pw2@127.0.0.1:4222") == {}
    token = ReachSettings(nats_token="t0k")
    assert credentials(token, "nats://127.0.0.1:4222") == {"token": "t0k"}
    creds = ReachSettings(nats_creds="/run/secrets/agent.creds", nats_user="u")
    assert credentials(creds, "nats://127.0.0.1:4222") == {
        "user_credentials": "/run/secrets/agent.creds",
        "user": "u",
        "password": "",
    }
    assert credentials(ReachSettings(), "nats://127.0.0.1:4222") == {}


def test_passwords_never_reach_a_message():
    assert redact("nats://client:s3cret@nats:4222") == "nats://client:***@nats:4222"
    assert redact("nats://a:b@h1:1,nats://c:d@h2:2") == "nats://a:***@h1:1,nats://c:***@h2:2"
    assert redact("nats://nats:4222") == "nats://nats:4222"
