"""The pytest fixtures of ``reach.testing``, registered as the pytest plugin ``reach``
(pyproject's ``pytest11`` entry point): loaded by pytest only, so ``reach.testing`` itself
needs no pytest. Every name starts with ``reach_``, so it cannot collide with a project's
own fixtures (a ``nats_server`` of its own, say)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from ._client import Client
from ._server import NatsServer
from .settings import ReachSettings
from .testing import unique_prefix

__all__ = ["reach_client", "reach_nats_server", "reach_settings"]


@pytest.fixture(scope="session")
def reach_nats_server() -> Iterator[NatsServer]:
    """One nats-server (JetStream on, temp store, random loopback port) per test session."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def reach_settings(reach_nats_server: NatsServer) -> ReachSettings:
    """Settings pointing at the session server, with a subject prefix unique to this test."""
    return ReachSettings(nats_url=reach_nats_server.url, subject_prefix=unique_prefix())


@pytest.fixture
async def reach_client(reach_settings: ReachSettings) -> AsyncIterator[Client]:
    """A connected client on ``reach_settings``, closed after the test."""
    async with Client(settings=reach_settings, name="test-client") as client:
        yield client
