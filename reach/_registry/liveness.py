"""Silence into status: an expired lease -> UNKNOWN -> probe ``$ping`` -> UP again, or DOWN
and, after its grace period, gone. Plus the housekeeping loop that keeps memory bounded.

The server expires leases by itself (per-key TTL) and the watch reports each expiry as a
marker; every replica sees it, and a compare-and-set on the marker's revision decides which
one probes. Probes run concurrently but bounded, each an owned task.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors

from .. import _kv
from .._codec import now_ms
from .._nats import TRANSIENT
from ..wire import AgentRecord, Heartbeat, Status, Transition
from .checks import sanitize_heartbeat
from .leases import ALIVE, WRITE_FAILED, Leases
from .state import Core

__all__ = ["Liveness"]

log = logging.getLogger("reach.registry")

_pong = msgspec.json.Decoder(Heartbeat)
_NO_ANSWER: tuple[type[BaseException], ...] = (*TRANSIENT, msgspec.DecodeError)


class Liveness:
    """Reacts to expiries (``expired``) and prunes this replica's memory (``housekeeping``)."""

    def __init__(self, core: Core, leases: Leases, max_probes: int = 256) -> None:
        self.core = core
        self.leases = leases
        self._probes = asyncio.Semaphore(max_probes)

    @property
    def prune_age(self) -> float:
        """How long a record-less key is remembered (seconds): a few heartbeats."""
        return max(3 * self.core.settings.heartbeat_interval, 1.0)

    def expired(self, agent_id: str, marker_revision: int, previous: AgentRecord) -> None:
        """The server expired a lease (the watch saw its marker): decide what it means."""
        owner = self.core.owner
        if owner.closed:
            return
        if previous.status in ALIVE:
            owner.spawn(self._suspect(agent_id, marker_revision, previous), f"probe {agent_id}")
        else:
            owner.spawn(self._forget(agent_id, marker_revision, previous), f"forget {agent_id}")

    async def housekeeping(self) -> None:
        """Forever: drop what nobody needs any more, so churn leaves nothing behind."""
        core = self.core
        while True:
            await asyncio.sleep(min(core.settings.heartbeat_interval, 1.0))
            now = time.monotonic()
            core.entries.prune(now - self.prune_age)
            core.throttle.prune(now)

    async def _suspect(self, agent_id: str, marker_revision: int, previous: AgentRecord) -> None:
        core, leases = self.core, self.leases
        ttl = core.settings.lease_ttl
        record, t = leases.transition(previous, Status.UNKNOWN, f"no heartbeat for {ttl:g}s")
        try:
            await leases.write(agent_id, record, core.settings.probe_timeout + ttl, marker_revision)
        except _kv.LeaseConflict:
            return  # another replica (or a heartbeat) got there first: it owns the probe
        except TRANSIENT as exc:
            log.warning("registry: could not mark %s UNKNOWN: %s", agent_id, exc)
            return
        if t is not None:
            await leases.announce(agent_id, t, removed=False)
        pong, why = await self._probe(agent_id)
        now = now_ms()
        events: list[Transition] = []

        def change(before: AgentRecord | None) -> tuple[AgentRecord, float] | None:
            events.clear()
            if before is None or before.status != Status.UNKNOWN:
                return None  # a heartbeat or a re-registration settled it meanwhile
            if pong is not None:
                alive = pong.status if pong.status in ALIVE else Status.UP
                heartbeat = sanitize_heartbeat(pong)[0] or before.heartbeat
                new, t = leases.transition(
                    before, alive, why, heartbeat=heartbeat, last_seen_ms=now
                )
                ttl = core.settings.lease_ttl
            else:
                new, t = leases.transition(before, Status.DOWN, why)
                ttl = core.settings.down_grace
            if t is not None:
                events.append(t)
            return new, ttl

        try:
            await leases.update(agent_id, change)
        except WRITE_FAILED as exc:
            log.info("registry: probe result for %s not stored: %s", agent_id, exc)
        for ev in events:
            await leases.announce(agent_id, ev, removed=False)

    async def _probe(self, agent_id: str) -> tuple[Heartbeat | None, str]:
        """Ping the agent: (its answer, why) or (None, why not)."""
        core = self.core
        core.stats.probes += 1
        async with self._probes:
            try:
                reply = await core.conn().request(
                    core.subjects.ping(agent_id), b"", timeout=core.settings.probe_timeout
                )
                return _pong.decode(reply.data), "probe answered"
            except nats.errors.NoRespondersError:
                return None, "probe failed: no responders"
            except _NO_ANSWER:
                return None, "probe failed: timeout"

    async def _forget(self, agent_id: str, marker_revision: int, previous: AgentRecord) -> None:
        """A DOWN (or UNKNOWN) record outlived its grace period: it is gone."""
        try:
            await self.leases.remove(agent_id, last=marker_revision)
        except WRITE_FAILED:
            return  # another replica removed it, or the agent came back
        reason = "grace period over" if previous.status == Status.DOWN else "probe lost"
        t = Transition(old=previous.status, new=Status.DOWN, reason=reason, at_ms=now_ms())
        await self.leases.announce(agent_id, t, removed=True)
