"""What a wrapper serves, as data: the endpoints, the health check and the agent around them,
from arguments or from a TOML file (``reach wrap --config wrap.toml``)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from .._subjects import validate_agent_id, validate_capability
from ..errors import ConfigurationError

__all__ = [
    "METHODS",
    "Endpoint",
    "HealthCheck",
    "WrapSpec",
    "build_spec",
    "load_config",
    "redact",
]

#: the HTTP methods a wrapped endpoint may use; GET sends the payload as query parameters
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})


#: headers Reach sets itself (with any ``Reach-*`` name), or HTTP's framing: refused in
#: an endpoint's own headers
RESERVED_HEADERS = frozenset(
    {
        "idempotency-key",
        "traceparent",
        "tracestate",
        "content-type",
        "content-length",
        "transfer-encoding",
        "connection",
        "host",
    }
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _check_headers(headers: dict[str, str]) -> None:
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"header {name!r} is not a valid header name")
        low = name.lower()
        if low.startswith("reach-") or low in RESERVED_HEADERS:
            raise ValueError(f"header {name!r} is set by Reach; declare another")
        if _CONTROL.search(value):
            raise ValueError(f"header {name!r}: its value has control characters")


def redact(url: str) -> str:
    """``url`` fit for logs: no user or password, and the query (an API key, often) as
    ``?…``."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}" + ("?…" if parts.query else "")


def _check_url(url: str, what: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {redact(url)!r} is not an http(s) URL with a host")


class Endpoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One capability served by one HTTP endpoint."""

    capability: str
    url: str
    method: str = "POST"
    #: seconds to wait for the endpoint; a caller's earlier deadline shortens it
    timeout: float = 5.0
    version: str = "1.0.0"
    description: str = ""
    #: sent with every request (an API key of the wrapped service, say); Reach's own names
    #: (``Reach-*``, ``Idempotency-Key``, trace context) and HTTP's framing are refused
    headers: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_capability(self.capability)
        _check_url(self.url, "url")
        if self.method.upper() not in METHODS:
            raise ValueError(f"method {self.method!r}: use one of {', '.join(sorted(METHODS))}")
        if not self.timeout > 0:
            raise ValueError("timeout must be > 0 seconds")
        _check_headers(self.headers)


class HealthCheck(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A GET on ``url`` every ``interval`` seconds: any 2xx answer within ``timeout`` is
    healthy. One failure makes the agent DEGRADED; ``pause_after`` in a row make it PAUSED
    (0: never). The first success afterwards brings it back."""

    url: str
    interval: float = 5.0
    timeout: float = 2.0
    pause_after: int = 3

    def __post_init__(self) -> None:
        _check_url(self.url, "health url")
        if not (self.interval > 0 and self.timeout > 0):
            raise ValueError("health interval and timeout must be > 0 seconds")
        if self.pause_after < 0:
            raise ValueError("pause_after must be >= 0 (0: never pause)")


class WrapSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One agent serving every endpoint, with one connection pool and one health check."""

    endpoints: list[Endpoint]
    #: the agent name (default: ``wrap-`` and the first capability, dots as dashes)
    name: str = ""
    agent_id: str | None = None
    max_concurrency: int = 8
    #: the largest answer body taken (bytes, decompressed); 0: the NATS connection's
    #: ``max_payload``, since a larger result could not be sent back anyway
    max_body: int = 0
    tags: list[str] = msgspec.field(default_factory=list)
    version: str = "1.0.0"
    description: str = ""
    health: HealthCheck | None = None

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("declare at least one endpoint")
        caps = [e.capability for e in self.endpoints]
        if len(set(caps)) != len(caps):
            raise ValueError("each capability may be wrapped once")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.max_body < 0:
            raise ValueError("max_body must be >= 0 (0: the connection's max_payload)")
        validate_agent_id(self.agent_name)
        if self.agent_id is not None:
            validate_agent_id(self.agent_id)

    def describe(self) -> str:
        """Its endpoints for logs, with their URLs redacted."""
        return ", ".join(
            f"{e.capability} -> {e.method.upper()} {redact(e.url)}" for e in self.endpoints
        )

    @property
    def agent_name(self) -> str:
        return self.name or "wrap-" + self.endpoints[0].capability.replace(".", "-")


def build_spec(data: dict[str, Any], source: str = "arguments") -> WrapSpec:
    """A spec from plain data (parsed TOML, or arguments); ConfigurationError says what is
    wrong and where."""
    try:
        return msgspec.convert(data, WrapSpec)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigurationError(f"{source}: {exc}") from None


def load_config(path: str | Path) -> WrapSpec:
    """Read a wrap file: top-level agent keys, an optional ``[health]`` table and one
    ``[[endpoints]]`` table per capability (see reach/examples/wrap.toml)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"{path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{path}: not valid TOML: {exc}") from None
    return build_spec(data, str(path))
