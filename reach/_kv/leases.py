"""Leases in JetStream KV: compare-and-set writes that carry a per-message TTL.

See NATS-FACTS.md: ``kv.put``/``kv.update`` cannot set a TTL and would make a key permanent,
so every write here is a raw publish with ``Nats-TTL`` and ``Nats-Expected-Last-Subject-
Sequence``; expiries reach watchers as markers (nats-py reports them as PURGE).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from .._nats import TRANSIENT

log = logging.getLogger("reach.kv")

KV_OP = "KV-Operation"
MARKER_REASON = "Nats-Marker-Reason"
MARKER_TTL = 60.0


class LeaseConflict(Exception):
    """Another writer changed the key since the revision we read."""


@dataclass(frozen=True, slots=True)
class Latest:
    """The newest message of a key: its revision, and its value unless it is a marker;
    ``operation`` says which marker ("DEL", "PURGE"; an expiry is a "PURGE")."""

    revision: int
    value: bytes | None
    operation: str | None = None


async def check_replicas(js: JetStreamContext, stream: str, wanted: int) -> int:
    """The replicas ``stream`` has (0: could not look); a warning when fewer than ``wanted``.

    An existing stream is never changed: moving data between servers is the operator's call,
    and processes with different settings would otherwise undo each other's changes.
    """
    try:
        info = await js.stream_info(stream)
    except TRANSIENT as exc:  # a check, not a reason to fail a start (no right to look, say)
        log.warning("replicas of stream %s not checked: %s: %s", stream, type(exc).__name__, exc)
        return 0
    have = info.config.num_replicas or 1
    if have < wanted:
        log.warning(
            "stream %s has %d replica(s), the settings ask for %d (REACH_REPLICAS, "
            "REACH_TASK_REPLICAS): it was made before with fewer and Reach leaves it as it is "
            "(to scale it: nats stream edit %s --replicas %d)",
            stream,
            have,
            wanted,
            stream,
            wanted,
        )
    return have


async def bind_bucket(js: JetStreamContext, config: KeyValueConfig, *, create: bool) -> KeyValue:
    """Bind a bucket, creating it with ``config`` when asked and missing. A creator finding
    it made with fewer replicas than ``config.replicas`` logs it (``check_replicas``)."""
    assert config.bucket is not None
    try:
        kv = await js.key_value(config.bucket)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            raise
    else:
        if create and config.replicas > 1:  # R1 is the least: nothing to check
            await check_replicas(js, f"KV_{config.bucket}", config.replicas)
        return kv
    with contextlib.suppress(nats.js.errors.BadRequestError):
        return await js.create_key_value(config=config)
    return await js.key_value(config.bucket)  # a concurrent writer created it first


async def agents_bucket(
    js: JetStreamContext, bucket: str, *, create: bool, replicas: int = 1
) -> KeyValue:
    """The leases bucket: memory storage, history 1, expiry markers on, ``replicas`` copies."""
    config = KeyValueConfig(
        bucket=bucket,
        history=1,
        storage=StorageType.MEMORY,
        replicas=replicas,
        limit_marker_ttl=MARKER_TTL,
        description="Agent-Reach leases: one record per agent, TTL renewed by heartbeats",
    )
    return await bind_bucket(js, config, create=create)


def ttl_header(ttl: float) -> str:
    return f"{max(1, int(ttl * 1000))}ms"


async def write_lease(
    js: JetStreamContext, bucket: str, key: str, value: bytes, *, ttl: float, last: int
) -> int:
    """Write ``value`` iff the key's newest revision is ``last`` (0: key absent); new revision."""
    headers = {
        "Nats-Expected-Last-Subject-Sequence": str(last),
        "Nats-TTL": ttl_header(ttl),
    }
    try:
        ack = await js.publish(f"$KV.{bucket}.{key}", value, headers=headers)
    except nats.js.errors.APIError as exc:
        if exc.err_code in (10071, 10164):
            raise LeaseConflict(key) from exc
        raise
    return int(ack.seq)


async def remove(
    js: JetStreamContext, bucket: str, key: str, *, last: int | None, ttl: float | None = None
) -> int:
    """Delete marker (history 1 drops the value), compare-and-set when ``last`` is given.
    With ``ttl`` the marker itself expires, so keys that come and go leave nothing behind."""
    headers = {KV_OP: "DEL"}
    if ttl is not None:
        headers["Nats-TTL"] = ttl_header(ttl)
    if last is not None:
        headers["Nats-Expected-Last-Subject-Sequence"] = str(last)
    try:
        ack = await js.publish(f"$KV.{bucket}.{key}", b"", headers=headers)
    except nats.js.errors.APIError as exc:
        if exc.err_code in (10071, 10164):
            raise LeaseConflict(key) from exc
        raise
    return int(ack.seq)


async def latest(js: JetStreamContext, bucket: str, key: str) -> Latest:
    """Read the newest message of ``key`` straight from the stream (markers included)."""
    try:
        msg = await js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
    except nats.js.errors.NotFoundError:
        return Latest(0, None)
    headers = msg.headers or {}
    revision = int(msg.seq or 0)
    if KV_OP in headers:
        return Latest(revision, None, headers[KV_OP])
    if MARKER_REASON in headers:
        return Latest(revision, None, "PURGE")
    if not msg.data:
        return Latest(revision, None)
    return Latest(revision, bytes(msg.data))
