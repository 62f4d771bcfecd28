"""Opening a JetStream store (the task store, the topic store) on a connection: the one way
an agent's runners and a client's task and topic sides do it.

``open_store`` gives the store a request inbox of its own (``JsApi``) and makes its streams
when missing, waiting out a JetStream that cannot answer yet; when that fails the inbox is
closed again (not left behind) and a failure that was a refusal by permissions is said
as one. A client opens its stores lazily, once per connection: ``PerConnection`` holds
one, under a lock, so concurrent first calls open it once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from .._jsapi import JsApi
from .._nats import TRANSIENT, NatsConnection, check_refused, refusals
from .faults import patiently

__all__ = ["PerConnection", "open_store"]


class Store(Protocol):
    @property
    def api(self) -> JsApi | None: ...

    async def ensure(self) -> None: ...


S = TypeVar("S", bound=Store)


async def open_store(
    nc: NatsConnection,
    what: str,
    make: Callable[[JsApi], S],
    *,
    until: float,
    stopped: Callable[[], bool],
    timeout: float = 5.0,
) -> S:
    """``make(api)`` on ``nc`` with its own request inbox (requests of ``timeout``
    seconds), its streams made when missing (``ensure``, tried again while JetStream
    cannot answer, up to the monotonic time ``until`` or ``stopped()``)."""
    mark = refusals(nc)
    api = JsApi(nc, timeout=timeout)
    try:
        await api.open()
        store = make(api)
        await patiently(nc, what, store.ensure, until=until, stopped=stopped)
    except BaseException as exc:  # a cancel too: the inbox is not left on the connection
        await api.close()  # its inbox and listener (bounded by the inbox)
        check_refused(nc, what, exc, since=mark)
        raise
    return store


class PerConnection(Generic[S]):
    """A client's store, opened by ``open(nc)`` on first use and again for another
    connection (the old one's request inbox closed); ``close`` when the client closes."""

    def __init__(self, open: Callable[[NatsConnection], Awaitable[S]]) -> None:
        self._open = open
        self.nc: NatsConnection | None = None
        self.store: S | None = None
        #: closed by the client (until it opens again): a setup under way stops waiting
        self.closed = False
        self._lock = asyncio.Lock()

    async def get(self, nc: NatsConnection) -> S:
        """The store on ``nc``, opened now if it is not yet."""
        if self.store is not None and self.nc is nc:
            return self.store
        async with self._lock:
            store = self.store
            if store is None or self.nc is not nc:
                await self._drop()
                store = await self._open(nc)
                self.nc, self.store = nc, store
                self.closed = False
            return store

    async def close(self) -> None:
        self.closed = True
        await self._drop()

    async def _drop(self) -> None:
        store, self.store, self.nc = self.store, None, None
        if store is not None and store.api is not None:
            with contextlib.suppress(*TRANSIENT):  # its connection is gone: so is its inbox
                await store.api.close()
