"""The registry: agent leases in KV, heartbeats into status, probes, list and route.

Rooms: ``service`` (the ``Registry`` facade: start, stop, subscriptions), ``leases``
(compare-and-set writes and transitions), ``api`` (register, deregister, list, route),
``heartbeats`` (intake and checks), ``liveness`` (suspect, probe, forget, housekeeping),
``state`` (the bounded in-memory view) and ``checks`` (pure input validation).
"""

from .service import Registry
from .state import RegistryStats

__all__ = ["Registry", "RegistryStats"]
