"""Counting tasks cheaply, for ``reach status``: per capability from the consumers' own
counters, dead letters from the DLQ's per-subject counts, delayed tasks and schedule
definitions as the server counts them (``TaskStore.count``), and records by state from a
headers-only scan that stops after ``scan_limit`` keys (so its cost is bounded however many
records the bucket keeps; the counts say when the scan stopped short).

Nothing here creates a stream: a prefix whose tasks were never used has no census (None).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import nats.js.api
import nats.js.errors

from .admin import record_meta, scan_page
from .schedules import count_scheduled
from .store import TaskStore

__all__ = ["CapabilityTasks", "TaskCensus", "census"]

_PAGE = 256  # consumers per CONSUMER.LIST page (the server's page size)
_MAX_PAGES = 16  # at most 4096 consumers read: 1365 capabilities at three priorities


@dataclass(frozen=True, slots=True)
class CapabilityTasks:
    """One capability's tasks now: ``waiting`` for an agent (not yet delivered), ``running``
    (delivered, not yet acknowledged: held by an agent or waiting for redelivery), ``dead``
    (in the dead-letter stream)."""

    waiting: int = 0
    running: int = 0
    dead: int = 0


@dataclass(frozen=True, slots=True)
class TaskCensus:
    """The task system at a glance.

    ``queued``: messages in the task stream (every task not finished yet), less
    ``scheduled`` (delayed tasks and retries later the server holds) and ``schedules``
    (periodic schedules' definitions); ``unassigned``: those of a capability no agent ever
    consumed (no consumer yet). ``states``: records by
    state among the ``scanned`` oldest of ``keys`` record keys (``capped`` when fewer than
    all); tasks nobody took yet have no record (they are the ``waiting`` ones).
    """

    queued: int = 0
    unassigned: int = 0
    dead: int = 0
    capabilities: dict[str, CapabilityTasks] = field(default_factory=dict)
    states: dict[str, int] = field(default_factory=dict)
    scanned: int = 0
    keys: int = 0
    capped: bool = False
    scheduled: int = 0
    schedules: int = 0


async def census(store: TaskStore, scan_limit: int = 10_000) -> TaskCensus | None:
    """The census of ``store``'s prefix; None when its task stream does not exist."""
    js, prefix = store.js, store.subjects.prefix
    try:
        queued = (await js.stream_info(store.stream)).state.messages
    except nats.js.errors.NotFoundError:
        return None
    scheduled = await count_scheduled(store)
    # messages, as ``queued`` is: a definition with two (writers raced a rollup) counts
    # twice for the moment, and no definition is read
    schedules = await store.count(store.subjects.schedules())
    queued = max(0, queued - scheduled - schedules)
    running: dict[str, list[int]] = {}
    head = f"{prefix}.task.*."
    for consumer in await _consumers(store):
        subject = consumer.config.filter_subject or ""
        if not subject.startswith(head):
            continue  # not one of ours (a task queue consumer filters on head.<cap>.<prio>)
        capability = subject[len(head) :].rpartition(".")[0]
        counts = running.setdefault(capability, [0, 0])
        counts[0] += consumer.num_pending or 0
        counts[1] += consumer.num_ack_pending or 0
    dead = await _dead_letters(store)
    caps = {
        cap: CapabilityTasks(
            waiting=running.get(cap, [0, 0])[0],
            running=running.get(cap, [0, 0])[1],
            dead=dead.get(cap, 0),
        )
        for cap in sorted(running.keys() | dead.keys())
    }
    assigned = sum(c.waiting + c.running for c in caps.values())
    key_prefix = f"$KV.{store.bucket}."
    seen, keys = await scan_page(
        js, f"KV_{store.bucket}", f"{key_prefix}>", last_per_subject=True, limit=scan_limit
    )
    states: dict[str, int] = {}
    for s in seen:
        meta = record_meta(key_prefix, s)
        if meta is not None:
            name = meta.state.value if meta.state is not None else "?"
            states[name] = states.get(name, 0) + 1
    return TaskCensus(
        queued=queued,
        unassigned=max(0, queued - assigned),
        dead=sum(dead.values()),
        capabilities=caps,
        states=states,
        scanned=len(seen),
        keys=keys,
        capped=len(seen) < keys,
        scheduled=scheduled,
        schedules=schedules,
    )


async def _consumers(store: TaskStore) -> list[nats.js.api.ConsumerInfo]:
    out: list[nats.js.api.ConsumerInfo] = []
    for _ in range(_MAX_PAGES):
        page = await store.js.consumers_info(store.stream, offset=len(out) or None)
        out.extend(page)
        if len(page) < _PAGE:
            break
    return out


async def _dead_letters(store: TaskStore) -> dict[str, int]:
    """Dead letters per capability (one DLQ subject per capability)."""
    dlq = store.subjects.dlq("")
    try:
        info = await store.js.stream_info(store.dlq_stream, subjects_filter=f"{dlq}>")
    except nats.js.errors.NotFoundError:
        return {}
    subjects = info.state.subjects or {}
    return {s[len(dlq) :]: n for s, n in subjects.items() if s.startswith(dlq)}
