"""Routing configuration that changes without restarts: the watched ``<prefix>_config`` bucket.

Keys: ``weights.<capability>`` -> ``{"w_load", "w_latency", "threshold"}`` for the scored
policy, and ``task.<task type>`` -> the capability name that serves it. A deleted key falls
back to the settings' value. The watch itself is a ``reach._kv.BucketMirror``; this module
is its sink.
"""

from __future__ import annotations

import logging

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from .._kv import KvEntry, bind_bucket
from .._routing import Router, Weights
from .._subjects import validate_capability

__all__ = ["ConfigSink", "config_bucket"]

log = logging.getLogger("reach.config")

WEIGHTS = "weights."
TASK = "task."


class _WeightsBody(msgspec.Struct, forbid_unknown_fields=False):
    w_load: float = 4.0
    w_latency: float = 2.0
    threshold: float = 0.3


async def config_bucket(
    js: JetStreamContext, bucket: str, *, create: bool, replicas: int = 1
) -> KeyValue:
    config = KeyValueConfig(
        bucket=bucket,
        history=5,
        storage=StorageType.FILE,
        replicas=replicas,
        description="Agent-Reach routing configuration",
    )
    return await bind_bucket(js, config, create=create)


class ConfigSink:
    """Applies the bucket's keys to a Router: the whole snapshot on each (re)build, then each
    change. Keys deleted while the watch was away fall back to the settings on the rebuild."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._base_weights = dict(router.weights)
        self._base_tasks = dict(router.task_types)
        self.ignored = 0  # keys whose value could not be used

    def replace(self, snapshot: dict[str, KvEntry]) -> None:
        self._router.weights.clear()
        self._router.weights.update(self._base_weights)
        self._router.task_types.clear()
        self._router.task_types.update(self._base_tasks)
        for key, entry in snapshot.items():
            self.apply(key, entry.value)

    def update(self, key: str, entry: KvEntry) -> None:
        self.apply(key, entry.value)

    def apply(self, key: str, value: bytes | None) -> None:
        try:
            if key.startswith(WEIGHTS):
                cap = key[len(WEIGHTS) :]
                if value is None:
                    base = self._base_weights.get(cap)
                    if base is None:
                        self._router.weights.pop(cap, None)
                    else:
                        self._router.weights[cap] = base
                else:
                    body = msgspec.json.decode(value, type=_WeightsBody)
                    self._router.weights[cap] = Weights(body.w_load, body.w_latency, body.threshold)
            elif key.startswith(TASK):
                task = key[len(TASK) :]
                if value is None:
                    base_cap = self._base_tasks.get(task)
                    if base_cap is None:
                        self._router.task_types.pop(task, None)
                    else:
                        self._router.task_types[task] = base_cap
                else:
                    self._router.task_types[task] = validate_capability(value.decode())
        except (msgspec.DecodeError, ValueError, UnicodeDecodeError) as exc:
            self.ignored += 1
            log.warning("config key %s ignored: %s", key, exc)
