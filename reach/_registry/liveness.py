"""Silence into status: an expired lease -> UNKNOWN -> probe ``$ping`` -> UP again, or DOWN
and, after its grace period, gone. Plus the housekeeping loop that keeps memory bounded.

The server expires leases by itself (per-key TTL) and the watch reports each expiry as a
marker; every replica sees it, and a compare-and-set on the marker's revision decides which
one probes. Expiries wait in a queue (one item per expired key, so as bounded as the bucket)
served by at most ``max_probes`` owned workers, started when there is work and gone when
there is none: a mass expiry costs a bounded number of tasks and concurrent KV writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import msgspec

from .. import _kv
from .._codec import now_ms
from .._nats import TRANSIENT, is_no_responders
from ..wire import PROBE_NO_RESPONDERS, AgentRecord, Heartbeat, Status, Transition
from .checks import sanitize_heartbeat
from .state import Core
from .writer import ALIVE, WRITE_FAILED, RecordWriter

__all__ = ["Liveness"]

log = logging.getLogger("reach.registry")

_pong = msgspec.json.Decoder(Heartbeat)
_NO_ANSWER: tuple[type[BaseException], ...] = (*TRANSIENT, msgspec.DecodeError)


class Liveness:
    """Reacts to expiries (``expired``) and prunes this replica's memory (``housekeeping``)."""

    def __init__(self, core: Core, writer: RecordWriter, max_probes: int = 256) -> None:
        self.core = core
        self.writer = writer
        self.max_probes = max_probes
        self.reset()

    def reset(self) -> None:
        """Forget queued work (the registry starts again; its workers are gone)."""
        self._queue: deque[tuple[str, int, AgentRecord]] = deque()
        self._workers: set[asyncio.Task[Any]] = set()

    @property
    def queued(self) -> int:
        """Expiries waiting for a worker."""
        return len(self._queue)

    @property
    def prune_age(self) -> float:
        """How long a record-less key is remembered (seconds): a few heartbeats."""
        return max(3 * self.core.settings.heartbeat_interval, 1.0)

    def expired(self, agent_id: str, marker_revision: int, previous: AgentRecord) -> None:
        """The server expired a lease (the watch saw its marker): decide what it means."""
        if self.core.owner.closed:
            return
        self._queue.append((agent_id, marker_revision, previous))
        self._staff()

    def _staff(self) -> None:
        owner, workers = self.core.owner, self._workers
        if owner.closed or len(workers) >= self.max_probes:
            return
        task = owner.spawn(self._work(), "liveness")
        workers.add(task)
        task.add_done_callback(self._worker_done)

    def _worker_done(self, task: asyncio.Task[Any]) -> None:
        self._workers.discard(task)
        if self._queue:
            self._staff()  # a worker that failed (logged by the owner) leaves work behind

    async def _work(self) -> None:
        queue = self._queue
        try:
            while queue:
                agent_id, marker_revision, previous = queue.popleft()
                if previous.status in ALIVE:
                    await self._suspect(agent_id, marker_revision, previous)
                else:
                    await self._forget(agent_id, marker_revision, previous)
        finally:
            # Leave at once (no await after the last look), so new work staffs a worker.
            me = asyncio.current_task()
            if me is not None:
                self._workers.discard(me)

    async def housekeeping(self) -> None:
        """Forever: drop what nobody needs any more, so churn leaves nothing behind."""
        core = self.core
        while True:
            await asyncio.sleep(min(core.settings.heartbeat_interval, 1.0))
            now = time.monotonic()
            core.entries.prune(now - self.prune_age)
            core.throttle.prune(now)

    async def _suspect(self, agent_id: str, marker_revision: int, previous: AgentRecord) -> None:
        core, writer = self.core, self.writer
        ttl = core.settings.lease_ttl
        record, t = writer.transition(previous, Status.UNKNOWN, f"no heartbeat for {ttl:g}s")
        try:
            await writer.write(agent_id, record, core.settings.probe_timeout + ttl, marker_revision)
        except _kv.Conflict:
            return  # another replica (or a heartbeat) got there first: it owns the probe
        except WRITE_FAILED as exc:  # the server away, or a record over max_payload
            log.warning("registry: could not mark %s UNKNOWN: %s", agent_id, exc)
            return
        if t is not None:
            await writer.announce(agent_id, t, removed=False)
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
                detail = heartbeat.reason if heartbeat is not None else ""
                new, t = writer.transition(
                    before, alive, why, detail, heartbeat=heartbeat, last_seen_ms=now
                )
                ttl = core.settings.lease_ttl
            else:
                new, t = writer.transition(before, Status.DOWN, why)
                ttl = core.settings.down_grace
            if t is not None:
                events.append(t)
            return new, ttl

        try:
            await writer.update(agent_id, change)
        except WRITE_FAILED as exc:
            log.info("registry: probe result for %s not stored: %s", agent_id, exc)
        for ev in events:
            await writer.announce(agent_id, ev, removed=False)

    async def _probe(self, agent_id: str) -> tuple[Heartbeat | None, str]:
        """Ping the agent: (its answer, why) or (None, why not)."""
        core = self.core
        core.stats.probes += 1
        try:
            reply = await core.conn().request(
                core.subjects.ping(agent_id), b"", timeout=core.settings.probe_timeout
            )
            answer = _pong.decode(reply.data)
            core.cells.probed("answered")
            return answer, "probe answered"
        except _NO_ANSWER as exc:
            if is_no_responders(exc):
                core.cells.probed("no_responders")
                return None, PROBE_NO_RESPONDERS
            core.cells.probed("timeout")
            return None, "probe failed: timeout"

    async def _forget(self, agent_id: str, marker_revision: int, previous: AgentRecord) -> None:
        """A DOWN (or UNKNOWN) record outlived its grace period: it is gone."""
        try:
            await self.writer.remove(agent_id, last=marker_revision)
        except WRITE_FAILED:
            return  # another replica removed it, or the agent came back
        reason = "grace period over" if previous.status == Status.DOWN else "probe lost"
        t = Transition(old=previous.status, new=Status.DOWN, reason=reason, at_ms=now_ms())
        await self.writer.announce(agent_id, t, removed=True)
