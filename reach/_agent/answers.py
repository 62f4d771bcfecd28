"""How a worker answers when a request does not succeed: the handler failed, refused, ran
past its deadline, or we did; each is counted, logged under the request id and answered
with an error the caller can act on (never the handler's exception text)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from .._codec import error_reply, wire_error
from .._nats import TRANSIENT, NatsConnection
from ..errors import RemoteError
from .lifecycle import Lifecycle, Reason, TimeoutWatch
from .model import AgentStats, Job

__all__ = ["Answers"]

log = logging.getLogger("reach.agent")


class Answers:
    """Mixed into ``Workers``."""

    agent_id: str
    stats: AgentStats
    timeouts: TimeoutWatch
    _life: Lifecycle
    _nc: NatsConnection

    # -- the ways a request can fail -----------------------------------------------------

    async def _failed(self, job: Job, code: str, what: str) -> None:
        """The handler failed: log the traceback under the request id, tell the caller
        only that (its exception text may hold secrets)."""
        rid = job.request_id or "-"
        self._count_error(job, what)
        log.error(
            "agent %s: %s for %s (request id %s)",
            self.agent_id,
            what,
            job.cap.info.name,
            rid,
            exc_info=sys.exc_info()[0] is not None,
        )
        await self._answer(job, code, f"{what} (request id {rid})")

    async def _refused(self, job: Job, exc: RemoteError) -> None:
        """A deliberate refusal: its code and message are meant for the caller."""
        wire = wire_error(exc)
        if wire is None:
            await self._failed(job, "failed", f"handler refused with invalid code {exc.code!r}")
            return
        code, status, retryable = wire
        self._count_error(job, exc.message)
        await self._answer(job, code, exc.message, status=status, retryable=retryable)

    async def _late(self, job: Job, task: asyncio.Task[Any]) -> None:
        """The handler ended, however, after the deadline watch cancelled it: that
        cancellation is consumed here (else the worker would take its next request's
        CancelledError for a stop), and the caller, unless answered already, told
        ``timeout``."""
        task.uncancel()
        if not job.abandoned:
            await self._timed_out(job)

    async def _timed_out(self, job: Job) -> None:
        if self.timeouts.timed_out(time.monotonic()):
            self._life.degrade(Reason.TIMEOUTS)
        self._count_error(job, "deadline passed while running")
        await self._answer(job, "timeout", "deadline passed while running")

    async def _internal_error(self, job: Job) -> None:
        """A bug of ours around this request: counted and answered; the worker goes on."""
        self.stats.internal_errors += 1
        self.stats.failed += 1
        rid = job.request_id or "-"
        log.exception("agent %s: internal error serving request %s", self.agent_id, rid)
        try:
            await self._answer(job, "failed", f"agent failed (request id {rid})")
        except Exception:
            log.exception("agent %s: could not answer request %s", self.agent_id, rid)

    def _count_error(self, job: Job, reason: str) -> None:
        job.cap.failed(reason)
        self.stats.failed += 1

    async def _answer(
        self, job: Job, code: str, message: str, *, status: int = 500, retryable: bool = False
    ) -> None:
        job.answered = True
        if job.cap.cells is not None:
            job.cap.cells.error(job.priority, code)
        await self.reply_error(job.msg, code, message, status=status, retryable=retryable)

    async def reply_error(
        self, msg: Any, code: str, message: str, *, status: int = 500, retryable: bool = False
    ) -> None:
        """Answer ``msg`` with an error (best effort: a lost reply is logged)."""
        await self.send_error(msg.reply, code, message, status=status, retryable=retryable)

    async def send_error(
        self, reply: str, code: str, message: str, *, status: int = 500, retryable: bool = False
    ) -> None:
        """Send an error to the reply subject ``reply`` (nothing when there is none)."""
        if not reply:
            return
        body, headers = error_reply(
            code, message, self.agent_id, status=status, retryable=retryable
        )
        try:
            await self._nc.publish(reply, body, headers=headers)
        except TRANSIENT as exc:
            log.warning("agent %s: error reply lost: %s", self.agent_id, exc)
