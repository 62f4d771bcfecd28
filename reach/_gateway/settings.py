"""Settings of ``reach gateway``, from ``REACH_GATEWAY_*`` variables (and ``.env``).

The connection to NATS keeps using ``ReachSettings`` (``REACH_NATS_URL``, ...); these are
only the HTTP side. Tokens are a JSON object, token -> scopes::

    REACH_GATEWAY_TOKENS='{"3f9c...e1": ["call", "submit"], "a81d...07": ["admin"]}'

With no token the gateway is open, and so it refuses to listen anywhere but loopback
unless ``REACH_GATEWAY_ALLOW_OPEN=true`` says that is meant.
"""

from __future__ import annotations

from typing import Self
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from .._tokens import MIN_TOKEN_LENGTH, Scope, TokenSettings, is_loopback

__all__ = ["MIN_TOKEN_LENGTH", "GatewaySettings", "Scope", "is_loopback"]


class GatewaySettings(TokenSettings):
    """The HTTP edge's knobs: where it listens, who may use it (``TokenSettings``), how
    much it accepts."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
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
        self.check_host(self.host)
        if self.default_timeout is not None and self.default_timeout > self.max_timeout:
            raise ValueError("default_timeout must not exceed max_timeout")
        return self
