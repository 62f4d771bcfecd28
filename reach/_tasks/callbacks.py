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

__all__ = ["deliver_callback"]

_encode = msgspec.json.Encoder().encode


async def deliver_callback(
    nc: NatsConnection, store: TaskStore, stats: TaskStats, d: Delivery, rec: TaskRecord
) -> None:
    """Deliver the final record as a request its receiver must answer, with retries;
    an undelivered callback becomes a dead letter. The record says which."""
    s = store.settings
    body = _encode(rec)
    error = ""
    trace: dict[str, str] = {}
    if d.traced:
        propagate.inject(trace)  # the attempt's span: the callback continues its trace
    for i in range(1, s.callback_attempts + 1):
        try:
            reply = await nc.request(
                rec.callback, body, timeout=s.callback_timeout, headers=trace or None
            )
            status = (reply.headers or {}).get(Header.SERVICE_ERROR_CODE)
            if not status:
                state = "delivered"
                break
            error = f"the receiver answered {status}"
        except TRANSIENT as exc:
            error = f"{type(exc).__name__}: {exc}"
        if i < s.callback_attempts:
            await asyncio.sleep(retry_delay(i, 0.2, 2.0))
    else:
        state = "dead"
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
    if state == "delivered":
        stats.callbacks_delivered += 1
    else:
        stats.callbacks_failed += 1
    await _set_state(store, d, state)


async def _set_state(store: TaskStore, d: Delivery, state: str) -> None:
    st = d.stored
    for _ in range(8):
        if st is None or not st.record.final or st.record.callback_state != "pending":
            return
        new = msgspec.structs.replace(st.record, callback_state=state)
        try:
            d.stored = Stored(new, await store.write(new, st.revision))
            return
        except Conflict:
            st = await store.get(d.task_id)
