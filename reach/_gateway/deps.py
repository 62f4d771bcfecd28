"""What every piece of the HTTP edge is built from: ``EdgeDeps``.

``build_app`` makes the gateway's own routes from it; ``build_edge`` adds the status page
and the A2A endpoint (routers made from the client and the shared pieces here: the token
check, the cap on open streams) and the page's feed as a background part. The client is
connected by whoever owns it: the CLI's app lifespan (``manage_client``), or a test or
application that passes a connected one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends

from .._client import Client
from .._telemetry.core import Telemetry
from .auth import Auth
from .metrics import HttpMetrics
from .settings import GatewaySettings, Scope
from .streams import StreamSlots

__all__ = ["EdgeDeps"]


@dataclass(slots=True)
class EdgeDeps:
    """The client every route uses, the gateway's settings, and what they share."""

    client: Client
    settings: GatewaySettings
    auth: Auth = field(init=False)
    #: the event streams open (task events and A2A streams), at most max_streams
    streams: StreamSlots = field(init=False)
    metrics: HttpMetrics = field(default_factory=HttpMetrics)
    _unsource: Callable[[], None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.auth = Auth(self.settings.tokens)
        self.streams = StreamSlots(self.settings.max_streams)

    @property
    def telemetry(self) -> Telemetry:
        return self.client.telemetry

    def guard(self, scope: Scope | None) -> Any:
        """A route dependency: the request's bearer token must have ``scope`` (None: any
        valid token). Use as ``dependencies=[deps.guard(Scope.CALL)]``."""
        return Depends(self.auth.require(scope))

    def timeout(self, asked: float | None) -> float | None:
        """Seconds for a call: what the request asked (already bounded), else the
        gateway's default, else None (the client's REACH_TIMEOUT_MS)."""
        return asked if asked is not None else self.settings.default_timeout

    def attach_metrics(self) -> None:
        """Report the HTTP metrics through the client's telemetry (once)."""
        if self._unsource is None:
            self._unsource = self.telemetry.add_source(self.metrics.collect)

    def detach_metrics(self) -> None:
        if self._unsource is not None:
            self._unsource()
            self._unsource = None
