"""Binding KV buckets: open one, or create it with its config when asked and missing, and
say when an existing stream has fewer replicas than the settings ask for."""

from __future__ import annotations

import contextlib
import logging

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from .._nats import TRANSIENT
from .cas import MARKER_TTL

__all__ = ["agents_bucket", "bind_bucket", "check_replicas", "routes_bucket"]

log = logging.getLogger("reach.kv")


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


def _leases(bucket: str, replicas: int, description: str) -> KeyValueConfig:
    """Soft state with per-key TTLs: memory storage, history 1, expiry markers on."""
    return KeyValueConfig(
        bucket=bucket,
        history=1,
        storage=StorageType.MEMORY,
        replicas=replicas,
        limit_marker_ttl=MARKER_TTL,
        description=description,
    )


async def agents_bucket(
    js: JetStreamContext, bucket: str, *, create: bool, replicas: int = 1
) -> KeyValue:
    """The leases bucket: one record per agent (key: its id), ``replicas`` copies."""
    config = _leases(
        bucket, replicas, "Agent-Reach leases: one record per agent, TTL renewed by heartbeats"
    )
    return await bind_bucket(js, config, create=create)


async def routes_bucket(
    js: JetStreamContext, bucket: str, *, create: bool, replicas: int = 1
) -> KeyValue:
    """The leases again, by capability (key ``<capability>.<agent id>``, one per capability
    an agent serves): what lets a client follow only the capabilities it calls."""
    config = _leases(
        bucket, replicas, "Agent-Reach routes: each lease under every capability it serves"
    )
    return await bind_bucket(js, config, create=create)
