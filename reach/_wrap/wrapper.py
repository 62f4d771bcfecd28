"""An ordinary Reach agent whose capabilities are HTTP endpoints: it registers, heartbeats,
reports load, takes priorities and drains like any other, and forwards each request with one
pooled ``httpx.AsyncClient``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self

import httpx

from .._agent import Agent, Context
from .._background import Background
from .._runtime import on_stop_signals
from .._telemetry.core import Telemetry
from ..errors import NotStarted
from ..settings import ReachSettings
from .forward import Forwarder, WrapStats
from .health import HealthMonitor
from .spec import Endpoint, WrapSpec

__all__ = ["HttpWrapper"]

log = logging.getLogger("reach.wrap")


class HttpWrapper:
    """Serve every endpoint of ``spec`` as a capability of one agent (``self.agent``).

    The HTTP pool holds ``max_concurrency`` connections (one more for the health probe), as
    many as the agent has workers, so a request never waits for a connection. The pool and
    the probe loop are opened by ``start`` and closed by ``stop``; ``serve_forever`` runs
    until SIGTERM/SIGINT or ``reach drain``, then drains and closes all of it.
    """

    def __init__(
        self,
        spec: WrapSpec,
        *,
        settings: ReachSettings | None = None,
        telemetry: Telemetry | None = None,
        url: str | None = None,
        drain_timeout: float | None = None,
    ) -> None:
        self.spec = spec
        self.stats = WrapStats()
        self.agent = Agent(
            spec.agent_name,
            spec.agent_id,
            tags=spec.tags,
            max_concurrency=spec.max_concurrency,
            version=spec.version,
            description=spec.description,
            metadata={"wrapped": "http"},
            settings=settings,
            telemetry=telemetry,
            url=url,
            drain_timeout=drain_timeout,
        )
        for ep in spec.endpoints:
            description = ep.description or f"HTTP {ep.method.upper()} endpoint, wrapped"
            self.agent.capability(ep.capability, version=ep.version, description=description)(
                self._handler(ep)
            )
        self._http: httpx.AsyncClient | None = None
        self._forwarder: Forwarder | None = None
        self._owner = Background(f"wrap {self.agent.agent_id}")
        self._probing: asyncio.Task[Any] | None = None
        self._closing: asyncio.Future[None] | None = None
        #: the health loop's state, while running with a health check
        self.health: HealthMonitor | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise NotStarted("the wrapper is not running")
        return self._http

    def _handler(self, ep: Endpoint) -> Callable[[bytes, Context], Awaitable[Any]]:
        async def serve(payload: bytes, ctx: Context) -> Any:
            if self._forwarder is None:
                raise NotStarted("the wrapper is not running")
            return await self._forwarder(ep, payload, ctx)

        serve.__name__ = f"wrap_{ep.capability.replace('.', '_')}"
        return serve

    def _pool(self) -> httpx.AsyncClient:
        size = self.spec.max_concurrency + (1 if self.spec.health is not None else 0)
        # trust_env=False: HTTP(S)_PROXY and .netrc in the environment do not reroute or
        # authenticate wrapped traffic. Idle connections are dropped after 2 s, before a
        # server's own keep-alive timeout (uvicorn's is 5 s) closes one under a request.
        return httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=size, max_keepalive_connections=size, keepalive_expiry=2.0
            ),
            timeout=httpx.Timeout(max(e.timeout for e in self.spec.endpoints)),
            follow_redirects=False,
            trust_env=False,
        )

    async def start(self) -> None:
        """Open the pool, probe the health once, start the agent (DEGRADED or PAUSED at
        once if that probe failed), then the probe loop and the watch for a drain."""
        if self._http is not None:
            return
        http = self._http = self._pool()
        check = self.spec.health
        monitor = None if check is None else HealthMonitor(self.agent, http, check)
        # Ready before the agent: it takes requests as soon as its subscriptions are live.
        self._forwarder = Forwarder(http, self.stats, self.spec.max_body)
        try:
            first = "" if monitor is None else await monitor.probe()
            await self.agent.start()
            self._owner.reopen()
            if monitor is not None:
                self.health = monitor
                await monitor.record(first)
                self._probing = self._owner.keep(monitor.run, "health")
            self._owner.spawn(self._follow(), "follow")
        except BaseException:
            await self.stop()
            raise
        log.info("wrap %s: %s", self.agent.agent_id, self.spec.describe())

    async def _follow(self) -> None:
        """A drain asked of the agent itself (``$ctl drain``): stop probing, let the agent
        finish its work and stop, then close the pool, as ``stop`` would."""
        await self.agent.wait_drain_requested()
        probing, self._probing = self._probing, None
        if probing is not None:
            probing.cancel()
            await asyncio.wait([probing])
        await self.agent.stop()
        await self._close_pool()

    async def _close_pool(self) -> None:
        """Close the pool once; ``stop`` cancelling ``_follow`` midway waits for it too."""
        http, self._http = self._http, None
        self._forwarder = None
        if http is not None:
            self._closing = asyncio.ensure_future(http.aclose())
        closing = self._closing
        if closing is not None:
            await asyncio.shield(closing)
            self._closing = None

    async def stop(self) -> None:
        """Stop probing, drain the agent (in-flight requests finish), close the pool."""
        await self._owner.close()
        self._probing = None
        try:
            await self.agent.stop()
        finally:
            await self._close_pool()

    async def serve_forever(self) -> None:
        """Serve until SIGTERM/SIGINT, ``reach drain <agent_id>`` or cancellation; a second
        Ctrl-C while it drains ends the process at once (status 130)."""
        draining = f"draining in-flight requests for up to {self.agent.drain_timeout:g}s"
        # The drain is inside the block: a second Ctrl-C during it is heard.
        with on_stop_signals(lambda _: self.agent.request_drain(), draining=draining):
            await self.start()
            try:
                await self.agent.wait_drain_requested()
            finally:
                await self.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
