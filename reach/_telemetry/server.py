"""``/metrics`` and ``/healthz`` over plain HTTP/1.1 on the process's own event loop.

Small on purpose: two GET routes, a bounded request head, a timeout per connection, and
every connection task owned and cancelled at close (prometheus-client's own server runs
a thread nobody stops).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .._background import Background

__all__ = ["MetricsServer"]

log = logging.getLogger("reach.telemetry")

_HEAD_LIMIT = 8192
_READ_TIMEOUT = 5.0
_MAX_CONNECTIONS = 64

Health = Callable[[], tuple[bool, dict[str, object]]]


class MetricsServer:
    """Serves one registry's exposition and one health check until ``close()``."""

    def __init__(self, registry: CollectorRegistry, health: Health) -> None:
        self.registry = registry
        self.health = health
        self.host = ""
        self.port = 0
        self.served = 0
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._owner = Background("metrics server")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._accept, host, port, limit=_HEAD_LIMIT)
        sock = self._server.sockets[0].getsockname()
        self.host, self.port = sock[0], sock[1]
        log.info("metrics on %s/metrics", self.url)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._owner.close(timeout=2)
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._owner) >= _MAX_CONNECTIONS or self._owner.closed:
            self.refused += 1
            writer.close()
            return
        self._owner.spawn(self._serve(reader, writer), "connection")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                try:
                    status, ctype, body = self._route(head)
                except Exception:
                    log.exception("metrics server: %r failed", head.split(b"\r\n", 1)[0])
                    status, ctype, body = "500 Internal Server Error", "text/plain", b"failed\n"
                if head.startswith(b"HEAD "):
                    body, length = b"", len(body)
                else:
                    length = len(body)
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {length}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            self.refused += 1  # too slow, cut short or too large: no answer
        except ConnectionError:
            pass  # the scraper hung up
        finally:
            writer.close()

    def _route(self, head: bytes) -> tuple[str, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        path = parts[1].split(b"?", 1)[0]
        if path == b"/metrics":
            self.served += 1
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path in (b"/healthz", b"/health"):
            ok, details = self.health()
            body = msgspec.json.encode({"status": "ok" if ok else "unhealthy", **details})
            return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
        return "404 Not Found", "text/plain", b"try /metrics or /healthz\n"
