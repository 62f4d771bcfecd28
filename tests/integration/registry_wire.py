"""Talking to a registry the way any agent can: plain NATS and the wire structs.

A test that needs an agent to misbehave (stop heartbeating, send numbers out of range,
register with a bad capability) plays that agent here instead of reaching into ``Agent``.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import msgspec
import nats.js.errors
from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from reach.settings import ReachSettings
from reach.testing import unique_prefix
from reach.wire import (
    AgentInfo,
    AgentRecord,
    CapabilityInfo,
    Deregistration,
    Heartbeat,
    Registration,
)

ERROR = "Nats-Service-Error-Code"


def fast_settings(url: str, **changes: float) -> ReachSettings:
    """Short leases so silence becomes status within a second or two."""
    values: dict[str, float] = {
        "heartbeat_interval": 0.2,
        "lease_ttl": 1.0,
        "probe_timeout": 0.5,
        "down_grace": 1.0,
        "register_backoff": 0.05,
        "register_backoff_max": 0.3,
        **changes,
    }
    return ReachSettings(nats_url=url, subject_prefix=unique_prefix(), **values)


def info(agent_id: str, *, capability: str = "geo.lookup", tags: tuple[str, ...] = ()) -> AgentInfo:
    return AgentInfo(
        agent_id=agent_id,
        name="geo",
        capabilities=[CapabilityInfo(name=capability, version="1.0")],
        tags=list(tags),
    )


async def register(
    nc: NatsConnection,
    s: ReachSettings,
    body: AgentInfo | bytes,
    *,
    subject_id: str | None = None,
    legacy: bool = False,
) -> Msg:
    """One registration request on ``<prefix>.registry.register.<id>`` (the body's agent
    id unless ``subject_id`` says otherwise; ``legacy``: the old subject without an id);
    the raw answer (an error reply carries ``ERROR``)."""
    data = body if isinstance(body, bytes) else msgspec.json.encode(Registration(info=body))
    if subject_id is None and not legacy:
        assert isinstance(body, AgentInfo), "raw bodies need a subject_id"
        subject_id = body.agent_id
    return await nc.request(_subject(s, "register", subject_id, legacy), data, timeout=10)


async def deregister(
    nc: NatsConnection,
    s: ReachSettings,
    agent_id: str,
    *,
    subject_id: str | None = None,
    legacy: bool = False,
) -> Msg:
    data = msgspec.json.encode(Deregistration(agent_id=agent_id))
    subject = _subject(s, "deregister", subject_id or agent_id, legacy)
    return await nc.request(subject, data, timeout=10)


def _subject(s: ReachSettings, verb: str, agent_id: str | None, legacy: bool) -> str:
    base = f"{s.subject_prefix}.registry.{verb}"
    return base if legacy else f"{base}.{agent_id}"


async def heartbeat(nc: NatsConnection, s: ReachSettings, agent_id: str, body: bytes) -> None:
    await nc.publish(f"{s.subject_prefix}.hb.{agent_id}", body)


def beat(agent_id: str, seq: int, **fields: object) -> bytes:
    return msgspec.json.encode(Heartbeat(agent_id=agent_id, seq=seq, **fields))  # type: ignore[arg-type]


async def stored(nc: NatsConnection, s: ReachSettings, agent_id: str) -> AgentRecord | None:
    """The record in KV right now, or None (absent, a marker, or undecodable)."""
    try:
        kv = await nc.jetstream().key_value(f"{s.subject_prefix.replace('.', '_')}_agents")
        entry = await kv.get(agent_id)
    except (
        nats.js.errors.BucketNotFoundError,
        nats.js.errors.KeyNotFoundError,
        nats.js.errors.InvalidKeyError,
    ):
        return None  # no bucket yet, or the key deleted or purged
    if not entry.value:
        return None
    try:
        return msgspec.json.decode(entry.value, type=AgentRecord)
    except msgspec.DecodeError:
        return None


class WireAgent:
    """An agent made of three subscriptions: it answers ``$ping`` and one capability on its
    direct subject, registers when asked to, and sends heartbeats only when a test says so."""

    def __init__(self, nc: NatsConnection, s: ReachSettings, agent_id: str) -> None:
        self.nc = nc
        self.settings = s
        self.agent_id = agent_id
        self.subs: list[Subscription] = []

    async def __aenter__(self) -> WireAgent:
        p, a = self.settings.subject_prefix, self.agent_id

        async def pong(msg: Msg) -> None:
            await self.nc.publish(msg.reply, beat(a, 0))

        async def serve(msg: Msg) -> None:
            await self.nc.publish(msg.reply, msgspec.json.encode({"by": a}))

        self.subs.append(await self.nc.subscribe(f"{p}.agent.{a}.$ping", cb=pong))
        self.subs.append(await self.nc.subscribe(f"{p}.agent.{a}.geo.lookup", cb=serve))
        await self.nc.flush()
        reply = await register(self.nc, self.settings, info(a))
        assert not reply.headers or ERROR not in reply.headers, reply.headers
        return self

    async def __aexit__(self, *exc: object) -> None:
        for sub in self.subs:
            await sub.unsubscribe()


class Relay:
    """A TCP relay in front of a real nats-server, to see what a client does to the wire.

    It counts connections, and once the client sends ``trigger`` it stops passing the
    client's bytes on: it holds them until ``release()`` (``hold=True``) or drops them, so
    a start can be caught halfway (the server never sees what comes after). ``cut()``
    drops every connection and refuses new ones until ``mend()``."""

    def __init__(self, upstream: str, trigger: bytes = b"", *, hold: bool = True) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 4222)
        self.trigger = trigger
        self.hold = hold
        self.connections = 0  # accepted so far
        self.open = 0  # still open
        self.triggered = asyncio.Event()
        self._released = asyncio.Event()
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"nats://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def release(self) -> None:
        self._released.set()

    def cut(self) -> None:
        self._cut = True
        for writer in self._writers:
            writer.close()

    def mend(self) -> None:
        self._cut = False

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        self.connections += 1
        self.open += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            self._writers.update((writer, up_writer))
            await asyncio.gather(
                self._pump(reader, up_writer, outbound=True),
                self._pump(up_reader, writer, outbound=False),
            )
        finally:
            writer.close()
            self._writers.discard(writer)
            self.open -= 1

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, outbound: bool
    ) -> None:
        try:
            while data := await src.read(65536):
                if outbound and self.trigger and self.trigger in data:
                    self.triggered.set()
                if outbound and self.triggered.is_set() and not self._released.is_set():
                    if not self.hold:
                        continue
                    await self._released.wait()
                dst.write(data)
                await dst.drain()
        except OSError:
            return  # the other side went away: the relay ends with it
        finally:
            dst.close()
            self._writers.discard(dst)
