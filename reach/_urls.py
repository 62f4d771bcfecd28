"""NATS server URLs: checked before a connection is tried, and redacted wherever shown.

Pure string work, apart from the connection code so that settings (whose repr redacts the
URL) and the CLI can use it without importing nats-py. nats-py itself reads a bad URL
badly: an empty server list makes its connect loop spin without yielding, and ``nats://``
or a port that is not a number raise a bare ``nats.errors.Error``.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["SCHEMES", "check_servers", "redact"]

#: the schemes nats-py connects with (it refuses to mix the websocket ones with the others)
SCHEMES = ("nats", "tls", "ws", "wss")

_FIX = "set REACH_NATS_URL (or --url) to e.g. nats://127.0.0.1:4222"


def redact(url: str) -> str:
    """``url`` with any password or token replaced by ``***`` (for messages and logs).

    ``user:password@`` keeps the user; a lone ``token@`` (NATS token auth) is hidden whole."""
    url = re.sub(r"(://[^:/@,]*):[^/,]*@", r"\1:***@", url)
    return re.sub(r"://[^:/@,]+@", "://***@", url)


def check_servers(url: str) -> list[str]:
    """The servers in ``url`` (one URL, or the comma-separated nodes of a cluster), each
    checked; ``ValueError`` with a sentence naming the fix for the first that is wrong."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"the NATS URL is empty: {_FIX} (or run `reach up` for a local server)")
    for server in servers:
        _check(server)
    if len({urlsplit(s).scheme in ("ws", "wss") for s in servers}) > 1:
        raise ValueError(
            f"{redact(url)!r} mixes websocket (ws, wss) and nats/tls URLs; nats-py takes one kind"
        )
    return servers


def _check(server: str) -> None:
    shown = redact(server)
    if "://" not in server:
        raise ValueError(f"NATS URL {shown!r} has no scheme: write nats://{shown}")
    try:
        parts = urlsplit(server)
    except ValueError:  # an unclosed [ of an IPv6 address, say
        raise ValueError(f"NATS URL {shown!r} is not a URL; write nats://host:4222") from None
    try:
        port = parts.port  # ValueError: not a number, or out of 0..65535
    except ValueError:
        port = -1
    if parts.scheme.lower() not in SCHEMES:
        raise ValueError(
            f"NATS URL {shown!r} has scheme {parts.scheme!r}; use one of "
            f"{', '.join(s + '://' for s in SCHEMES)} (e.g. nats://host:4222)"
        )
    if not parts.hostname:
        raise ValueError(f"NATS URL {shown!r} names no host; write {parts.scheme}://host:4222")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(
            f"NATS URL {shown!r}: the port must be a number from 1 to 65535 "
            f"(e.g. {parts.scheme}://{parts.hostname}:4222)"
        )
