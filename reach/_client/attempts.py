"""One request's life: check the arguments, then attempts with failover, backoff and
hedging until an answer, a final error or the deadline. Each attempt is reported to the
router with its true outcome; a cancelled one ("cancelled") teaches it nothing.

The rule for time: the first attempt gets the caller's whole deadline. A timeout is not
proof that the instance failed (the handler may still be running), so a timed-out attempt
is retried only when the caller says the work may run twice (``idempotent``), and only on
another instance, never through the queue group (unless the instances it timed out on are
gone: a ping finds nobody listening). Only then may an attempt be cut short,
to leave a faster live instance the time to answer. Fast failures (no responders, a
refusal, an open circuit, a lost connection) fail over at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from typing import Any

from opentelemetry.trace import Tracer

from .._codec import encode_payload, now_ms
from .._inbox import Inbox, Reply, StreamSink
from .._nats import TRANSIENT, is_no_responders
from .._routing import (
    FAILOVER,
    LOST,
    NOT_COUNTED,
    Choice,
    Policy,
    Router,
    TableView,
    backoff_delay,
)
from .._subjects import Subjects, validate_agent_id, validate_capability
from ..errors import (
    AgentUnavailable,
    Attempt,
    CapabilityNotFound,
    CircuitOpen,
    ConfigurationError,
    ReachError,
    RemoteError,
    RequestTimeout,
    ResourceExhausted,
)
from ..settings import ReachSettings
from ..wire import Header, Priority
from .call import Call
from .metrics import ClientMetrics
from .spans import traced_attempt

#: a request id travels in a header, which the payload's size check counts on being small
MAX_REQUEST_ID = 256

__all__ = ["Requester", "check_request_id", "priority_of", "reap"]

#: outcomes the capability's breaker does not count: besides NOT_COUNTED, a timeout, which
#: is one instance's (its own breaker counts it) and is no longer retried unasked, so a few
#: requests stuck on one dead instance would refuse every healthy one for a cooldown
_NOT_THE_CAPABILITY = NOT_COUNTED | {"timeout"}
#: how long to wait for a ping to prove an instance gone (no responders comes at once)
_GONE_WAIT = 0.25
#: policies the queue group cannot stand in for (it knows no scores, no sessions)
_NEEDS_TABLE = frozenset({Policy.SCORED, Policy.AFFINITY, "scored", "affinity"})
_PRIORITIES: dict[object, Priority] = {**{p: p for p in Priority}, **{p.value: p for p in Priority}}


class Requester:
    """The request path of one client: ``call`` -> ``attempt`` -> ``Inbox.send``."""

    def __init__(
        self,
        settings: ReachSettings,
        subjects: Subjects,
        name: str,
        router: Router,
        inbox: Inbox,
        start_table: Callable[[str], Awaitable[TableView]],
        routing: Policy,
        metrics: ClientMetrics | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.subjects = subjects
        self.metrics = metrics
        self.tracer = tracer
        self.name = name
        self.router = router
        self.inbox = inbox
        self.routing = routing
        self.max_attempts = settings.max_attempts
        self.retry_base = settings.retry_base
        self.retry_cap = settings.retry_cap
        self.default_timeout = settings.timeout_ms / 1000
        #: None until the first routed request starts the table; each capability is
        #: followed from its first call on (``TableView.follows``).
        self.table: TableView | None = None
        self._start_table = start_table
        self.cancelled = 0  # attempts cut short: hedge losers, caller timeouts, gathers
        self._checked: set[str] = set()

    @property
    def checked(self) -> int:
        """Capability names validated once and remembered (at most 10,000)."""
        return len(self._checked)

    def wait_of(self, timeout: float | None) -> float:
        """Seconds a call may take: ``timeout``, or the client's default (``timeout_ms``);
        ``ConfigurationError`` unless positive. (Requests, streams and gathers alike.)"""
        wait = self.default_timeout if timeout is None else timeout
        if wait <= 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout}")
        return wait

    def check_capability(self, capability: str) -> None:
        if capability not in self._checked:
            validate_capability(capability)
            if len(self._checked) < 10_000:
                self._checked.add(capability)

    async def call(
        self,
        capability: str,
        payload: Any,
        *,
        timeout: float | None,
        priority: Priority | str,
        agent_id: str | None,
        response_type: Any,
        request_id: str | None,
        version: str | None,
        required_tags: Sequence[str],
        routing: Policy | str | None,
        affinity_key: str | None,
        hedge: bool,
        max_attempts: int | None,
        idempotent: bool = False,
        stream: StreamSink | None = None,
        window: int = 0,
        total: float | None = None,
        patience: float | None = None,
    ) -> Reply:
        """One request, attempt after attempt. ``stream``: a streaming call (``window``
        chunks granted at first), which ends at its first frame: ``timeout`` bounds the
        time to it, failover included, and ``total`` (None: none) is the deadline the
        agent is told, for the whole stream."""
        router = self.router
        loop = asyncio.get_running_loop()
        began = loop.time()
        wait = self.wait_of(timeout)
        table = None
        if agent_id is None:
            wanted = self.routing if routing is None else routing
            table, capability = await self.table_for(
                capability,
                wait,
                "a call with a version, tags, or scored or affinity routing needs it,"
                " the queue group would ignore them"
                if version or required_tags or wanted in _NEEDS_TABLE
                else None,
            )
        else:
            capability = router.resolve(capability)
        self.check_capability(capability)
        prio = priority_of(priority)
        if agent_id is not None:
            validate_agent_id(agent_id)
            policy = Policy.DIRECT
        elif routing is None:
            policy = self.routing
        else:
            try:
                policy = Policy(routing)
            except ValueError:
                raise ConfigurationError(
                    f"routing {routing!r} is invalid; use balanced, scored, queue or affinity"
                ) from None
        check_request_id(request_id)
        data = encode_payload(payload)  # before admit: once admitted, only the try below
        now = loop.time()
        cells = self.metrics.cap(capability) if self.metrics is not None else None
        refused, probe = router.admit_call(capability, now)
        if refused is not None:
            if cells is not None:
                cells.inflight += 1
                cells.finished(policy.value, refused, 0.0)
            cls = ResourceExhausted if refused == "resource_exhausted" else CircuitOpen
            raise cls(
                f"{capability!r} refused by this client: "
                + ("rate limit reached" if refused == "resource_exhausted" else "circuit open"),
                capability=capability,
            )
        deadline = began + wait  # the routing table's first start came out of it
        limit = 1 if policy is Policy.DIRECT else (max_attempts or self.max_attempts)
        if stream is None:
            base = self.headers(deadline - now, prio, request_id)
        else:
            base = self.headers(None if total is None else total - (now - began), prio, request_id)
            base[Header.STREAM_WINDOW] = str(window)
            if patience is not None:
                base[Header.STREAM_PATIENCE] = str(round(patience * 1000))
        call = Call(
            capability,
            data,
            request_id,
            response_type,
            affinity_key,
            version,
            tuple(required_tags),
            prio,
            policy,
            table,
            cells,
            stream,
        )
        if cells is not None:
            cells.inflight += 1
        outcome = "error"
        try:
            reply = await self._attempts(
                call, policy, agent_id, base, limit, deadline, wait, hedge, idempotent
            )
            outcome = "ok"
            return reply
        except RemoteError as exc:
            outcome = exc.outcome
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if probe:  # this call is the capability breaker's probe: settle it
                router.call_ended(capability, outcome, loop.time())
            if cells is not None:
                cells.finished(policy.value, outcome, loop.time() - now)

    def headers(
        self, seconds: float | None, prio: Priority, request_id: str | None
    ) -> dict[str, str]:
        """The headers every attempt of a request carries: its deadline ``seconds`` from
        now (None: none), and only the others that carry information."""
        base = {} if seconds is None else {Header.DEADLINE: str(now_ms() + int(seconds * 1000))}
        if prio is not Priority.NORMAL:
            base[Header.PRIORITY] = prio.value
        if self.name:
            base[Header.CALLER] = self.name
        if request_id:
            base[Header.REQUEST_ID] = request_id
        return base

    async def table_for(
        self, capability: str, wait: float, needed_by: str | None
    ) -> tuple[TableView | None, str]:
        """The routing table once it follows ``capability`` (``first_table`` on first
        use), and the capability it resolves to (a task type, once the config is in)."""
        resolved = self.router.resolve(capability)
        table = self.table
        if table is None or not table.follows(resolved):
            table = await self.first_table(capability, wait, needed_by)
            resolved = self.router.resolve(capability)  # the first start loads the config
        return table, resolved

    async def first_table(
        self, capability: str, wait: float, needed_by: str | None
    ) -> TableView | None:
        """The routing table following ``capability``, started on first use within half
        the caller's deadline; None if it is not ready by then (its start goes on for later
        calls), unless
        ``needed_by`` says what cannot do without it: then ``RequestTimeout``."""
        try:
            async with asyncio.timeout(wait / 2) as limit:
                return await self._start_table(capability)
        except TimeoutError:
            if not limit.expired():
                raise  # the start's own failure, not our limit
        if needed_by is not None:
            raise RequestTimeout(
                f"{capability!r}: the routing table did not load within {wait / 2:g}s"
                f" (is JetStream answering?); {needed_by}",
                capability=capability,
            )
        return None

    async def _gone(self, agent_ids: Collection[str], remaining: float) -> set[str]:
        """Which of ``agent_ids`` nobody listens for now: the server answers a ping to them
        with no responders at once. A late, lost or any other answer proves nothing."""
        inbox = self.inbox
        wait = min(_GONE_WAIT, remaining / 2)

        async def gone(agent_id: str) -> bool:
            try:
                await inbox.request(self.subjects.ping(agent_id), b"", wait)
            except TRANSIENT as exc:
                return is_no_responders(exc)
            except ReachError:  # refused (Unauthorized): nothing is proven
                return False
            return False

        ids = list(agent_ids)
        if wait <= 0:
            return set()
        found = await asyncio.gather(*(gone(i) for i in ids))
        return {i for i, g in zip(ids, found, strict=True) if g}

    async def _attempts(
        self,
        call: Call,
        policy: Policy,
        agent_id: str | None,
        base: dict[str, str],
        limit: int,
        deadline: float,
        wait: float,
        hedge: bool,
        idempotent: bool,
    ) -> Reply:
        """Attempt after attempt, within the deadline and the retry budget (the module
        docstring has the rule for timeouts)."""
        router = self.router
        loop = asyncio.get_running_loop()
        capability, table, prio, affinity_key = (
            call.capability,
            call.table,
            call.priority,
            call.affinity_key,
        )
        cells = call.cells
        attempts: list[Attempt] = []
        tried: list[str] = []
        #: instances whose attempt timed out: the work may still run there, so never again
        #: on this call; and whether an attempt through the queue group did (anyone may)
        running: set[str] = set()
        queue_ran = False
        router.budget.record_request(loop.time())
        last: RemoteError | None = None
        target: str | None = None
        for n in range(1, limit + 1):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            previous = target
            probe = False
            if policy is Policy.DIRECT:
                target = agent_id
            elif table is None:
                target = None  # no registry bucket (yet): the queue group decides
            else:
                try:
                    choice = router.choose(
                        policy,
                        table,
                        capability,
                        call.version,
                        call.tags,
                        prio,
                        tried,
                        affinity_key,
                        loop.time(),
                        avoid=running,
                    )
                except RemoteError:
                    if n == 1:
                        raise
                    break  # nobody left who fits: the error says what was tried
                target, probe = choice.agent_id, choice.probe
            if (running or queue_ran) and (target is None or target in running):
                # The only way left is where the work may still be running, unless that
                # instance is gone (its connection, and so its work, with it): then, for
                # work that may run twice, the queue group cannot reach it.
                if not (idempotent and target is None and not queue_ran):
                    if probe and target is not None:
                        router.release_probe(target)
                    break
                running -= await self._gone(running, deadline - loop.time())
                if running:
                    break
                if deadline - loop.time() <= 0:
                    break
            if n > 1:
                if not router.budget.try_retry(loop.time()):
                    if probe and target is not None:
                        router.release_probe(target)
                    if cells is not None:
                        cells.budget_exhausted += 1
                    break
                if cells is not None:
                    cells.retries += 1
                    if target != previous:
                        cells.failovers += 1
            headers = base if n == 1 else {**base, Header.ATTEMPT: str(n)}
            budget = remaining
            if idempotent and n < limit and target is not None and table is not None:
                keep = router.reserve(
                    table, capability, call.version, call.tags, prio, target, tried, loop.time()
                )
                if 0 < keep <= remaining / 2:
                    budget = remaining - keep
            sent_to = len(tried)
            started = loop.time()
            try:
                if hedge and policy is not Policy.DIRECT and target is not None:
                    reply = await self.hedged(
                        call, target, headers, budget, tried, probe, running, idempotent
                    )
                else:
                    reply = await self.attempt(
                        call, target, headers, budget, probe, idempotent=idempotent
                    )
            except RemoteError as exc:
                outcome = exc.outcome
                # recorded against the instance that answered (a hedge's, when it did)
                attempts.append(
                    Attempt(
                        exc.agent_id or target or "",
                        outcome,
                        round((loop.time() - started) * 1000, 3),  # whole µs: a readable number
                    )
                )
                if target is not None:
                    tried.append(target)
                last = exc
                if outcome == "timeout":
                    if target is None:
                        queue_ran = True
                    running.update(tried[sent_to:])  # the target, and a hedge's other
                final = outcome not in FAILOVER or policy is Policy.DIRECT
                if outcome == "timeout" and (not idempotent or target is None):
                    final = True  # the work may still be running: never run it twice unasked
                if outcome == LOST and not idempotent:
                    final = True  # it may have run, and its answer was lost
                if final:
                    if outcome in FAILOVER and outcome not in _NOT_THE_CAPABILITY:
                        router.request_done(capability, False, loop.time())
                    if len(attempts) > 1:
                        raise exhausted(capability, attempts, last, wait) from exc
                    exc.attempts = attempts
                    raise
                if target is None and outcome == "no_responders":
                    # Nobody serves it at all: fail fast, no retry, no breaker (no-responders
                    # is already instant); alone, it keeps its plain message.
                    if len(attempts) == 1:
                        exc.attempts = attempts
                        raise
                    break
                if outcome not in NOT_COUNTED and outcome != "timeout" and n < limit:
                    # Busy: back off (full jitter) before the next instance, within the
                    # deadline. A vanished instance, a lost answer or a timed-out one (its
                    # share of the deadline is spent already) goes on at once.
                    pause = backoff_delay(n, router.rng, base=self.retry_base, cap=self.retry_cap)
                    pause = min(pause, max(0.0, deadline - loop.time() - 0.001))
                    if pause > 0:
                        await asyncio.sleep(pause)
                continue
            router.request_done(capability, True, loop.time())
            return reply
        if any(a.outcome not in _NOT_THE_CAPABILITY for a in attempts):
            router.request_done(capability, False, loop.time())
        if last is not None and len(attempts) == 1:
            last.attempts = attempts  # one attempt, nothing more to try: its own words
            raise last
        raise exhausted(capability, attempts, last, wait)

    async def attempt(
        self,
        call: Call,
        target: str | None,
        headers: dict[str, str],
        budget: float,
        probe: bool = False,
        *,
        idempotent: bool = False,
    ) -> Reply:
        """One send, reported to the router with what really happened to it."""
        router = self.router
        loop = asyncio.get_running_loop()
        router.started(target)
        started = loop.time()
        outcome = "cancelled"
        subject = (
            self.subjects.agent(target, call.capability)
            if target
            else self.subjects.cap(call.capability)
        )
        try:
            if self.tracer is None:
                reply = await self.inbox.send(
                    call, subject, headers, budget, target, lossy=idempotent, stream=call.stream
                )
            else:
                reply = await traced_attempt(
                    self.tracer, self.inbox, call, subject, headers, budget, target, idempotent
                )
            outcome = "ok"
            return reply
        except RemoteError as exc:
            outcome = exc.outcome
            raise
        except asyncio.CancelledError:
            self.cancelled += 1  # a hedge loser or the caller's own timeout: no answer
            raise
        except Exception:
            outcome = "error"  # the connection went away: says nothing about the instance
            raise
        finally:
            now = loop.time()
            if call.cells is not None:
                call.cells.attempted(outcome)
            router.finished(
                target,
                call.capability,
                outcome,
                (now - started) * 1000,
                now,
                call.affinity_key if outcome == "ok" else None,
                probe,
            )

    async def hedged(
        self,
        call: Call,
        target: str,
        headers: dict[str, str],
        budget: float,
        tried: list[str],
        probe: bool = False,
        running: Collection[str] = (),
        idempotent: bool = False,
    ) -> Reply:
        """Send to ``target``; if no answer by the p95, also to a second instance (added to
        ``tried``: a retry goes elsewhere), never one in ``running``. The first answer wins;
        the other attempt is cancelled and awaited before this returns, and both are when
        this is cancelled itself."""
        delay = self.router.hedge_delay(call.capability)
        if delay is None or delay >= budget:
            return await self.attempt(call, target, headers, budget, probe, idempotent=idempotent)
        loop = asyncio.get_running_loop()
        first = self.attempt(call, target, headers, budget, probe, idempotent=idempotent)
        tasks = [self._owned(loop, first, target if probe else None)]
        try:
            done, _ = await asyncio.wait(tasks, timeout=delay)
            if not done:
                try:
                    choice = self.router.choose(
                        call.policy,
                        call.table,
                        call.capability,
                        call.version,
                        call.tags,
                        call.priority,
                        [*tried, target],
                        None,
                        loop.time(),
                        avoid=running,
                    )
                except RemoteError:
                    choice = Choice(None)  # nobody else to ask: wait for the first
                other = choice.agent_id
                if other is not None and other != target:
                    tried.append(other)
                    if call.cells is not None:
                        call.cells.hedges += 1
                    second = self.attempt(
                        call, other, headers, budget - delay, choice.probe, idempotent=idempotent
                    )
                    tasks.append(self._owned(loop, second, other if choice.probe else None))
            pending = set(tasks)
            error: BaseException | None = None
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception()
                    if exc is None:
                        return task.result()
                    error = exc
            assert error is not None
            raise error
        finally:
            await reap(tasks)

    def _owned(
        self,
        loop: asyncio.AbstractEventLoop,
        attempt: Coroutine[Any, Any, Reply],
        probe: str | None,
    ) -> asyncio.Task[Reply]:
        """A hedge's attempt as a task. Cancelled before it starts, its own ``finally``
        never runs: then the coroutine is closed here and a probe slot it took given back."""
        started = False

        async def run() -> Reply:
            nonlocal started
            started = True
            return await attempt

        def settled(_: asyncio.Task[Reply]) -> None:
            if not started:
                attempt.close()
                if probe is not None:
                    self.router.release_probe(probe)

        task = loop.create_task(run())
        task.add_done_callback(settled)
        return task


def priority_of(priority: Priority | str) -> Priority:
    prio = _PRIORITIES.get(priority)
    if prio is None:
        raise ConfigurationError(f"priority {priority!r} is invalid; use high, normal or low")
    return prio


def check_request_id(request_id: str | None) -> None:
    if request_id and len(request_id) > MAX_REQUEST_ID:
        raise ConfigurationError(
            f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID}"
        )


# -- when attempts end: losers reaped, and the error that says what was tried ---------


async def reap(tasks: list[asyncio.Task[Reply]]) -> None:
    """Cancel what still runs and wait until all of it has ended, even if cancelled
    meanwhile (then re-raise): no attempt outlives its request."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    interrupted = False
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            interrupted = True
        pending = [t for t in pending if not t.done()]
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: a loser's error is not "never retrieved"
    if interrupted:
        raise asyncio.CancelledError


def exhausted(
    capability: str, attempts: list[Attempt], last: RemoteError | None, wait: float
) -> RemoteError:
    """The error for a request whose attempts all failed, saying what was tried."""
    tried = "; ".join(
        f"{a.agent_id or 'queue'}: {a.outcome} in {a.duration_ms:.0f} ms" for a in attempts
    )
    outcomes = {a.outcome for a in attempts}
    cls: type[RemoteError]
    if not attempts:
        cls, why = RequestTimeout, f"no time left within {wait:g}s"
    elif outcomes <= {"no_responders", "agent_unavailable"}:
        cls = CapabilityNotFound if all(not a.agent_id for a in attempts) else AgentUnavailable
        why = "no agent alive"
    elif outcomes <= {"resource_exhausted", "circuit_open"}:
        cls, why = ResourceExhausted, "all busy"
    else:
        cls, why = RequestTimeout, f"no answer within {wait:g}s"
    detail = f"; last: {last.message}" if last is not None else ""
    return cls(
        f"{capability!r}: {why} after {len(attempts)} attempt(s) [{tried}]{detail}",
        capability=capability,
        agent_id=last.agent_id if last is not None else "",
        request_id=last.request_id if last is not None else "",
        attempts=attempts,
    )
