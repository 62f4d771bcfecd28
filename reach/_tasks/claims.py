"""Claims: a task with an idempotency key is claimed in ``reach_idem`` while it runs, so two
tasks with one key never run at once, and a crashed agent's claim expires (TTL ack_wait)."""

from __future__ import annotations

import logging

from .._nats import TRANSIENT
from ..settings import ReachSettings
from .model import Delivery, TaskStats
from .store import Conflict, TaskStore, idem_key

__all__ = ["Claims"]

log = logging.getLogger("reach.tasks")


class Claims:
    """Mixed into ``Executor``."""

    agent_id: str
    store: TaskStore
    settings: ReachSettings
    stats: TaskStats

    async def _put_back(self, d: Delivery, delay: float) -> None:
        raise NotImplementedError

    def claim_key(self, d: Delivery) -> str:
        """One claim per idempotency key: two tasks with the same key (a replay, a submit
        after the key's TTL) never run at once."""
        return idem_key("run", d.sub.idempotency_key)

    async def _claim(self, d: Delivery) -> bool:
        """Tasks with an idempotency key are claimed in ``reach_idem`` (create with TTL,
        renewed while running). Without a key, JetStream's ack timer is the lease: a
        message comes back only after its holder sent no ``in_progress`` for ack_wait,
        and the attempt number fences the holder if it wakes up."""
        if not d.sub.idempotency_key:
            return True
        value = f"{self.agent_id} {d.msg.metadata.num_delivered}".encode()
        try:
            d.claim_rev = await self.store.idem_claim(
                self.claim_key(d), value, self.settings.task_ack_wait
            )
        except Conflict:
            self.stats.claim_busy += 1
            await self._put_back(d, self.settings.task_ack_wait / 3)
            return False
        return True

    async def renew(self, d: Delivery) -> bool:
        """Extend our claim (the ack timer is reset by the lease loop); False when we lost
        the claim."""
        if not d.claim_rev:
            return True
        value = f"{self.agent_id} {d.n}".encode()
        try:
            d.claim_rev = await self.store.idem_renew(
                self.claim_key(d), value, self.settings.task_ack_wait, d.claim_rev
            )
        except Conflict:
            return False
        except TRANSIENT as exc:
            log.debug("task %s: claim renewal: %s", d.task_id, exc)
        return True

    async def release(self, d: Delivery) -> None:
        """Give our claim up (compare-and-set: a newer holder's claim stays); not while
        the handler runs on (``d.abandoned``): the runner releases it when it has returned."""
        if d.claim_rev and not d.abandoned:
            rev, d.claim_rev = d.claim_rev, 0
            try:
                await self.store.idem_delete(self.claim_key(d), rev)
            except Conflict:
                pass  # a newer holder's claim: theirs to release
            except TRANSIENT as exc:
                log.debug("task %s: claim release: %s", d.task_id, exc)
