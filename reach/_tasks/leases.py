"""Keeping running tasks' leases, and stopping them: the runner's half that watches.

Every ack_wait/3 each running task's ack timer is reset (``in_progress``) and its claim
renewed; a task whose record moved on (a newer attempt) is stopped as fenced, one whose
record asks for a cancel is cancelled. The cancel message stops it at once; the record
catches an agent that missed the message. A handler that ignored its cancellation
(``abandoned``) has its message settled already: only its claim is renewed, until it returns.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from .._nats import TRANSIENT
from ..errors import CorruptRecord
from ..settings import ReachSettings
from ..wire import Priority
from .execute import Executor
from .model import Delivery, TaskStats
from .pull import Puller
from .states import can_write
from .store import Stored

__all__ = ["Leases"]

log = logging.getLogger("reach.tasks")


class Leases:
    """Mixed into ``TaskRunner``."""

    settings: ReachSettings
    stats: TaskStats
    running: dict[str, Delivery]
    _exec: Executor | None
    _pullers: dict[tuple[str, Priority], Puller]

    async def _keep_leases(self) -> None:
        """Every ack_wait/3: reset every held or running message's ack timer first (all
        at once: one slow call must not let another lease lapse), then renew claims and
        look at records for a newer attempt or a cancel the agent missed. A delivery
        keeps its lease until it is acked, callbacks included."""
        while True:
            await asyncio.sleep(self.settings.task_ack_wait / 3)
            ex = self._exec
            assert ex is not None
            held = [m for p in list(self._pullers.values()) for m in list(p.buffer)]
            live = list(self.running.values())
            mine = [d.msg for d in live if not d.abandoned]  # its message is settled
            await asyncio.gather(*(_in_progress(m) for m in [*held, *mine]))
            await asyncio.gather(*(self._check(ex, d) for d in live))

    async def _check(self, ex: Executor, d: Delivery) -> None:
        if d.abandoned:
            if d.claim_rev and not await ex.renew(d):
                log.error(
                    "task %s: the claim of its handler that will not stop was lost;"
                    " another run of its key may start beside it",
                    d.task_id,
                )
                d.claim_rev = 0
            return
        if d.runner is None or d.runner.done():
            return  # settling: only its ack timer matters now
        try:
            if not await ex.renew(d):
                self._stop(d, "fenced")
                return
            if d.unconfirmed:
                st = await self._settle_unconfirmed(ex, d)
                if st is None:
                    return  # still not answered: the next check tries again
            elif d.stored is None or not d.stored.revision:
                return  # RUNNING not written yet
            else:
                st = await ex.store.get(d.task_id)
        except TRANSIENT as exc:
            log.debug("task %s: lease check: %s", d.task_id, exc)
            return
        except CorruptRecord:
            st = None  # fenced: the message's next delivery replaces the record
        if st is None or not can_write(st.record, d.n, ex.agent_id):
            self._stop(d, "fenced")
        elif st.record.cancel_requested:
            self._stop(d, "cancelled")
        else:
            await ex.keep_record(d)  # a run longer than half the retention

    async def _settle_unconfirmed(self, ex: Executor, d: Delivery) -> Stored | None:
        """The record of an attempt whose RUNNING write went unanswered: ours if it landed
        after all (adopted, so the end writes over it), written now if there is none, or
        whatever came first (which the caller checks for a fence or a cancel)."""
        st = await ex.store.get(d.task_id)
        if d.runner is None or d.runner.done():
            return None  # it ended meanwhile: its own end writes the record
        if st is None:
            await ex.confirm(d, count=False)  # unanswered again: d.unconfirmed stays
            st = d.stored if d.stored is not None and d.stored.revision else None
            if st is None:
                return None
        elif can_write(st.record, d.n, ex.agent_id):
            d.stored = st
        d.unconfirmed = False
        return st

    async def _on_cancel(self, msg: Msg) -> None:
        if (d := self.running.get(msg.data.decode(errors="replace"))) is not None:
            self._stop(d, "cancelled")

    def _stop(self, d: Delivery, reason: str) -> None:
        if d.runner is not None and not d.runner.done():
            if reason == "fenced" and not d.stop_reason:
                self.stats.fenced += 1  # a stale worker, stopped before it could write
            d.stop_reason = d.stop_reason or reason
            d.runner.cancel()


async def _in_progress(msg: Msg) -> None:
    try:
        await msg.in_progress()
    except TRANSIENT as exc:
        log.debug("in_progress: %s", exc)
