"""Serving an ASGI app with uvicorn on a random loopback port, inside the test's loop."""

import asyncio
import contextlib
import socket

import uvicorn

from reach.testing import eventually


@contextlib.asynccontextmanager
async def serve(app, *, on_exit=None, sndbuf=None):
    """Run ``app`` on 127.0.0.1 (port 0, bound here) until the block ends; yields its base
    URL. ``on_exit`` runs first when it ends (e.g. a status feed's ``shutdown``: uvicorn
    waits for open streams before the app's lifespan ends). ``sndbuf``: the send buffer of
    every connection, in bytes (accepted sockets take the listening socket's), so that
    what a test fills does not depend on the machine's default buffer sizes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # the protocol `reach gateway` serves with
    config = uvicorn.Config(app, log_level="warning", lifespan="on", ws="none", http="httptools")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    try:
        await eventually(lambda: server.started or task.done(), timeout=15)
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("uvicorn stopped before it started")
        yield f"http://127.0.0.1:{port}"
    finally:
        if on_exit is not None:
            on_exit()
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 15)
        finally:
            sock.close()
