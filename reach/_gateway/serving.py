"""uvicorn's httptools protocol with a response's writes joined into one ``send``.

An ASGI response is at least two messages, its head and its body, and uvicorn writes each
to the socket when it comes: two system calls and often two TCP segments for one small
answer, the largest single cost of a call through the gateway. Writes made in one turn of
the event loop are joined here and written once at the end of the turn, in order; a close
writes what is held first, and so does a write that brings what is held past
``HOLD_LIMIT``, so a long streamed answer still meets the transport's flow control.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HOLD_LIMIT", "JoinedWrites", "JoinedWritesProtocol"]

HOLD_LIMIT = 64 * 1024


class JoinedWrites:
    """A transport whose ``write`` holds data until the loop's current turn ends."""

    __slots__ = ("_held", "_loop", "_size", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        chunk = bytes(data)
        self._held.append(chunk)
        self._size += len(chunk)
        if self._size > HOLD_LIMIT:
            self.flush()

    def writelines(self, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        held = self._held
        if held:
            self._held, self._size = [], 0
            if not self._transport.is_closing():
                self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def get_write_buffer_size(self) -> int:
        return self._size + self._transport.get_write_buffer_size()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held, self._size = [], 0
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class JoinedWritesProtocol(HttpToolsProtocol):
    """``uvicorn.Config(http=JoinedWritesProtocol)``."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        joined = JoinedWrites(cast(asyncio.Transport, transport), self.loop)
        super().connection_made(cast(asyncio.Transport, joined))
