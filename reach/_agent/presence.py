"""Presence: registration with backoff, heartbeats (at once on a status change), deregistration.
Before each heartbeat the agent reviews what time alone changes (DEGRADED by timeouts ends
after a quiet spell), so a status never waits for traffic to be corrected.

The loop runs in the agent's Background via ``keep``: if it crashes it is logged and
restarted with backoff, so an agent never goes silent while it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from .._background import Background
from .._codec import encode_json
from .._contracts.schemas import within, without_schemas
from .._nats import TRANSIENT, NatsConnection
from .._subjects import Subjects
from ..errors import NotStarted, PayloadTooLarge
from ..settings import ReachSettings
from ..wire import (
    ERROR_CODES,
    RECORD_ROOM,
    AgentEvent,
    AgentInfo,
    Deregistration,
    ErrorCode,
    Header,
    Heartbeat,
    RegisterReply,
    Registration,
    Status,
)

__all__ = ["Presence", "accept_interval"]

log = logging.getLogger("reach.agent")

_MIN_INTERVAL = 0.05  # seconds; a registry asking for less would have us flood it


def accept_interval(offered: float, setting: float) -> float:
    """The heartbeat interval to use: the registry's, if finite and within
    [50 ms, our setting]; else our setting (0 or less floods, NaN stops heartbeats)."""
    if math.isfinite(offered) and _MIN_INTERVAL <= offered <= setting:
        return offered
    if not (math.isfinite(offered) and offered >= _MIN_INTERVAL):
        log.warning("registry offers heartbeat interval %r s; keeping our %r s", offered, setting)
    return setting


_register_reply = msgspec.json.Decoder(RegisterReply)
_event = msgspec.json.Decoder(AgentEvent)
_BAD_REQUEST = str(ERROR_CODES[ErrorCode.BAD_REQUEST][0])


def _refusal(msg: Msg | None) -> tuple[str, str] | None:
    """(status code, text) of an error answer; None for none, or a reply."""
    if msg is None or not msg.headers or Header.SERVICE_ERROR_CODE not in msg.headers:
        return None
    return msg.headers[Header.SERVICE_ERROR_CODE], msg.headers.get(Header.SERVICE_ERROR, "")


class Presence:
    """How one agent tells the registry it exists: ``agent.presence``.

    ``seq`` is the number of the last heartbeat sent, ``registered`` whether a registry has
    accepted the agent since it started, ``seen`` the status the registry last published
    for it (``reach.evt.agent.<id>``; None before any, or once removed).
    """

    def __init__(
        self,
        agent_id: str,
        subjects: Subjects,
        settings: ReachSettings,
        *,
        info: Callable[[], AgentInfo],
        heartbeat: Callable[[int], Heartbeat],
        status: Callable[[], Status],
        review: Callable[[], None] = lambda: None,
    ) -> None:
        self.agent_id = agent_id
        self._subjects = subjects
        self._settings = settings
        self._info = info
        self._heartbeat = heartbeat
        self._status = status
        self._review = review  # before each beat: let time settle the agent's status
        self._nc: NatsConnection | None = None
        self._now = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None
        self.seq = 0
        self.registered = False
        self.interval = settings.heartbeat_interval
        self._need_register = True
        self.seen: Status | None = None
        self._seen_changed = asyncio.Event()
        self._halt = False
        self._left_out: tuple[str, ...] = ()  # what the last warning said was left out

    def attach(self, nc: NatsConnection | None) -> None:
        """Use ``nc`` from now on (None: the agent has stopped)."""
        self._nc = nc
        if nc is not None:
            self.registered = False
            self.seen = None
            self._need_register = True
            self.interval = self._settings.heartbeat_interval

    def _conn(self) -> NatsConnection:
        if self._nc is None:
            raise NotStarted(f"agent {self.agent_id} is not started")
        return self._nc

    def start(self, owner: Background) -> None:
        """Heartbeat (and register until it works) for as long as ``owner`` is open."""
        self._halt = False
        self._task = owner.keep(self._loop, "presence")

    async def stop(self) -> None:
        """Stop heartbeating and registering; the agent itself keeps serving (its lease then
        expires and the registry probes ``$ping``). Shutdown calls it before deregistering."""
        # The flag as well as the cancellation: on Python 3.11 a request whose answer lands
        # as it is cancelled swallows the cancellation (asyncio.wait_for, gh-86296).
        self._halt = True
        self._now.set()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # never raises; our own cancellation still does

    def nudge(self) -> None:
        """Heartbeat now, not at the next tick (the status changed)."""
        self._now.set()

    def register_again(self) -> None:
        """A registry has no record of us (``$ctl register``): register at once."""
        self._need_register = True
        self._now.set()

    async def on_event(self, msg: Msg) -> None:
        """The registry published a transition of ours."""
        try:
            event = _event.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.debug("agent %s: undecodable event: %s", self.agent_id, exc)
            return
        if event.agent_id == self.agent_id:
            self.seen = None if event.removed else event.new
            self._seen_changed.set()

    async def seen_as(self, status: Status, timeout: float) -> bool:
        """Wait until the registry has recorded us as ``status`` (so routing follows it);
        at once when no registry has us, False when ``timeout`` came first."""
        if not self.registered:
            return True
        try:
            async with asyncio.timeout(timeout):
                while self.seen != status:
                    self._seen_changed.clear()
                    await self._seen_changed.wait()
        except TimeoutError:
            return False
        return True

    async def register(self) -> bool:
        """One registration attempt; False (logged) when no registry accepted it.

        The registry stores the registration with a heartbeat and transitions, so it may
        take the server's max_payload less ``RECORD_ROOM``: the largest schemas are left
        out until it fits (one warning), and a registry that still refuses it as
        ``bad_request`` is asked again without any. ``PayloadTooLarge`` when it cannot
        fit even without schemas: no registry could store it."""
        nc = self._conn()
        info, status = self._info(), self._status()
        limit = nc.max_payload - RECORD_ROOM
        body, left_out = within(info, status, limit)
        if len(body) > limit:
            raise PayloadTooLarge(
                f"agent {self.agent_id}: its registration takes {len(body)} bytes even without"
                f" schemas, over the {limit} a registration may (the server's max_payload"
                f" {nc.max_payload} less {RECORD_ROOM} for the rest of the registry's record);"
                " serve fewer capabilities, or shorten their descriptions, tags or metadata",
                size=len(body),
                limit=limit,
            )
        self._warn_left_out(info, status, left_out, limit, nc.max_payload)
        msg = await self._request(nc, body)
        refusal = _refusal(msg)
        if refusal is not None and refusal[0] == _BAD_REQUEST:
            bare = encode_json(Registration(info=without_schemas(info), status=status))
            if bare != body:
                log.warning(
                    "agent %s: registry refused the registration (%s); registering without schemas",
                    self.agent_id,
                    refusal[1],
                )
                msg = await self._request(nc, bare)
                refusal = _refusal(msg)
        if msg is None:
            return False
        if refusal is not None:
            log.warning("agent %s: registry refused registration: %s", self.agent_id, refusal[1])
            return False
        try:
            reply = _register_reply.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.debug("agent %s: registration failed: %s", self.agent_id, exc)
            return False
        self.interval = accept_interval(reply.heartbeat_interval, self._settings.heartbeat_interval)
        self._need_register = False
        self.registered = True
        log.info("agent %s registered with %s", self.agent_id, reply.registry or "a registry")
        return True

    async def _request(self, nc: NatsConnection, body: bytes) -> Msg | None:
        """The registry's answer to ``body``; None when none came (logged at debug)."""
        try:
            return await nc.request(
                self._subjects.register(self.agent_id), body, timeout=self._settings.probe_timeout
            )
        except TRANSIENT as exc:
            log.debug("agent %s: registration failed: %s", self.agent_id, exc)
            return None

    def _warn_left_out(
        self,
        info: AgentInfo,
        status: Status,
        left_out: list[tuple[str, int]],
        limit: int,
        max_payload: int,
    ) -> None:
        """One warning for what is left out (again only when that changes)."""
        names = tuple(name for name, _ in left_out)
        if names == self._left_out:
            return
        self._left_out = names
        if not left_out:
            return
        full = len(encode_json(Registration(info=info, status=status)))
        shown = ", ".join(f"{name} ({size} bytes)" for name, size in left_out[:5])
        more = f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
        log.warning(
            "agent %s: registration takes %d bytes, over the %d a registration may (the"
            " server's max_payload %d less %d for the registry's record): registering"
            " without the schemas of %s%s",
            self.agent_id,
            full,
            limit,
            max_payload,
            RECORD_ROOM,
            shown,
            more,
        )

    async def deregister(self) -> None:
        """Tell the registry we are gone (best effort: a lease expires by itself anyway)."""
        body = encode_json(Deregistration(agent_id=self.agent_id))
        try:
            await self._conn().request(
                self._subjects.deregister(self.agent_id),
                body,
                timeout=self._settings.probe_timeout,
            )
        except TRANSIENT as exc:
            log.info("agent %s: deregistration not confirmed: %s", self.agent_id, exc)
        self.registered = False

    async def send_heartbeat(self) -> None:
        self.seq += 1
        try:
            await self._conn().publish(
                self._subjects.heartbeat(self.agent_id), encode_json(self._heartbeat(self.seq))
            )
        except TRANSIENT as exc:
            log.debug("agent %s: heartbeat not sent: %s", self.agent_id, exc)

    async def _loop(self) -> None:
        """Heartbeat every interval (at once on a status change); register until it works."""
        loop = asyncio.get_running_loop()
        backoff = self._settings.register_backoff
        register_at = loop.time() + random.uniform(0, backoff) if self._need_register else 0.0
        while not self._halt:
            now = loop.time()
            if self._need_register and now >= register_at:
                try:
                    registered = await self.register()
                except PayloadTooLarge as exc:  # a server with a smaller max_payload now
                    log.error("%s", exc)
                    registered = False
                if registered:
                    backoff = self._settings.register_backoff
                else:
                    backoff = min(backoff * 2, self._settings.register_backoff_max)
                    register_at = loop.time() + random.uniform(0, backoff)  # full jitter
                if self._halt:
                    return
            self._review()  # a status it changes goes out in this very heartbeat
            self._now.clear()
            await self.send_heartbeat()
            wait = self.interval
            if self._need_register:
                wait = max(0.0, min(wait, register_at - loop.time()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._now.wait()
