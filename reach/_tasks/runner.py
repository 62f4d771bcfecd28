"""The agent's task runner: pulls only what it has slots for, in priority order, and keeps
every running task's lease (claim and ack timer) alive until its result is recorded.

Priority is ours: one durable consumer per capability and priority, probed high before
normal before low (with aging, ``states.PriorityOrder``), asking for no more messages than
there are free slots; a level found empty is probed again only after ``_EMPTY_FOR`` while
lower levels keep the runner busy (a probe is a round trip the free slots wait on, and a
steady backlog of normal tasks would otherwise pay one for the empty high level before
every refill). An idle runner leaves a lingering pull request on every consumer:
one message each, and the rest of its free slots to the level that had work last, so a
steady stream needs no request per task. Only when it has fewer free slots than consumers
does it hold more than it can run (one message per consumer at most); held messages are
kept alive like running ones and start in priority order.

A slot is a handler: it is taken when a task starts and given back when its handler has
returned. How the attempt ended is then recorded and the message acked beside the next task
(an fsynced write, the longest step of a short task), at most ``concurrency`` of them at
once; the delivery stays in ``running`` meanwhile, its lease kept, until it is acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import Tracer

from .._background import Background
from .._jsapi import JsApi
from .._nats import TRANSIENT, NatsConnection
from .._subjects import Subjects
from .._telemetry import LOG_AGENT, LOG_WORK
from ..errors import BadRequest, CorruptRecord, RetryLater
from ..settings import ReachSettings
from ..wire import Priority
from ..wire.tasks import TaskSubmit
from .bounded import GRACE, BoundedRun
from .delayed import retry_later
from .execute import Executor
from .faults import patiently
from .handler_run import call_handler, redelivered, task_context, task_span
from .model import ContextFactory, Delivery, TaskDecl, TaskStats
from .opening import open_store
from .pull import Puller, close_pulling, keep_alive
from .schedules import fire, is_firing
from .states import PriorityOrder, can_write, retry_delay
from .store import Stored, TaskStore

__all__ = ["TaskRunner"]

log = logging.getLogger("reach.tasks")

_LINGER = 5.0  # seconds an idle pull request waits on the server
_NOT_HERE_MAX = 30.0  # seconds at most before a task for another instance is looked at again
#: a task still running after this long gets its RUNNING record; a quicker one is recorded
#: in one write (PENDING, RUNNING, SUCCEEDED in its history)
_RECORD_RUNNING_AFTER = 0.05
_HAND_BACK = 5.0  # seconds a drain waits for handed-back tasks' records and naks
#: seconds a level found empty is not probed again while the runner starts tasks of lower
#: levels (a probe is a round trip the slots wait on); an idle runner lingers on it instead
_EMPTY_FOR = 0.05
_submit_decoder = msgspec.json.Decoder(TaskSubmit)


class TaskRunner:
    """Every durable capability of one agent, sharing ``concurrency`` slots."""

    def __init__(
        self,
        agent_id: str,
        settings: ReachSettings,
        subjects: Subjects,
        stats: TaskStats,
        concurrency: int,
        *,
        context: ContextFactory,
    ) -> None:
        self.agent_id = agent_id
        #: makes each attempt's context (``reach.TaskContext``), given by the agent
        self.context = context
        self.settings = settings
        self.subjects = subjects
        self.stats = stats
        self.concurrency = concurrency
        self.decls: dict[str, TaskDecl] = {}
        self.running: dict[str, Delivery] = {}
        self.fetching = False
        self.tags: frozenset[str] = frozenset()
        self._order = PriorityOrder()
        self._pullers: dict[tuple[str, Priority], Puller] = {}
        self._rotate = 0
        self._settling = 0  # deliveries whose handler has returned, being recorded and acked
        self._busy = Priority.HIGH  # the level that had work last
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._cancel_sub: Subscription | None = None
        self._owner: Background | None = None
        self._exec: Executor | None = None
        self._client: object = None  # the agent's, passed on to handlers in their context
        self._api: JsApi | None = None
        self._dispatcher: asyncio.Task[Any] | None = None
        #: a handler raised SystemExit: True when the agent stops in order for it
        self.on_exit: Callable[[BaseException], bool] = lambda exc: False
        #: told how many handlers that ignored their cancellation still run (each holds a
        #: slot), whenever that number changes
        self.on_stuck: Callable[[int], None] = lambda n: None
        self.tracer: Tracer | None = None  # a CONSUMER span per attempt; None: off
        #: attempts by (capability, outcome), for metrics
        self.outcomes: dict[tuple[str, str], int] = {}

    @property
    def store(self) -> TaskStore | None:
        return self._exec.store if self._exec else None

    # -- start and stop ----------------------------------------------------------------

    async def start(
        self,
        nc: NatsConnection,
        owner: Background,
        client: object,
        tags: list[str],
        stopped: Callable[[], bool] = lambda: False,
    ) -> None:
        """Create the streams and consumers if missing (waiting up to ``task_patience`` in
        all for JetStream to answer, unless ``stopped()``), and start pulling."""
        if not self.decls:
            return
        until = time.monotonic() + self.settings.task_patience
        what = f"agent {self.agent_id}"
        store = await open_store(
            nc,
            f"{what}: task streams",
            lambda api: TaskStore(nc.jetstream(), self.subjects, self.settings, api),
            until=until,
            stopped=stopped,
        )
        self._api = store.api
        self._exec = Executor(self.agent_id, nc, store, self.stats)
        self._owner, self._client, self.tags = owner, client, frozenset(tags)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        for cap in self.decls:
            for level in (Priority.HIGH, Priority.NORMAL, Priority.LOW):
                ensure = functools.partial(store.ensure_consumer, cap, level)
                name = await patiently(
                    nc,
                    f"{what}: consumer of {cap} at {level}",
                    ensure,
                    until=until,
                    stopped=stopped,
                )
                puller = Puller(nc, store.stream, name, nc.new_inbox(), self._wake.set, ensure)
                await puller.open()
                self._pullers[(cap, level)] = puller
        self._cancel_sub = await nc.subscribe(self.subjects.task_cancel(), cb=self._on_cancel)
        self.fetching = True
        self._dispatcher = owner.keep(self._dispatch, "tasks: dispatch")
        owner.keep(self._keep_leases, "tasks: leases")

    async def drain(self, timeout: float) -> bool:
        """Stop fetching; let running tasks finish within ``timeout``; hand the rest (and
        anything held, not started) back for immediate redelivery elsewhere."""
        self.fetching = False
        self._wake.set()
        for puller in self._pullers.values():
            await puller.close()  # the server skips pull requests nobody listens to
            for msg in puller.take(len(puller.buffer)):
                await self._hand_back(msg)
        if not self.running:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            pass
        for d in list(self.running.values()):
            self._stop(d, "drained")
        # each delivery hands its task back (RETRYING, claim released, nak) before we close
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), GRACE + _HAND_BACK)
        return False

    async def close(self) -> None:
        """After the owner's background coroutines are cancelled: drop the subscriptions."""
        self.fetching = False
        sub, self._cancel_sub = self._cancel_sub, None
        pullers = list(self._pullers.values())
        self._pullers.clear()
        api, self._api = self._api, None
        what = f"agent {self.agent_id}: task subscriptions"
        if sub is not None:
            try:
                await sub.unsubscribe()
            except TRANSIENT as exc:
                log.debug("%s: %s", what, exc)
        await close_pulling(pullers, api, what)

    # -- pulling -----------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while self.fetching:
            free = self._free()
            self._wake.clear()
            if free <= 0:
                await self._wake.wait()
                continue
            if await self._fill(free):
                continue
            if any(p.buffer for p in self._pullers.values()):
                continue  # arrived while we looked elsewhere
            await self._linger(free)
            # a request the server lost (a restart) never ends by itself: look again then
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 2 * _LINGER)

    def _free(self) -> int:
        """Slots free now: every delivery held takes one, but one whose handler has
        returned (its end being recorded and acked) gives its slot to the next task, at
        most ``concurrency`` of them: so handlers never outnumber the slots, and the
        deliveries held never the slots twice over."""
        return self.concurrency - len(self.running) + min(self._settling, self.concurrency)

    async def _linger(self, free: int) -> None:
        """Wait on the server for new tasks without asking for more than ``free``: one
        message per level, and the rest of the slots to the level that had work last (so
        a steady stream flows without a request per task)."""
        idle = [(key, p) for key, p in self._pullers.items() if p.idle]
        busy = [p for (_, level), p in idle if level is self._busy]
        spare = max(0, free - (len(idle) - len(busy)))
        for (_, level), puller in idle:
            share = max(1, spare // len(busy)) if level is self._busy else 1
            await puller.linger(_LINGER, share)

    async def _fill(self, free: int) -> int:
        started = 0
        caps = list(self.decls)
        self._rotate = (self._rotate + 1) % len(caps)
        caps = caps[self._rotate :] + caps[: self._rotate]
        for level in self._order.order():
            found, all_probed = False, True
            for cap in caps:
                if started >= free or not self.fetching:
                    return started
                puller = self._pullers[(cap, level)]
                msgs = puller.take(free - started)
                if not msgs:
                    if not puller.idle or puller.found_empty(_EMPTY_FOR):
                        all_probed = False
                        continue
                    msgs = await puller.probe(free - started)
                for msg in msgs:
                    found = True
                    self._busy = level
                    started += 1
                    self._order.served(level)
                    self._start(msg, cap)
            if not found and all_probed:
                self._order.empty(level)
        return started

    def _start(self, msg: Msg, cap: str) -> None:
        assert self._owner is not None
        assert self._exec is not None
        if not self.fetching:
            self._owner.spawn(self._exec.hand_back(msg), "tasks: hand back")
            return
        if is_firing(msg):  # a periodic schedule's firing: made into tasks, not run
            self._owner.spawn(fire(self._exec, msg), "tasks: schedule firing")
            return
        try:
            sub = _submit_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            self._owner.spawn(self._exec.invalid(msg, cap, str(exc)), "tasks: invalid")
            return
        decl = self.decls.get(sub.capability)
        if decl is None or sub.capability != cap:
            reason = f"capability {sub.capability!r} arrived on the {cap!r} consumer"
            self._owner.spawn(self._exec.invalid(msg, cap, reason, sub), "tasks: invalid")
            return
        s = self.settings
        if sub.task_id in self.running or not self._fits(sub, decl):
            # not for this instance: back off with each delivery (as a retry does), so the
            # instances that cannot run it look at it less and less often; putting it
            # back spends none of its deliveries (``hand_back``)
            n = msg.metadata.num_delivered
            delay = min(_NOT_HERE_MAX, retry_delay(n, s.task_retry_base, s.task_retry_cap))
            self._owner.spawn(self._exec.hand_back(msg, delay), "tasks: not here")
            return
        sub = msgspec.structs.replace(
            sub,
            timeout=sub.timeout or decl.timeout or s.task_timeout,
            max_attempts=sub.max_attempts or decl.max_attempts or s.task_max_attempts,
        )
        d = Delivery(msg, sub)
        self.running[sub.task_id] = d
        self._idle.clear()
        self.stats.running = len(self.running)
        self._owner.spawn(self._run(d, decl), f"task {sub.task_id}")

    async def pause(self) -> None:
        """Take no new tasks: stop pulling (the server skips our open pull requests once
        nobody listens) and hand held ones back; running ones go on."""
        if not self.fetching:
            return
        self.fetching = False
        self._wake.set()
        for puller in self._pullers.values():
            await puller.close()
            for msg in puller.take(len(puller.buffer)):
                await self._hand_back(msg)

    async def resume(self) -> None:
        if self._owner is None or self.fetching or not self._pullers:
            return
        if self._dispatcher is not None and not self._dispatcher.done():
            await asyncio.wait({self._dispatcher})  # it sees fetching off and ends
        for puller in self._pullers.values():
            await puller.open()
        self.fetching = True
        self._dispatcher = self._owner.keep(self._dispatch, "tasks: dispatch")

    async def _hand_back(self, msg: Msg) -> None:
        assert self._exec is not None
        await self._exec.hand_back(msg)

    def _fits(self, sub: TaskSubmit, decl: TaskDecl) -> bool:
        """Tags and major version, as request routing checks them."""
        major = decl.info.version.split(".")[0]
        return self.tags.issuperset(sub.required_tags) and (
            not sub.version or sub.version.split(".")[0] == major
        )

    # -- leases: kept alive, and stopped -------------------------------------------------
    # Every ack_wait/3 each running task's ack timer is reset (``in_progress``) and its claim
    # renewed; a task whose record moved on (a newer attempt) is stopped as fenced, one whose
    # record asks for a cancel is cancelled. The cancel message stops it at once; the record
    # catches an agent that missed the message. A handler that ignored its cancellation
    # (``abandoned``) has its message settled already: only its claim is renewed, until it
    # returns.

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
            await keep_alive([*held, *mine])
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
        if not d.handling:
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
        if not d.handling:
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
        if d.run is not None and d.handling:
            if reason == "fenced" and not d.stop_reason:
                self.stats.fenced += 1  # a stale worker, stopped before it could write
            d.stop_reason = d.stop_reason or reason
            d.run.task.cancel()

    # -- running -----------------------------------------------------------------------

    async def _run(self, d: Delivery, decl: TaskDecl) -> None:
        """One delivery, in a task of its own (its log records name the task)."""
        LOG_AGENT.set(self.agent_id)
        LOG_WORK.set(d)
        if redelivered(d):
            self.stats.redelivered += 1
        if self.tracer is None:
            await self._attempt(d, decl)
        else:
            d.traced = True
            with task_span(self.tracer, self.agent_id, d):
                await self._attempt(d, decl)

    async def _attempt(self, d: Delivery, decl: TaskDecl) -> None:
        ex = self._exec
        assert ex is not None
        assert self._owner is not None
        settling = False
        try:
            if not await ex.begin(d, early=True):
                return
            rec = d.stored.record if d.stored else None
            timeout = rec.timeout if rec else d.sub.timeout
            try:
                payload = decl.spec.decode(d.sub.payload)
            except (msgspec.DecodeError, ValueError, TypeError) as exc:
                await ex.settle(d, "failed", exc=BadRequest(f"payload: {exc}"))
                return
            ctx = task_context(self.context, self.agent_id, self._client, ex, d, timeout)
            call = call_handler(decl, payload, ctx, self.on_exit)
            what = f"agent {self.agent_id}: task {d.task_id} ({d.sub.capability}, attempt {d.n})"
            d.run = run = BoundedRun(
                self._owner, call, f"task {d.task_id} handler", what, self.stats, self._stuck
            )
            self.stats.started += 1
            quick = min(_RECORD_RUNNING_AFTER, timeout)
            done = await run.finished(quick)
            if not done and not await ex.confirm(d):
                # another write came first (a cancel, a newer attempt): stop it
                d.stop_reason = "fenced"
                await run.stop(d.stop_reason, self._keeps(d))
                await self._ended(ex, d, ex.fenced(d))
                return
            done = await run.finished(timeout - quick)
            if not done:
                d.stop_reason = d.stop_reason or "timeout"
                done = await run.stop(d.stop_reason, self._keeps(d))
            if run.task.done():  # its slot goes to the next task while the end is recorded
                settling = True
                self._settling += 1
                self._wake.set()
            await self._ended(ex, d, self._settle(ex, d, run.task, done))
            return
        finally:
            if settling:
                self._settling -= 1
            if d.run is not None:  # cancelled (the agent stops) while it waited: the
                d.run.unstick()  # claim lapses
            self.running.pop(d.task_id, None)
            self.stats.running = len(self.running)
            if not self.running:
                self._idle.set()
            self._wake.set()

    @staticmethod
    def _keeps(d: Delivery) -> str:
        """What a handler that ignored its cancellation holds until it has returned (its
        attempt is recorded as ended meanwhile): its slot (it stays in ``running``), so a
        stuck handler caps the runner as it caps the request workers; and its claim, if it
        has one (renewed by the lease loop, not released), so a retry of its task waits."""
        return "slot and claim stay" if d.claim_rev else "slot stays"

    def _stuck(self) -> None:
        self.on_stuck(self.stats.stuck)

    async def _ended(self, ex: Executor, d: Delivery, record: Coroutine[Any, Any, None]) -> None:
        """Record how the attempt ended, then wait for its handler if it was abandoned
        (also when the record could not be written: the handler holds what it holds)."""
        try:
            await record
        except Exception:
            await self._outlive(ex, d)
            raise
        await self._outlive(ex, d)

    async def _outlive(self, ex: Executor, d: Delivery) -> None:
        """Wait for an abandoned handler to return, then free its claim (the caller frees
        its slot). A stop of the agent cancels this wait: the claim then lapses after
        ack_wait, as any claim of a stopped agent does."""
        if d.abandoned and d.run is not None:
            await d.run.outlive()
            await ex.release(d)

    async def _settle(
        self, ex: Executor, d: Delivery, inner: asyncio.Task[Any], done: bool
    ) -> None:
        reason = d.stop_reason
        ok = done and not inner.cancelled() and inner.result()[0]
        d.outcome = reason or ("succeeded" if ok else "failed")
        fenced = self.stats.fenced
        try:
            if reason == "fenced":
                await ex.fenced(d)  # a newer attempt owns the task: write nothing
                return
            if reason == "timeout":
                self.stats.timed_out += 1
            if not done or inner.cancelled():
                await ex.settle(d, reason or "failed", exc="the handler was cancelled")
                return
            ok, value = inner.result()
            if ok:
                await ex.settle(d, "succeeded", value=value)
            elif isinstance(value, RetryLater):
                d.outcome = "retry_later"
                await retry_later(ex, d, value)
            else:
                await ex.settle(d, "failed", exc=value)
        finally:
            if self.stats.fenced > fenced:
                d.outcome = "fenced"  # its write was refused: a newer attempt owns the task
            key = (d.sub.capability, d.outcome)
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
