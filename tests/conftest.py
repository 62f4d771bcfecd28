"""This repository's own tests call the session server ``nats_server`` (the plugin's
``reach_nats_server``, as every user's project gets it)."""

import pytest

from reach.testing import NatsServer


@pytest.fixture(scope="session")
def nats_server(reach_nats_server: NatsServer) -> NatsServer:
    return reach_nats_server
