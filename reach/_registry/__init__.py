"""The registry: agent leases in KV, heartbeats into status, probes, list and route.

Rooms, from the top down: ``service`` (the ``Registry`` facade: start, stop,
subscriptions); ``api`` (register, deregister, list, route), ``heartbeats`` (intake and
checks) and ``liveness`` (suspect, probe, forget, housekeeping); ``writer`` (every
compare-and-set write of an agent record, its transitions and events); ``state`` (the
bounded in-memory view); ``observe`` (the metrics source, reading a ``RegistryView``);
``counters`` (what a registry counts), ``checks`` (pure input validation) and ``news``
(pure: which heartbeats are written, and when a lease is renewed). Each imports only rooms
below it.
"""

from .counters import RegistryStats
from .service import Registry

__all__ = ["Registry", "RegistryStats"]
