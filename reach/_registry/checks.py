"""Everything a registry receives is checked before it is stored: pure functions.

A registration names things that become subjects and routing inputs, so a bad one is
refused (``bad_request``, with the field named). A heartbeat's numbers feed every client's
routing choice: a peer reporting ``load=-1e9`` must not attract traffic, so numbers out of
range are clamped into it (and counted); JSON cannot carry NaN or infinity, and anything
else that is not finite is refused.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from .._subjects import MAX_NAME, validate_agent_id, validate_capability, validate_topic
from ..wire import Heartbeat, Registration

__all__ = [
    "MAX_CAPABILITIES",
    "MAX_COUNT",
    "MAX_LATENCY_MS",
    "MAX_REASON",
    "MAX_TAGS",
    "MAX_TOPICS",
    "check_registration",
    "is_stale",
    "sanitize_heartbeat",
]

MAX_CAPABILITIES = 256
MAX_TAGS = 64
MAX_TOPICS = 256
MAX_METADATA = 64
MAX_CONCURRENCY = 1_000_000
MAX_COUNT = 2**53 - 1  # counters and unix ms: the largest integer every JSON reader keeps
MAX_LATENCY_MS = 86_400_000.0  # a day
MAX_REASON = 200  # characters of a heartbeat's reason kept (it is for people, one line)
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,31}")
_COUNTS = ("seq", "inflight", "queue_len", "served", "failed", "dropped", "sent_ms")


def _check_label(kind: str, value: str) -> None:
    if not value or len(value) > MAX_NAME or not value.isprintable():
        raise ValueError(f"{kind} {value[:40]!r} must be 1-{MAX_NAME} printable characters")


def check_registration(reg: Registration) -> None:
    """Raise ValueError naming the first field a registry must not store."""
    info = reg.info
    validate_agent_id(info.agent_id)
    _check_label("name", info.name)
    if len(info.capabilities) > MAX_CAPABILITIES:
        raise ValueError(f"{len(info.capabilities)} capabilities; at most {MAX_CAPABILITIES}")
    for cap in info.capabilities:
        validate_capability(cap.name)
        if not _VERSION.fullmatch(cap.version):
            raise ValueError(
                f"capability {cap.name!r} has version {cap.version[:40]!r}; use e.g. '1.2'"
            )
    if len(info.topics) > MAX_TOPICS:
        raise ValueError(f"{len(info.topics)} topics; at most {MAX_TOPICS}")
    for topic in info.topics:
        validate_topic(topic.pattern, wildcards=True)
    if len(info.tags) > MAX_TAGS:
        raise ValueError(f"{len(info.tags)} tags; at most {MAX_TAGS}")
    for tag in info.tags:
        _check_label("tag", tag)
        if "," in tag or any(c.isspace() for c in tag):
            raise ValueError(f"tag {tag[:40]!r} contains a comma or a space")
    if not 1 <= info.max_concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"max_concurrency {info.max_concurrency} is not in 1..{MAX_CONCURRENCY}")
    if not 0 <= info.max_queue <= MAX_COUNT:
        raise ValueError(f"max_queue {info.max_queue} is not in 0..{MAX_COUNT}")
    if len(info.metadata) > MAX_METADATA:
        raise ValueError(f"{len(info.metadata)} metadata entries; at most {MAX_METADATA}")


def sanitize_heartbeat(hb: Heartbeat) -> tuple[Heartbeat | None, bool]:
    """(heartbeat fit to store, whether a field was clamped); None when it must be
    dropped (a number that is not finite). A reason is cut to one printable line of at
    most ``MAX_REASON`` characters."""
    if not (math.isfinite(hb.load) and math.isfinite(hb.latency_ms)):
        return None, False
    changes: dict[str, Any] = {}
    for name in _COUNTS:
        value = getattr(hb, name)
        if not 0 <= value <= MAX_COUNT:
            changes[name] = min(max(value, 0), MAX_COUNT)
    if not 0.0 <= hb.load <= 1.0:  # inflight / max_concurrency
        changes["load"] = min(max(hb.load, 0.0), 1.0)
    if not 0.0 <= hb.latency_ms <= MAX_LATENCY_MS:
        changes["latency_ms"] = min(max(hb.latency_ms, 0.0), MAX_LATENCY_MS)
    if len(hb.reason) > MAX_REASON or not hb.reason.isprintable():
        printable = "".join(c if c.isprintable() else " " for c in hb.reason[:MAX_REASON])
        changes["reason"] = printable
    if not changes:
        return hb, False
    return msgspec.structs.replace(hb, **changes), True


def is_stale(hb: Heartbeat, stored: Heartbeat | None) -> bool:
    """True when ``hb`` is not newer than the heartbeat already stored: both its ``seq``
    and its ``sent_ms`` say so. A restarted agent (seq from 1, later clock) is not stale;
    a probe answer (seq 0) never is."""
    if stored is None or hb.seq == 0:
        return False
    return hb.seq <= stored.seq and hb.sent_ms <= stored.sent_ms
