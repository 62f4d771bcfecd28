"""Which requests a browser could make without its user meaning to, refused before any
route runs (``EdgeMiddleware`` asks ``RequestGuard.refusal``).

A page on another site can send a POST without a CORS preflight when its body is a form or
``text/plain``, and can reach a gateway on loopback through DNS rebinding (its own name
resolving to 127.0.0.1). So: a body must be JSON (``application/json`` or ``*+json``; raw
bytes as ``application/octet-stream`` on the call route only), 415 otherwise; a request
from another origin (``Origin`` not the ``Host`` nor ``REACH_GATEWAY_PUBLIC_URL``, or
``Sec-Fetch-Site: cross-site``) is 403, except a plain navigation (a link to the page);
and an open gateway (no tokens) answers only to Host names of loopback, its configured
host and its public URL, 421 otherwise. With tokens a rebound page has no token to send.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.types import Scope

from .settings import GatewaySettings, is_loopback

__all__ = ["CALL_PREFIX", "MAX_LENGTH_DIGITS", "RequestGuard", "Seen"]

CALL_PREFIX = "/v1/capabilities/"
#: a Content-Length longer than this is no length anybody sends (2**63 has 19 digits)
MAX_LENGTH_DIGITS = 19
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
_JSON = b"application/json"
_OCTETS = b"application/octet-stream"


@dataclass(slots=True)
class Seen:
    """The headers the guard and the body limit look at, from one pass over them."""

    length: bytes | None = None
    chunked: bool = False
    content_type: bytes | None = None
    host: bytes | None = None
    origin: bytes | None = None
    site: bytes | None = None
    mode: bytes | None = None

    @classmethod
    def of(cls, scope: Scope) -> Seen:
        seen = cls()
        for name, value in scope["headers"]:
            if name == b"content-length":
                seen.length = value
            elif name == b"content-type":
                seen.content_type = value
            elif name == b"host":
                seen.host = value.lower()
            elif name == b"origin":
                seen.origin = value.lower()
            elif name == b"sec-fetch-site":
                seen.site = value
            elif name == b"sec-fetch-mode":
                seen.mode = value
            elif name == b"transfer-encoding":
                seen.chunked = True
        return seen


def _hostname(host: bytes) -> str:
    """``example:8080`` -> ``example``; ``[::1]:8080`` -> ``::1``."""
    text = host.decode("latin-1")
    if text.startswith("["):
        return text[1 : text.find("]")]
    return text.rpartition(":")[0] if ":" in text else text


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _netloc(url: str) -> bytes:
    return urlsplit(url).netloc.lower().encode()


class RequestGuard:
    """The checks above, for one gateway's settings."""

    def __init__(self, settings: GatewaySettings) -> None:
        public = settings.public_url
        self.origins = frozenset({_netloc(public)} if public else ())
        names = {settings.host.lower()}
        if public:
            names.add(urlsplit(public).hostname or "")
        #: None: any Host (tokens are configured)
        self.hosts: frozenset[str] | None = frozenset(names) if settings.open else None

    def refusal(self, scope: Scope, seen: Seen) -> HTTPException | None:
        if self.hosts is not None and seen.host is not None:
            name = _hostname(seen.host)
            if name not in self.hosts and not is_loopback(name):
                return HTTPException(
                    421, f"this gateway does not answer to host {name[:80]!r} (open gateway)"
                )
        if self._cross_site(seen) and not (scope["method"] in _SAFE and seen.mode == b"navigate"):
            return HTTPException(403, "cross-site requests are refused")
        if scope["method"] in _SAFE:
            return None
        if seen.content_type is None or not seen.content_type.strip():
            if seen.chunked or (seen.length is not None and seen.length.strip(b"0")):
                return HTTPException(415, "a body needs Content-Type: application/json")
            return None
        media = seen.content_type.partition(b";")[0].strip().lower()
        if media == _JSON or (media.startswith(b"application/") and media.endswith(b"+json")):
            return None
        if media == _OCTETS and _route_path(scope).startswith(CALL_PREFIX):
            return None
        return HTTPException(
            415,
            f"bodies are JSON: send Content-Type: application/json (`curl --json`), not"
            f" {media.decode('latin-1')[:60]!r}",
        )

    def _cross_site(self, seen: Seen) -> bool:
        if seen.site == b"cross-site":
            return True
        if seen.origin is None:
            return False
        netloc = seen.origin.partition(b"://")[2]
        return not netloc or (netloc != seen.host and netloc not in self.origins)
