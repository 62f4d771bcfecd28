"""NATS URLs are checked before a connect is tried, and shown without secrets: pure logic."""

from __future__ import annotations

import re
import socket
import ssl

import nats.errors
import pytest

from reach._nats import unreachable
from reach._urls import check_servers, redact

SECRET = "s3cret-pw"


@pytest.mark.parametrize(
    ("url", "servers"),
    [
        ("nats://127.0.0.1:4222", ["nats://127.0.0.1:4222"]),
        ("tls://nats.example:4443", ["tls://nats.example:4443"]),
        ("nats://nats", ["nats://nats"]),  # nats-py adds the default port
        ("ws://h", ["ws://h"]),
        ("wss://h:443", ["wss://h:443"]),
        ("NATS://h:4222", ["NATS://h:4222"]),
        ("nats://[::1]:4222", ["nats://[::1]:4222"]),
        ("nats://u:pw@h:4222", ["nats://u:pw@h:4222"]),
        ("nats://a:4222,nats://b:4222", ["nats://a:4222", "nats://b:4222"]),
        (" nats://a:4222 , tls://b:4222 ,", ["nats://a:4222", "tls://b:4222"]),
        ("nats://h:65535", ["nats://h:65535"]),
    ],
)
def test_good_urls_give_their_servers(url, servers):
    assert check_servers(url) == servers


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "empty: set REACH_NATS_URL"),
        ("  ", "reach up"),
        (" , ", "empty"),
        ("nats://", "names no host; write nats://host:4222"),
        (f"nats://u:{SECRET}@", "names no host"),
        ("nats://h:abc", "port must be a number from 1 to 65535"),
        (f"nats://u:{SECRET}@h:abc", "nats://h:4222"),
        ("nats://h:0", "1 to 65535"),
        ("nats://h:70000", "1 to 65535"),
        ("http://127.0.0.1:4222", "scheme 'http'; use one of nats://, tls://, ws://, wss://"),
        ("localhost:4222", "no scheme: write nats://localhost:4222"),
        ("nats://a:4222,nats://b:x", "port"),
        ("nats://a:4222,ws://b:80", "mixes websocket"),
        ("nats://[::1:4222", "not a URL"),
    ],
)
def test_bad_urls_are_refused_with_the_fix(url, says):
    with pytest.raises(ValueError, match=re.escape(says)) as info:
        check_servers(url)
    assert SECRET not in str(info.value)


def test_passwords_and_tokens_never_reach_a_message():
    assert redact(f"nats://client:{SECRET}@nats:4222") == "nats://client:***@nats:4222"
    assert redact("nats://a:b@h1:1,nats://c:d@h2:2") == "nats://a:***@h1:1,nats://c:***@h2:2"
    assert redact("nats://u:p@ss@h:4222") == "nats://u:***@h:4222"  # an @ in the password
    assert redact("nats://t0ken@h:4222") == "nats://***@h:4222"  # token auth
    assert redact("nats://nats:4222") == "nats://nats:4222"


@pytest.mark.parametrize(
    ("failure", "reason", "fix"),
    [
        (ConnectionRefusedError(111, "Connection refused"), "connection refused", "reach up"),
        (socket.gaierror(-2, "Name or service not known"), "host not found", "host name"),
        (TimeoutError(), "no answer", "REACH_CONNECT_TIMEOUT"),
        (ssl.SSLError(1, "WRONG_VERSION_NUMBER"), "TLS failed", "nats://"),
        (OSError(113, "No route to host"), "No route to host", "REACH_NATS_URL"),
        (
            nats.errors.Error("nats: empty response from server when expecting INFO message"),
            "empty response from server",
            "client port",
        ),
    ],
)
def test_a_failed_connect_says_why_and_what_to_do(failure, reason, fix):
    said_reason, said_fix = unreachable(failure)
    assert reason in said_reason
    assert fix in said_fix
    assert "\n" not in said_reason + said_fix


def test_a_connection_failure_never_carries_a_password_in_its_url():
    from reach.errors import ConnectionFailed

    err = ConnectionFailed("lost", url="nats://user:s3cret@127.0.0.1:4222")
    assert "s3cret" not in err.url
    assert err.url == "nats://user:***@127.0.0.1:4222"
