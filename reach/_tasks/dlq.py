"""Dead letters: a task that failed for good is copied to stream ``REACH_DLQ`` before its
message leaves the task stream, so it is never lost; it stays for ``dlq_retention``.

A dead letter is the original message body and headers, plus ``Reach-Dlq-*`` headers
saying why (reason, error, attempts). Its ``Nats-Msg-Id`` names the kind, the task and how
many attempts it had (``dlq.<kind>.<task_id>.<attempts>``), nothing else: an agent that
resends it after a crash and a registry handling the task's max-deliveries advisory make
the same id for the same task, so the stream keeps one copy (within its duplicate window).
Only a message with no task id falls back to its stream sequence.

Durable topics (``reach._topics``) write their dead letters here too, as kind ``topic``, on
a subject and with a message id of their own (``dlq.$topic.<topic>``,
``dlq.topic.<consumer>.<sequence>``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec
from nats.js import JetStreamContext

from .._subjects import Subjects
from ..wire.tasks import TaskAttempt

__all__ = [
    "DLQ_ATTEMPTS",
    "DLQ_CONSUMER",
    "DLQ_ERROR",
    "DLQ_GROUP",
    "DLQ_KIND",
    "DLQ_REASON",
    "DLQ_SEQ",
    "TASK_ID",
    "DlqWriter",
    "dead_letter",
]

TASK_ID = "Reach-Task-Id"
DLQ_REASON = "Reach-Dlq-Reason"
DLQ_ERROR = "Reach-Dlq-Error"
DLQ_ATTEMPTS = "Reach-Dlq-Attempts"
DLQ_KIND = "Reach-Dlq-Kind"
#: a durable topic's letter (kind ``topic``): the agent name whose subscription gave up on
#: it, that subscription's consumer (a replay goes to it alone), and the message's sequence
#: in the topics stream
DLQ_GROUP = "Reach-Dlq-Group"
DLQ_CONSUMER = "Reach-Dlq-Consumer"
DLQ_SEQ = "Reach-Dlq-Seq"
_MAX_HEADER = 2000
_attempts_encoder = msgspec.json.Encoder()


class DlqWriter(Protocol):
    """What a dead letter is written with: a task store, or a durable topics' store."""

    @property
    def js(self) -> JetStreamContext: ...
    @property
    def subjects(self) -> Subjects: ...


def _one_line(text: str) -> str:
    """A header value: no line breaks, bounded."""
    return " ".join(text.split())[:_MAX_HEADER]


def _attempts_header(attempts: Sequence[TaskAttempt]) -> str:
    """The attempts as JSON, bounded: the newest that fit, whole (a cut list would not
    decode)."""
    items = list(attempts)
    while True:
        text = _attempts_encoder.encode(items).decode()
        if len(text) <= _MAX_HEADER or not items:
            return text
        items = items[1:]


async def dead_letter(
    store: DlqWriter,
    *,
    capability: str,
    task_id: str,
    data: bytes,
    headers: Mapping[str, str] | None,
    reason: str,
    error: str,
    attempts: Sequence[TaskAttempt] = (),
    kind: str = "task",
    seq: int = 0,
    subject: str = "",
    msg_id: str = "",
) -> int:
    """Publish one dead letter and wait for the stream's ack; its DLQ sequence. ``seq``
    (the task message's stream sequence) names a letter only when ``task_id`` is empty.
    ``subject`` and ``msg_id`` replace the task's (``dlq.<capability>``, ``dlq.<kind>.
    <task_id>.<attempts>``) for a letter that is not a task's (a durable topic's)."""
    hdrs = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-")}
    if not msg_id:
        msg_id = f"dlq.{kind}.{task_id}.{len(attempts)}" if task_id else f"dlq.{kind}.unknown.{seq}"
    hdrs.update(
        {
            "Nats-Msg-Id": msg_id,
            TASK_ID: task_id,
            DLQ_KIND: kind,
            DLQ_REASON: _one_line(reason),
            DLQ_ERROR: _one_line(error) or "-",
            DLQ_ATTEMPTS: _attempts_header(attempts),
        }
    )
    subject = subject or store.subjects.dlq(capability or "unknown")
    ack = await store.js.publish(subject, data, headers=hdrs)
    return int(ack.seq)
