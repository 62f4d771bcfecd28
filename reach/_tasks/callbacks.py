"""Callbacks: a task's final record, sent as a request to the subject its submitter named.

The receiver must answer (any reply without ``Nats-Service-Error-Code``); three attempts
with backoff by default, then a dead letter. ``callback_state`` in the record says which,
and the result stays readable from the record either way.
"""

from __future__ import annotations

import asyncio

import msgspec
from opentelemetry import propagate

from .._nats import TRANSIENT, NatsConnection
from ..wire import Header
from ..wire.tasks import TaskRecord
from .dlq import dead_letter
from .model import Delivery, TaskStats
from .states import retry_delay
from .store import Conflict, Stored, TaskStore

__all__ = ["deliver_callback", "send_callback", "set_callback_state"]

_encode = msgspec.json.Encoder().encode


async def deliver_callback(
    nc: NatsConnection, store: TaskStore, stats: TaskStats, d: Delivery, rec: TaskRecord
) -> None:
    """Deliver the final record as a request its receiver must answer, with retries;
    an undelivered callback becomes a dead letter. The record says which."""
    trace: dict[str, str] = {}
    if d.traced:
        propagate.inject(trace)  # the attempt's span: the callback continues its trace
    delivered = await send_callback(nc, store, rec, trace)
    if delivered:
        stats.callbacks_delivered += 1
    else:
        stats.callbacks_failed += 1
    d.stored = await set_callback_state(store, d.stored, "delivered" if delivered else "dead")


async def send_callback(
    nc: NatsConnection, store: TaskStore, rec: TaskRecord, trace: dict[str, str] | None = None
) -> bool:
    """Send the final record ``rec`` to its callback subject, with retries; False when no
    attempt was acknowledged, and the callback is then a dead letter (kind callback)."""
    s = store.settings
    body = _encode(rec)
    error = ""
    for i in range(1, s.callback_attempts + 1):
        try:
            reply = await nc.request(
                rec.callback, body, timeout=s.callback_timeout, headers=trace or None
            )
            status = (reply.headers or {}).get(Header.SERVICE_ERROR_CODE)
            if not status:
                return True
            error = f"the receiver answered {status}"
        except TRANSIENT as exc:
            error = f"{type(exc).__name__}: {exc}"
        if i < s.callback_attempts:
            await asyncio.sleep(retry_delay(i, 0.2, 2.0))
    await dead_letter(
        store,
        capability=rec.capability,
        task_id=rec.task_id,
        data=body,
        headers={"Reach-Callback": rec.callback},
        reason="callback_undelivered",
        error=error,
        attempts=rec.attempts,
        kind="callback",
    )
    return False


async def set_callback_state(store: TaskStore, st: Stored | None, state: str) -> Stored | None:
    """Write ``callback_state`` into a final record whose callback is pending; the record
    as it is then."""
    for _ in range(8):
        if st is None or not st.record.final or st.record.callback_state != "pending":
            return st
        new = msgspec.structs.replace(st.record, callback_state=state)
        try:
            return Stored(new, await store.write(new, st.revision))
        except Conflict:
            st = await store.get(new.task_id)
    return st
