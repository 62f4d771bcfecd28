"""Routing configuration that changes without restarts: the watched ``<prefix>_config`` bucket.

Keys: ``weights.<capability>`` -> ``{"w_load", "w_latency", "threshold"}`` for the scored
policy, and ``task.<task type>`` -> the capability name that serves it. A deleted key falls
back to the settings' value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsConnection
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from ._router import Router
from ._routing import Weights
from ._subjects import validate_capability

log = logging.getLogger("reach.config")

WEIGHTS = "weights."
TASK = "task."


class _WeightsBody(msgspec.Struct, forbid_unknown_fields=False):
    w_load: float = 4.0
    w_latency: float = 2.0
    threshold: float = 0.3


async def config_bucket(nc: NatsConnection, bucket: str, *, create: bool) -> KeyValue:
    js = nc.jetstream()
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            raise
    config = KeyValueConfig(
        bucket=bucket,
        history=5,
        storage=StorageType.FILE,
        description="Agent-Reach routing configuration",
    )
    with contextlib.suppress(nats.js.errors.BadRequestError):
        return await js.create_key_value(config=config)
    return await js.key_value(bucket)


class ConfigMirror:
    """Applies the bucket's keys to a Router as they change."""

    def __init__(self, nc: NatsConnection, bucket: str, router: Router) -> None:
        self._nc = nc
        self.bucket = bucket
        self._router = router
        self._base_weights = dict(router.weights)
        self._base_tasks = dict(router.task_types)
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout: float) -> bool:
        await self.stop()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                kv = await config_bucket(self._nc, self.bucket, create=False)
                self._watcher = await kv.watchall()
                self._task = asyncio.ensure_future(self._consume(self._watcher, ready))
                await ready
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError):
            return False
        return True

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _consume(self, watcher: Any, ready: asyncio.Future[None]) -> None:
        async for entry in watcher:
            if entry is None:
                if not ready.done():
                    ready.set_result(None)
                continue
            value = entry.value if entry.operation is None else None
            self.apply(entry.key, value or None)

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
            log.warning("config key %s ignored: %s", key, exc)
