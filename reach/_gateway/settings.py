"""Settings of ``reach gateway``, from ``REACH_GATEWAY_*`` variables (and ``.env``).

The connection to NATS keeps using ``ReachSettings`` (``REACH_NATS_URL``, ...); these are
only the HTTP side. Tokens are a JSON object, token -> scopes::

    REACH_GATEWAY_TOKENS='{"3f9c...e1": ["call", "submit"], "a81d...07": ["admin"]}'

With no token the gateway is open, and so it refuses to listen anywhere but loopback
unless ``REACH_GATEWAY_ALLOW_OPEN=true`` says that is meant.
"""

from __future__ import annotations

import enum
import ipaddress
from typing import Self
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["MIN_TOKEN_LENGTH", "GatewaySettings", "Scope"]

MIN_TOKEN_LENGTH = 16


class Scope(enum.StrEnum):
    """What a token may do; ``admin`` may do everything."""

    CALL = "call"  # request/reply calls (the routing table and route query: any token)
    SUBMIT = "submit"  # durable tasks: submit, read, follow, cancel
    ADMIN = "admin"


class GatewaySettings(BaseSettings):
    """The HTTP edge's knobs: where it listens, who may use it, how much it accepts."""

    model_config = SettingsConfigDict(
        env_prefix="REACH_GATEWAY_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    #: bearer token -> scopes; empty: no authentication (loopback only, see allow_open)
    tokens: dict[str, frozenset[Scope]] = Field(default_factory=dict, repr=False)
    #: listen on a non-loopback address without tokens (behind a proxy that authenticates)
    allow_open: bool = False
    #: request bodies above this are refused (413) before they are parsed
    max_body_bytes: int = Field(default=1024 * 1024, ge=1, le=64 * 1024 * 1024)
    #: seconds a call may take when the request names none; None: REACH_TIMEOUT_MS
    default_timeout: float | None = Field(default=None, gt=0)
    #: the longest timeout a request may ask for (seconds)
    max_timeout: float = Field(default=300.0, gt=0)
    #: seconds between keep-alive comments on an idle event stream
    sse_ping: float = Field(default=15.0, gt=0)
    #: seconds a stopping gateway waits for requests in flight (event streams included);
    #: uvicorn counts whole seconds, so this is rounded up
    shutdown_grace: float = Field(default=5.0, gt=0)
    #: processes serving the gateway on one port, each with its own NATS connection; one
    #: per core the gateway may use (``reach gateway --workers``)
    workers: int = Field(default=1, ge=1, le=64)
    #: event streams open at once (task events and A2A streams, each holds a KV watch);
    #: past it 503 with Retry-After
    max_streams: int = Field(default=256, ge=1, le=100_000)
    #: where clients reach the gateway (``https://gw.example``), behind a proxy: written in
    #: the A2A cards, accepted as Origin and (open gateway) as Host; None: the request's Host
    public_url: str | None = None

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

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"public_url {value!r} must be an http(s) URL, e.g. https://gw.example"
            )
        if parts.query or parts.fragment:
            raise ValueError("public_url takes no query or fragment")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _open_only_on_loopback(self) -> Self:
        if not self.tokens and not self.allow_open and not is_loopback(self.host):
            raise ValueError(
                f"no REACH_GATEWAY_TOKENS set and host {self.host!r} is not loopback: anyone"
                " who reaches it could call every capability. Set tokens, or"
                " REACH_GATEWAY_ALLOW_OPEN=true if something in front authenticates"
            )
        if self.default_timeout is not None and self.default_timeout > self.max_timeout:
            raise ValueError("default_timeout must not exceed max_timeout")
        return self

    @property
    def open(self) -> bool:
        """No authentication: every request may do everything."""
        return not self.tokens


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
