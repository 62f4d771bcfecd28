"""What the status page shows, as JSON: the ``reach status`` summary (the same model, the
same JSON) plus one row per agent and the newest dead letters.

Rows are capped (``agents_shown``): a fleet of thousands gives a page, and a frame, of a
bounded size; the rows kept are the ones that need a look first (not UP), and the
snapshot says how many agents there are in all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import nats.js.errors

from ..._codec import now_ms
from ..._status import Sample, summarize, to_json
from ..._tasks.admin import DeadLetter, dead_letter_at
from ..._tasks.store import TaskStore
from ...errors import DeadLetterNotFound
from ...wire import AgentRecord, Status

__all__ = ["agent_row", "latest_dead_letters", "view"]

_ERROR_CHARS = 300  # a dead letter's error, cut for the page


def agent_row(rec: AgentRecord) -> dict[str, Any]:
    """One agent as the page's fleet table shows it."""
    hb = rec.heartbeat
    last = rec.transitions[-1] if rec.transitions else None
    return {
        "id": rec.info.agent_id,
        "name": rec.info.name,
        "version": rec.info.version,
        "status": rec.status.value,
        "capabilities": [c.name for c in rec.info.capabilities],
        "tasks": [c.name for c in rec.info.tasks],
        "tags": list(rec.info.tags),
        "inflight": hb.inflight if hb is not None else 0,
        "queue": hb.queue_len if hb is not None else 0,
        "load": hb.load if hb is not None else 0.0,
        "latency_ms": hb.latency_ms if hb is not None else 0.0,
        "last_seen_ms": rec.last_seen_ms,
        "since_ms": last.at_ms if last is not None else rec.registered_ms,
        "reason": last.reason if last is not None else "",
    }


def dead_letter_row(dl: DeadLetter) -> dict[str, Any]:
    error = dl.error if len(dl.error) <= _ERROR_CHARS else dl.error[: _ERROR_CHARS - 1] + "…"
    return {
        "seq": dl.seq,
        "task_id": dl.task_id,
        "capability": dl.capability,
        "kind": dl.kind,
        "reason": dl.reason,
        "error": error,
        "attempts": len(dl.attempts),
        "time_ms": int(dl.time.timestamp() * 1000) if dl.time is not None else None,
    }


async def latest_dead_letters(store: TaskStore, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` dead letters, newest first: read backwards from the DLQ's last
    sequence, at most ``4 * limit`` reads (replayed ones leave gaps), never a scan of the
    whole DLQ. Empty when the DLQ stream does not exist."""
    try:
        state = (await store.js.stream_info(store.dlq_stream)).state
    except nats.js.errors.NotFoundError:
        return []
    rows: list[dict[str, Any]] = []
    seq, reads = state.last_seq, 0
    while seq >= max(state.first_seq, 1) and len(rows) < limit and reads < 4 * limit:
        reads += 1
        with contextlib.suppress(DeadLetterNotFound):  # replayed, or of another prefix
            rows.append(dead_letter_row(await dead_letter_at(store, seq)))
        seq -= 1
    return rows


def _shown(records: Sequence[AgentRecord], limit: int) -> list[AgentRecord]:
    if len(records) <= limit:
        return list(records)
    first = sorted(records, key=lambda r: (r.status is Status.UP, r.info.agent_id))[:limit]
    return sorted(first, key=lambda r: r.info.agent_id)


def view(
    before: Sample | None,
    last: Sample | None,
    records: Sequence[AgentRecord],
    *,
    remembered: Sequence[str] = (),
    dead_letters: Sequence[dict[str, Any]] = (),
    agents_shown: int = 500,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The page's snapshot: ``records`` (the routing table now) with the traffic measured
    between the samples ``before`` and ``last``, and ``last``'s task census."""
    if last is None:
        last = Sample(at=time.monotonic(), wall_ms=now_ms(), records=records)
    else:
        last = dataclasses.replace(last, records=records)
    out = to_json(summarize(before, last, remembered))
    census = last.tasks
    out["updated_ms"] = now_ms()
    out["agents"] = [agent_row(r) for r in _shown(records, agents_shown)]
    out["agents_total"] = len(records)
    out["dlq"] = {
        "size": census.dead if census is not None else None,
        "latest": list(dead_letters),
    }
    out.update(extra or {})
    return out
