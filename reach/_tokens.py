"""Bearer tokens with scopes: the one check shared by the HTTP gateway and ``reach mcp
--http``, and their settings (``REACH_GATEWAY_TOKENS``, ``REACH_GATEWAY_ALLOW_OPEN``).

Tokens are a JSON object, token -> scopes::

    REACH_GATEWAY_TOKENS='{"3f9c...e1": ["call", "submit"], "a81d...07": ["admin"]}'

The SHA-256 digests of tokens are compared, in constant time and each one, so timing tells
neither a token nor its length. With no token, every caller may do everything; servers
then listen on loopback only unless ``REACH_GATEWAY_ALLOW_OPEN=true`` says that is meant.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import Unauthorized

__all__ = [
    "CHALLENGE",
    "MIN_TOKEN_LENGTH",
    "Scope",
    "TokenSettings",
    "Tokens",
    "bearer",
    "is_loopback",
]

MIN_TOKEN_LENGTH = 16
#: the header of every 401 answer, from the gateway and from ``reach mcp --http``
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="reach"'}


class Scope(enum.StrEnum):
    """What a token may do; ``admin`` may do everything."""

    CALL = "call"  # request/reply calls (the routing table and route query: any token)
    SUBMIT = "submit"  # durable tasks: submit, read, follow, cancel
    ADMIN = "admin"


class TokenSettings(BaseSettings):
    """Who may use an HTTP server of the fleet (the gateway's settings extend these)."""

    model_config = SettingsConfigDict(
        env_prefix="REACH_GATEWAY_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
        hide_input_in_errors=True,  # a ValidationError would print the tokens
    )

    #: bearer token -> scopes; empty: no authentication (loopback only, see allow_open)
    tokens: dict[str, frozenset[Scope]] = Field(
        default_factory=dict,
        repr=False,
        examples=['{"<token: 16 or more characters>": ["call", "submit"]}'],
    )
    #: listen on a non-loopback address without tokens (behind a proxy that authenticates)
    allow_open: bool = False

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, value: dict[str, frozenset[Scope]]) -> dict[str, frozenset[Scope]]:
        for token, scopes in value.items():
            if len(token) < MIN_TOKEN_LENGTH or not token.isascii() or not token.isprintable():
                raise ValueError(
                    f"every token must be at least {MIN_TOKEN_LENGTH} printable ASCII"
                    " characters (e.g. `openssl rand -hex 24`)"
                )
            if " " in token:
                raise ValueError("a token must not contain spaces")
            if not scopes:
                raise ValueError("every token needs at least one scope: call, submit or admin")
        return value

    @property
    def open(self) -> bool:
        """No authentication: every request may do everything."""
        return not self.tokens

    def check_host(self, host: str, what: str = "REACH_GATEWAY_TOKENS") -> None:
        """ValueError when a server without tokens would listen beyond loopback unasked."""
        if self.open and not self.allow_open and not is_loopback(host):
            raise ValueError(
                f"no {what} set and host {host!r} is not loopback: anyone who reaches it could"
                " call every capability. Set tokens, or REACH_GATEWAY_ALLOW_OPEN=true if"
                " something in front authenticates"
            )


class Tokens:
    """The scopes each token grants, kept as digests."""

    def __init__(self, tokens: dict[str, frozenset[Scope]]) -> None:
        self._tokens = [(_digest(t), frozenset(s)) for t, s in tokens.items()]

    @property
    def open(self) -> bool:
        return not self._tokens

    def admit(self, authorization: str | None) -> frozenset[Scope]:
        """The scopes an ``Authorization`` header grants (all of them without tokens);
        ``Unauthorized`` saying what is wrong with it otherwise (a 401, with ``CHALLENGE``)."""
        if self.open:
            return frozenset(Scope)
        if not authorization:
            raise Unauthorized("a bearer token is required")
        token = bearer(authorization)
        if token is None:
            raise Unauthorized("use 'Authorization: Bearer <token>'")
        found = self.scopes(token)
        if found is None:
            raise Unauthorized("unknown token")
        return found

    def scopes(self, token: str) -> frozenset[Scope] | None:
        """What ``token`` may do; None for an unknown token. Every token is compared."""
        given = _digest(token)
        found: frozenset[Scope] | None = None
        for known, scopes in self._tokens:
            if hmac.compare_digest(known, given):  # every token checked: no early exit
                found = scopes
        return found


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None for anything else."""
    kind, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if kind.lower() == "bearer" and token else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
