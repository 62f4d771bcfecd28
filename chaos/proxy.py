"""A loopback TCP proxy that can partition what goes through it.

    proxy = await Proxy(server.url).start()   # then connect to proxy.url
    proxy.pause()    # nothing is forwarded either way; every socket stays open
    proxy.resume()   # what was held back flows on
    proxy.cut()      # every connection through it is reset (each side sees it lost)

A paused proxy is a network partition, not a crash: neither side sees a reset or an EOF,
so the server still counts the agent's subscriptions as live (no "no responders" for it),
and requests sent to it vanish until their deadline.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

__all__ = ["Proxy"]

_CHUNK = 64 * 1024


class Proxy:
    """Listens on a random 127.0.0.1 port and forwards each connection to ``target`` (a
    ``nats://host:port`` URL). Every task it runs is its own and ends with ``close()``."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.target_host = parts.hostname or "127.0.0.1"
        self.target_port = int(parts.port or 4222)
        self.port = 0
        #: connections accepted so far, and times ``cut`` reset them
        self.connections = 0
        self.cuts = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def paused(self) -> bool:
        return not self._flowing.is_set()

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def pause(self) -> None:
        """Stop forwarding in both directions; the sockets stay open, the bytes wait."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        """Reset every connection through the proxy now; new ones are taken as before."""
        self.cuts += 1
        for w in list(self._writers):
            w.transport.abort()

    async def _accept(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(down_w)
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            down_w.close()  # the server is down: so is the proxied connection
            self._writers.discard(down_w)
            return
        self._writers.add(up_w)
        for src, dst in ((down_r, up_w), (up_r, down_w)):
            task = asyncio.ensure_future(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Copy ``src`` to ``dst`` while flowing; an end or error on either side closes
        ``dst`` (the pump of the other direction then sees its end too)."""
        try:
            while data := await src.read(_CHUNK):
                await self._flowing.wait()  # paused: hold the bytes, read no more
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass  # a reset on either side ends the connection, as it would without us
        finally:
            dst.close()
            self._writers.discard(dst)

    async def close(self) -> None:
        """Stop listening, close every connection, and await every pump."""
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Proxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
