"""Periodic schedules on the server's own scheduler (ADR-51): defined, listed, removed,
paused, and each firing turned into one task per period.

A schedule is one message in stream ``REACH_TASKS``, on ``<prefix>.task.$sched.<name>.$def``
(its name is its identity: a new definition replaces the old, the server rolls the
subject up), body ``ScheduleSpec``, headers ``Nats-Schedule`` (``@every <n>s`` or a cron
line), ``Nats-Schedule-Time-Zone``, ``Nats-Schedule-Target`` =
``<prefix>.task.$fire-<name>.<capability>.<priority>`` and ``Reach-Schedule: <name>``.
The server publishes a firing to the target at each due time, whether or not any process
of ours runs; the firing waits on the capability's work queue like a task. A paused
schedule's definition is stored without ``Nats-Schedule`` (and rolls the old one up), so
nothing fires; resuming stores it with the header again.

An agent of the capability takes a firing and turns it into tasks, one per period:

- the periods are the schedule's own due times (``cron.catch_up``): for ``every``, the
  definition's stored time rounded to the second plus whole intervals; for a cron line,
  its times in its zone. A firing covers every period due up to its own time that no
  firing covered yet (``sched.<name>`` in ``<prefix>_idem`` holds the last one, written by
  compare-and-set). The server fires once after an outage however many periods it missed
  (measured: a restart, a stream leader change); those periods are made up here, at most
  the newest ``CATCH_UP`` at once (the older ones are counted as missed and logged); a
  firing that loses the compare-and-set reads the definition again and stops if the
  schedule was removed or defined anew (it never starts over from the schedule's start);
- each period's task has a deterministic id, ``<name>_<unix seconds of its due time>``,
  published with that id as ``Nats-Msg-Id``, so a firing handled twice (an agent died
  before its ack, two agents raced) makes one task;
- ``overlap="skip"``: a period is made only when the task of the last period made (not
  skipped) is final; otherwise it gets a CANCELLED record with error ``skipped``. So two
  periods never run at once. (Not the idempotency key's run claim: after a success the
  claim is left to expire, up to ack_wait later, to save a write per task, so it would
  hold the next period back or skip it for nothing.)

Then the firing is acked. A definition that is gone (removed) or paused drops its firings.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.msg import Msg

from .._codec import encode_payload, now_ms
from .._nats import TOO_LARGE, TRANSIENT
from .._subjects import validate_capability
from ..errors import ConfigurationError, CorruptRecord
from ..wire import ErrorBody, Priority
from ..wire.tasks import MAX_WAIT, OVERLAPS, ScheduleSpec, TaskState, TaskSubmit
from .cron import Timing, catch_up, timing
from .execute import Executor
from .states import advance
from .store import Conflict, Got, TaskStore, idem_key, pending_record
from .submit import publish_task

__all__ = [
    "CATCH_UP",
    "LATE_MS",
    "SCHEDULE_NAME",
    "ScheduleInfo",
    "count_scheduled",
    "count_schedules",
    "define",
    "fire",
    "firing_id",
    "get_schedule",
    "is_firing",
    "list_schedules",
    "remove",
    "set_paused",
    "spec_of",
]

log = logging.getLogger("reach.tasks")

#: the header naming the schedule on its definition and on each firing
SCHEDULE_NAME = "Reach-Schedule"
#: periods one firing makes up for at most (after an outage longer than that many)
CATCH_UP = 100
#: a period whose task entered the work queue later than this after its due time is late
LATE_MS = 5000
_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")
_STATE_TRIES = 8
#: what a firing's handling may meet that no other try gets past: JetStream refused a
#: write for good (400, e.g. a task over the stream's ``max_msg_size``; the CAS refusals
#: are ``Conflict`` by then), or it is over the server's ``max_payload``
_REFUSED: tuple[type[BaseException], ...] = (nats.js.errors.BadRequestError, TOO_LARGE)
#: what a firing's handling may meet that another try can get past (checked after
#: ``_REFUSED``, whose classes are among these)
_TRIED_AGAIN: tuple[type[BaseException], ...] = (*TRANSIENT, Conflict, nats.js.errors.APIError)
_decode = msgspec.json.Decoder(ScheduleSpec).decode
_encode = msgspec.json.Encoder().encode
S = TaskState


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """A periodic schedule as stored: its definition, when it was stored, the next due
    time (None while paused) and the last period a firing covered (0: none yet)."""

    spec: ScheduleSpec
    stored_ms: int
    next_ms: int | None
    last_ms: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def capability(self) -> str:
        return self.spec.capability

    @property
    def paused(self) -> bool:
        return self.spec.paused

    @property
    def next_due(self) -> datetime.datetime | None:
        """The next firing, as an aware UTC datetime (None while paused)."""
        if self.next_ms is None:
            return None
        return datetime.datetime.fromtimestamp(self.next_ms / 1000, datetime.UTC)

    @property
    def when(self) -> str:
        """``every 60s`` or the cron line and its zone, for people."""
        if self.spec.cron:
            return f"cron {self.spec.cron} ({self.spec.tz or 'UTC'})"
        return f"every {self.spec.every}s"


def firing_id(name: str, due_ms: int) -> str:
    """The task id of ``name``'s period due at ``due_ms``: the same for every firing that
    covers that period."""
    return f"{name}_{due_ms // 1000}"


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"schedule name {name!r} is invalid: use 1-100 letters, digits, '-' or '_'"
        )
    return name


def spec_of(
    name: str,
    capability: str,
    payload: Any,
    *,
    every: datetime.timedelta | float | None,
    cron: str | None,
    tz: str | None,
    priority: Priority | str,
    overlap: str,
    timeout: float | None,
    max_attempts: int | None,
    required_tags: list[str],
    version: str | None,
    caller: str,
) -> ScheduleSpec:
    """A schedule's definition with every argument checked (``ConfigurationError``)."""
    _check_name(name)
    try:
        validate_capability(capability)
        prio = Priority(priority)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    if overlap not in OVERLAPS:
        raise ConfigurationError(f"overlap must be one of {', '.join(OVERLAPS)}, not {overlap!r}")
    seconds = 0
    if every is not None:
        raw = every.total_seconds() if isinstance(every, datetime.timedelta) else float(every)
        if not 1 <= raw <= MAX_WAIT or raw != int(raw):
            raise ConfigurationError(
                f"every must be whole seconds, 1 to {MAX_WAIT} (five years), not {raw:g}s"
            )
        seconds = int(raw)
    # checked as the server would, and a cron line must be due some time (the server
    # takes a line that never is, e.g. 31 February, and never fires it)
    timing(seconds, cron or "", tz or "").next_after(now_ms(), now_ms())
    if timeout is not None and not timeout > 0:
        raise ConfigurationError("timeout must be > 0 seconds")
    if max_attempts is not None and not 1 <= max_attempts <= 100:
        raise ConfigurationError("max_attempts must be between 1 and 100")
    try:
        body = encode_payload(payload)
    except TypeError as exc:
        raise ConfigurationError(str(exc)) from None
    return ScheduleSpec(
        name=name,
        capability=capability,
        priority=prio,
        payload=body,
        every=seconds,
        cron=(cron or "").strip(),
        tz=tz or "",
        overlap=overlap,
        timeout=float(timeout or 0.0),
        max_attempts=max_attempts or 0,
        version=version or "",
        required_tags=list(required_tags),
        caller=caller,
        created_ms=now_ms(),
    )


def _timing(spec: ScheduleSpec) -> Timing:
    return timing(spec.every, spec.cron, spec.tz)


def _headers(store: TaskStore, spec: ScheduleSpec) -> dict[str, str]:
    headers = {SCHEDULE_NAME: spec.name}
    if spec.paused:
        headers["Nats-Rollup"] = "sub"  # the one definition; none that fires
        return headers
    headers["Nats-Schedule"] = _timing(spec).header()
    if spec.cron and spec.tz:
        headers["Nats-Schedule-Time-Zone"] = spec.tz
    headers["Nats-Schedule-Target"] = store.subjects.schedule_fire(
        spec.name, spec.capability, spec.priority
    )
    return headers


async def define(store: TaskStore, spec: ScheduleSpec) -> ScheduleInfo:
    """Store ``spec`` (replacing any schedule of that name); what is stored. A line or
    zone the server refuses is a ``ConfigurationError`` with its reason."""
    await store.ensure_schedules()
    try:
        subject = store.subjects.schedule(spec.name)
        await store.publish(subject, _encode(spec), _headers(store, spec))
    except nats.js.errors.BadRequestError as exc:
        raise ConfigurationError(
            f"schedule {spec.name!r}: the server refused it: {exc.description}"
        ) from None
    got = await get_schedule(store, spec.name)
    if got is None:  # removed at once by another process
        raise ConfigurationError(f"schedule {spec.name!r} was removed as it was stored")
    return got


def _info(store_got: Got, spec: ScheduleSpec, last: int, now: int) -> ScheduleInfo:
    stored = store_got.stored_ms or spec.created_ms
    nxt = None if spec.paused else _timing(spec).next_after(max(now, last), stored)
    return ScheduleInfo(spec=spec, stored_ms=stored, next_ms=nxt, last_ms=last)


@dataclass(frozen=True, slots=True)
class _Covered:
    """What the firings of a schedule did so far: the last period covered and the last
    one made a task (not skipped), unix ms (0: none); the revision of their key."""

    last: int = 0
    made: int = 0
    revision: int = 0
    #: the key's newest message is a delete marker: the schedule was removed
    removed: bool = False

    def value(self) -> bytes:
        return f"{self.last} {self.made}".encode()


async def _covered(store: TaskStore, name: str) -> _Covered:
    value, rev = await store.idem_latest(idem_key("sched", name))
    if value is None and rev:
        return _Covered(revision=rev, removed=True)
    try:
        last, _, made = (value or b"").decode().partition(" ")
        return _Covered(int(last or 0), int(made or 0), rev)
    except ValueError:
        return _Covered(revision=rev)


async def get_schedule(store: TaskStore, name: str) -> ScheduleInfo | None:
    """The schedule called ``name``; None when there is none."""
    _check_name(name)
    got = await store.last_on(store.subjects.schedule(name))
    if got is None:
        return None
    try:
        spec = _decode(got.data)
    except msgspec.DecodeError:
        raise CorruptRecord(name, "its definition does not decode as a schedule") from None
    return _info(got, spec, (await _covered(store, name)).last, now_ms())


async def _definitions(store: TaskStore, limit: int) -> dict[str, bool]:
    """name -> paused, of every definition (at most ``limit`` names), read in pages of
    batched direct gets (a work-queue stream takes no consumer without acks, so no
    headers-only scan). A name with two messages (writers raced a rollup) is counted
    once, as its newest says."""
    out: dict[str, bool] = {}
    async for got in store.each_on(store.subjects.schedules()):
        name = got.headers.get(SCHEDULE_NAME, "")
        if not _NAME.fullmatch(name):
            continue
        if name not in out and len(out) >= limit:
            break
        out[name] = "Nats-Schedule" not in got.headers
    return out


async def list_schedules(store: TaskStore, limit: int = 1000) -> list[ScheduleInfo]:
    """Every schedule, by name (at most ``limit``)."""
    out: list[ScheduleInfo] = []
    for name in sorted(await _definitions(store, limit)):
        info = await get_schedule(store, name)
        if info is not None:
            out.append(info)
    return out


async def count_schedules(store: TaskStore, limit: int = 10_000) -> dict[str, int]:
    """Schedules by state (``active``, ``paused``), from their definitions' headers (a
    page of definitions to a request)."""
    found = await _definitions(store, limit)
    paused = sum(found.values())
    return {"active": len(found) - paused, "paused": paused}


async def count_scheduled(store: TaskStore) -> int:
    """Delayed tasks (and retries later) the server holds now: one schedule message each,
    counted by the server (one message read, however many wait)."""
    return await store.count(store.subjects.task_at_all())


async def remove(store: TaskStore, name: str) -> bool:
    """Remove the schedule (its definition, so the server fires it no more, and the last
    period it covered); False when there was none. Firings already stored are dropped
    by the agents that take them; tasks already made run."""
    _check_name(name)
    subject = store.subjects.schedule(name)
    had = False
    for _ in range(_STATE_TRIES):  # one message; a few if writers raced a rollup
        got = await store.last_on(subject)
        if got is None:
            break
        had = await store.delete_message(got.seq) or had
    rev = (await _covered(store, name)).revision
    if rev:  # (a firing that covered a period meanwhile leaves its key: harmless)
        with contextlib.suppress(Conflict):
            await store.idem_delete(idem_key("sched", name), rev)
    return had


async def set_paused(store: TaskStore, name: str, paused: bool) -> ScheduleInfo:
    """Pause (nothing fires; the definition stays) or resume (the periods from now on,
    none made up for the pause: the definition is stored anew, and its periods count from
    then) the schedule; ``ConfigurationError`` when there is none."""
    info = await get_schedule(store, name)
    if info is None:
        raise ConfigurationError(f"no schedule is called {name!r}")
    if info.spec.paused == paused:
        return info
    # stored again: the periods count from now on, none is made up for the pause
    return await define(store, msgspec.structs.replace(info.spec, paused=paused))


#: the last covered period is kept as long as its schedule (no TTL)
_NO_TTL: float | None = None


# -- firings ---------------------------------------------------------------------------


#: the task token of a firing's subject starts so (``Subjects.schedule_fire``); never a
#: task id's, which has no ``$``
_FIRE_TOKEN = ".task.$fire-"


def is_firing(msg: Msg) -> bool:
    """A periodic schedule's firing (not a task): it names its schedule and came on a
    firing subject. By our own marks only: a firing put back as a new message
    (``hand_back`` on its last delivery) has lost the server's ``Nats-*`` headers."""
    return SCHEDULE_NAME in (msg.headers or {}) and _FIRE_TOKEN in msg.subject


async def fire(ex: Executor, msg: Msg) -> None:
    """Turn one firing into the tasks of the periods it covers, then ack it. Put back
    (to be tried again) when JetStream cannot answer; dropped (logged, counted) when the
    stored definition is one no firing can use, or JetStream refuses its task for good:
    trying again would not change it, only repeat the refusal every second. The periods
    it did not make stay uncovered, so the next firing tries them again."""
    try:
        await _fire(ex, msg)
    except _REFUSED as exc:
        ex.stats.firings_dropped += 1
        log.error(
            "schedule firing %s: dropped: JetStream refused it for good: %r", msg.subject, exc
        )
    except _TRIED_AGAIN as exc:
        log.warning("schedule firing %s: not handled (%r); tried again", msg.subject, exc)
        await ex.hand_back(msg, 1.0)
        return
    except ConfigurationError as exc:
        ex.stats.firings_dropped += 1
        log.error("schedule firing %s: dropped: %s", msg.subject, exc)
    await msg.ack()


async def _fire(ex: Executor, msg: Msg) -> None:
    store, stats = ex.store, ex.stats
    name = (msg.headers or {}).get(SCHEDULE_NAME, "")
    got = await store.last_on(store.subjects.schedule(name)) if _NAME.fullmatch(name) else None
    if got is None:
        log.info("schedule %r: a firing of a schedule that is gone: dropped", name)
        return
    try:
        spec = _decode(got.data)
    except msgspec.DecodeError:
        stats.firings_dropped += 1
        log.error("schedule %r: its definition does not decode; firing dropped", name)
        return
    if spec.paused:
        stats.firings_skipped += 1
        return
    tick = int(msg.metadata.timestamp.timestamp() * 1000) if msg.metadata.timestamp else now_ms()
    anchor = got.stored_ms or spec.created_ms
    when = _timing(spec)
    key = idem_key("sched", name)
    for tries in range(_STATE_TRIES):
        done = await _covered(store, name)
        if tries or done.removed:
            # a conflict, or the key deleted: the schedule may have been removed (or
            # defined anew) since we read it; then stop, never make its periods up again
            # from its start (the key of one defined anew counts from its own start)
            again = await store.last_on(store.subjects.schedule(name))
            if again is None or again.seq != got.seq:
                log.info("schedule %r: removed or changed while it fired: stopped", name)
                return
        due, missed = catch_up(when, max(done.last, anchor), tick + 500, anchor, CATCH_UP)
        if not due:
            return  # covered by a firing handled before this one
        if missed:
            stats.firings_missed += missed
            log.error(
                "schedule %r: %d periods missed (more than %d to make up at once)",
                name,
                missed,
                CATCH_UP,
            )
        made = done.made
        for at in due:
            if await _one(ex, spec, at, firing_id(name, made) if made else ""):
                made = at
        now = _Covered(due[-1], made)
        try:
            if done.revision:
                await store.idem_renew(key, now.value(), _NO_TTL, done.revision)
            else:
                await store.idem_create(key, now.value(), _NO_TTL)
            return
        except Conflict:
            continue  # another firing covered periods meanwhile: look again
    raise Conflict(f"schedule {name}: its last period kept changing")


async def _one(ex: Executor, spec: ScheduleSpec, due: int, previous: str) -> bool:
    """The task of one period; False when it was skipped (``overlap="skip"`` and the
    task of the period made before, ``previous``, is not final): a ``skipped`` record."""
    store, stats = ex.store, ex.stats
    task_id = firing_id(spec.name, due)
    at = now_ms()
    sub = TaskSubmit(
        task_id=task_id,
        capability=spec.capability,
        priority=spec.priority,
        payload=spec.payload,
        timeout=spec.timeout,
        max_attempts=spec.max_attempts,
        version=spec.version,
        required_tags=list(spec.required_tags),
        caller=spec.caller or f"schedule:{spec.name}",
        submitted_ms=at,
        due_ms=due,
        schedule=spec.name,
    )
    if spec.overlap == "skip" and await _still_running(store, previous):
        rec = pending_record(sub, 0, at)
        err = ErrorBody(code="skipped", message=f"the previous firing ({previous}) still runs")
        skipped = advance(rec, [S.CANCELLED], at, "skipped", error=err)
        try:
            await store.write(skipped, 0)
        except Conflict:
            return False  # the period has a record already: handled before
        stats.firings_skipped += 1
        return False
    await publish_task(store, sub)
    stats.fired += 1
    if at - due > LATE_MS:
        stats.fired_late += 1
        log.warning(
            "schedule %r: the period due %s entered the queue %.1fs late",
            spec.name,
            datetime.datetime.fromtimestamp(due / 1000, datetime.UTC).isoformat(),
            (at - due) / 1000,
        )
    return True


async def _still_running(store: TaskStore, previous: str) -> bool:
    """Whether the task of the period made before is not final yet."""
    if not previous:
        return False
    try:
        st = await store.lookup(previous)
    except CorruptRecord:
        return True  # its next handler replaces the record: not ended
    return st is not None and not st.record.final
