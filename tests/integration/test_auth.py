"""The shipped secured config (services/nats/nats-server.conf) on a real nats-server: each
user can do its job and nothing else, and every refusal reaches the caller as
``reach.Unauthorized``, at once, never as a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import nats.errors
import nats.js.api
import nats.js.errors
import pytest

from reach import (
    Agent,
    Client,
    ConnectionFailed,
    Context,
    ReachSettings,
    Registry,
    RequestTimeout,
    TaskContext,
    TaskRecord,
    TaskRef,
    Unauthorized,
)
from reach._background import Background
from reach._jsapi import JsApi, direct_batch
from reach._nats import connect_nats
from reach._subjects import Subjects
from reach._tasks.recovery import TaskRecovery
from reach.testing import NatsServer, config_with_store, eventually
from reach.wire import AgentInfo, CapabilityInfo, Deregistration, Registration
from tests.integration.test_requests import listen_silently

CONFIG = Path(__file__).parents[2] / "services" / "nats" / "nats-server.conf"
USERS = {
    "registry": "NATS_REGISTRY_PASSWORD",
    "client": "NATS_CLIENT_PASSWORD",
    "logistics-1": "NATS_LOGISTICS_1_PASSWORD",
    "aftersales-1": "NATS_AFTERSALES_1_PASSWORD",
    "admin": "NATS_ADMIN_PASSWORD",
    "system": "NATS_SYSTEM_PASSWORD",
}
PASSWORDS = {user: secrets.token_hex(8) for user in USERS}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """nats-server on the shipped config; its passwords from the environment, as deployed."""
    config = config_with_store(CONFIG, tmp_path_factory.mktemp("secured"))
    with pytest.MonkeyPatch.context() as env:
        for user, var in USERS.items():
            env.setenv(var, PASSWORDS[user])
        server = NatsServer(config_file=config, extra_args=("-m", "-1")).start()
    try:
        yield server
    finally:
        server.close()


def as_user(server: NatsServer, user: str | None, **extra: float) -> ReachSettings:
    """Settings of one user (prefix ``reach``: the config's), short intervals for tests."""
    creds = {"nats_user": user, "nats_password": PASSWORDS[user]} if user else {}
    return ReachSettings(
        nats_url=server.url, heartbeat_interval=0.2, lease_ttl=2.0, **creds, **extra
    )


def violations(server: NatsServer) -> list[str]:
    return [line for line in server.log_file.read_text().splitlines() if "Violation" in line]


class OrderRef(msgspec.Struct):
    order_id: str


def logistics(settings: ReachSettings) -> Agent:
    """The shape of reach/examples/logistics.py (its user's permissions are made for it)."""
    agent = Agent("logistics", "logistics-1", settings=settings)

    @agent.capability("logistics.track")
    async def track(ref: OrderRef, ctx: Context) -> dict[str, str]:
        await ctx.client.publish("order.status", {"order_id": ref.order_id})
        return {"order_id": ref.order_id, "by": agent.agent_id}

    @agent.task("logistics.reroute")
    async def reroute(ref: OrderRef, ctx: TaskContext) -> dict[str, str]:
        await ctx.progress(0.5, "booking")
        return {"order_id": ref.order_id, "booked_by": ctx.agent_id}

    return agent


def aftersales(settings: ReachSettings, heard: asyncio.Queue[str]) -> Agent:
    agent = Agent("aftersales", "aftersales-1", settings=settings)

    @agent.capability("aftersales.refund")
    async def refund(ref: OrderRef) -> dict[str, str]:
        return {"order_id": ref.order_id, "refund": "approved"}

    @agent.on_topic("order.*")
    async def on_status(update: dict[str, str], topic: str) -> None:
        heard.put_nowait(topic)

    return agent


@pytest.fixture
async def admin(secured: NatsServer) -> AsyncIterator[Client]:
    async with Client(settings=as_user(secured, "admin"), name="admin") as client:
        yield client


# -- who may connect -------------------------------------------------------------------------


async def test_a_connection_without_credentials_is_refused(secured: NatsServer):
    with pytest.raises(Unauthorized, match="refused the credentials") as info:
        await Client(settings=as_user(secured, None)).connect()
    assert not isinstance(info.value, ConnectionFailed)


async def test_a_wrong_password_is_refused_and_never_shown(secured: NatsServer):
    # built again, not model_copy'd: the password is a SecretStr, and a copy is not validated
    wrong = ReachSettings(**(as_user(secured, "client").model_dump() | {"nats_password": "not-it"}))
    with pytest.raises(Unauthorized, match="user 'client'"):
        await Client(settings=wrong).connect()
    host = secured.url.removeprefix("nats://")
    with pytest.raises(Unauthorized) as info:
        await Client(f"nats://client:not-it@{host}", settings=wrong).connect()
    assert "not-it" not in str(info.value)


async def test_user_and_password_in_the_url_still_work(secured: NatsServer):
    host = secured.url.removeprefix("nats://")
    url = f"nats://client:{PASSWORDS['client']}@{host}"
    async with Client(url, settings=as_user(secured, None)) as client:
        await client.flush()
        assert client.connected


# -- an agent is only itself -----------------------------------------------------------------


async def test_an_agent_user_cannot_heartbeat_as_another_agent(secured: NatsServer, admin: Client):
    """The server drops the false heartbeat (the registry never hears it) and Reach says
    so with Unauthorized; the agent's own heartbeat goes through."""
    heard = await admin.nc.subscribe("reach.hb.>")
    await admin.flush()
    async with Client(settings=as_user(secured, "logistics-1"), name="logistics-1") as own:
        await own.nc.publish("reach.hb.aftersales-1", b"{}")
        with pytest.raises(Unauthorized) as info:
            await own.flush()
        assert info.value.subject == "reach.hb.aftersales-1"
        await own.nc.publish("reach.hb.logistics-1", b"{}")
        await own.flush()
        assert own.stats.permission_violations == 1
    first = await heard.next_msg(timeout=5)  # the false one would have come first
    assert first.subject == "reach.hb.logistics-1"


async def test_an_agent_user_cannot_take_another_agents_direct_subjects(secured: NatsServer):
    impostor = Agent("aftersales", "aftersales-1", settings=as_user(secured, "logistics-1"))

    @impostor.capability("aftersales.refund")
    async def refund(ref: OrderRef) -> str:
        return "stolen"

    with pytest.raises(Unauthorized) as info:
        await impostor.start()
    assert info.value.subject.startswith("reach.agent.aftersales-1.")
    assert "subscribe" in str(info.value)
    assert impostor.status.value == "DOWN"


def forged_registration(agent_id: str) -> bytes:
    """Another agent's id with a capability it does not offer: a takeover, if stored."""
    info = AgentInfo(
        agent_id=agent_id, name="thief", capabilities=[CapabilityInfo(name="logistics.track")]
    )
    return msgspec.json.encode(Registration(info=info))


async def test_an_agent_user_cannot_register_or_deregister_another_agent(secured: NatsServer):
    """logistics-1 tries to remove aftersales-1, or to register in its name, on every
    registry subject (the id in the subject and the legacy ones without): the server
    refuses each publish (Unauthorized) and aftersales-1 stays as it registered."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    async with Registry(settings=as_user(secured, "registry")):
        victim = aftersales(as_user(secured, "aftersales-1"), heard)
        async with victim, Client(settings=as_user(secured, "client"), name="shopper") as client:
            await eventually(_fleet_of(client, 1), 10)
            gone = msgspec.json.encode(Deregistration(agent_id="aftersales-1"))
            attacks = [
                ("reach.registry.deregister", gone),
                ("reach.registry.deregister.aftersales-1", gone),
                ("reach.registry.register", forged_registration("aftersales-1")),
                ("reach.registry.register.aftersales-1", forged_registration("aftersales-1")),
            ]
            async with Client(
                settings=as_user(secured, "logistics-1"), name="logistics-1"
            ) as thief:
                for subject, body in attacks:
                    await thief.nc.publish(subject, body, reply=thief.nc.new_inbox())
                    with pytest.raises(Unauthorized) as info:
                        await thief.flush()
                    assert info.value.subject == subject
                assert thief.stats.permission_violations == len(attacks)
            [record] = await client.agents()
            assert record.info.agent_id == "aftersales-1"
            assert [c.name for c in record.info.capabilities] == ["aftersales.refund"]
            assert record.status.value == "UP"


async def test_an_agent_user_naming_another_agent_on_its_own_subject_is_refused(
    secured: NatsServer,
):
    """What the server lets through (logistics-1's own registry subjects) the registry
    checks: a body naming another agent is bad_request, and nothing changes."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    async with Registry(settings=as_user(secured, "registry")) as registry:
        victim = aftersales(as_user(secured, "aftersales-1"), heard)
        async with victim, Client(settings=as_user(secured, "client"), name="shopper") as client:
            await eventually(_fleet_of(client, 1), 10)
            async with Client(
                settings=as_user(secured, "logistics-1"), name="logistics-1"
            ) as thief:
                gone = msgspec.json.encode(Deregistration(agent_id="aftersales-1"))
                for subject, body in [
                    ("reach.registry.deregister.logistics-1", gone),
                    ("reach.registry.register.logistics-1", forged_registration("aftersales-1")),
                ]:
                    reply = await thief.nc.request(subject, body, timeout=10)
                    assert reply.headers is not None
                    assert reply.headers["Nats-Service-Error-Code"] == "400"
                    assert "aftersales-1" in reply.headers["Nats-Service-Error"]
                assert thief.stats.permission_violations == 0
            assert registry.stats.mismatched_requests == 2
            [record] = await client.agents()
            assert [c.name for c in record.info.capabilities] == ["aftersales.refund"]
            assert record.status.value == "UP"


# -- a client reads the fleet, never writes it -------------------------------------------------


async def test_a_client_cannot_write_the_agents_bucket(secured: NatsServer, admin: Client):
    async with Registry(settings=as_user(secured, "registry")):  # makes reach_agents
        async with Client(settings=as_user(secured, "client"), name="shopper") as client:
            await client.nc.publish("$KV.reach_agents.logistics-1", b'{"forged": true}')
            with pytest.raises(Unauthorized) as info:
                await client.flush()
            assert info.value.subject == "$kv.reach_agents.logistics-1"  # as the server says
        kv = await admin.nc.jetstream().key_value("reach_agents")
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("logistics-1")


async def test_a_forbidden_request_raises_unauthorized_not_a_timeout(secured: NatsServer):
    """The registry's user may not call capabilities: the refusal ends the request at once
    (a timeout would take the whole minute); a broadcast it may not send says so at the
    next flush, and at once the time after."""
    async with Client(settings=as_user(secured, "registry"), name="registry-as-caller") as c:
        with pytest.raises(Unauthorized) as info:
            await c.request(
                "logistics.track", {"order_id": "A-1"}, agent_id="logistics-1", timeout=60
            )
        assert info.value.subject == "reach.agent.logistics-1.logistics.track"
        assert info.value.capability == "logistics.track"
        await c.publish("order.status", {"order_id": "A-1"})
        with pytest.raises(Unauthorized):
            await c.flush()
        with pytest.raises(Unauthorized) as again:
            await c.publish("order.status", {"order_id": "A-1"})
        assert again.value.subject == "reach.topic.order.status"
        with pytest.raises(Unauthorized, match="subscribe"):
            await c.subscribe("order.*")
        assert c.stats.permission_violations == 3


async def test_a_refusal_ends_only_the_request_it_belongs_to(secured: NatsServer):
    """A request in flight when the server refuses another publish on the same connection
    checks, finds it was not its own, and gets its answer."""
    release = asyncio.Event()
    started = asyncio.Event()
    agent = Agent("logistics", "logistics-1", settings=as_user(secured, "logistics-1"))

    @agent.capability("logistics.track")
    async def track(ref: OrderRef) -> str:
        started.set()
        await release.wait()
        return ref.order_id

    async with agent, Client(settings=as_user(secured, "client"), name="shopper") as client:
        call = asyncio.ensure_future(
            client.request("logistics.track", {"order_id": "A-9"}, agent_id="logistics-1")
        )
        await asyncio.wait_for(started.wait(), 10)
        await client.nc.publish("reach.hb.logistics-1", b"{}")  # not the client's to send
        with pytest.raises(Unauthorized):
            await client.flush()
        release.set()
        assert await asyncio.wait_for(call, 10) == "A-9"


async def test_a_refused_jetstream_call_fails_alone_and_at_once(secured: NatsServer, admin: Client):
    """The JetStream API inbox (task records, task publishes) does the same: the refused
    call raises Unauthorized, the one beside it still gets its answer."""
    nc = await connect_nats(as_user(secured, "registry"), secured.url, "registry-api")
    asked = await admin.nc.subscribe("reach.evt.agent.probe")
    await admin.flush()
    api = JsApi(nc, timeout=60.0)
    await api.open()
    try:
        waiting = asyncio.ensure_future(api.request("reach.evt.agent.probe", b"?"))
        question = await asked.next_msg(timeout=10)
        with pytest.raises(Unauthorized) as info:
            await api.publish("reach.cap.logistics.track", b"{}", {})
        assert info.value.subject == "reach.cap.logistics.track"
        await question.respond(b"answer")
        assert (await asyncio.wait_for(waiting, 10)).data == b"answer"
    finally:
        await api.close()
        await nc.close()


async def test_a_refused_batched_direct_get_is_unauthorized_not_a_timeout(secured: NatsServer):
    """A count of a user without task rights (an upgrade that kept its own permissions)
    says what was refused, not a bare timeout."""
    nc = await connect_nats(as_user(secured, "aftersales-1"), secured.url, "aftersales-count")
    try:
        with pytest.raises(Unauthorized, match="batched direct get of REACH_TASKS"):
            await direct_batch(nc, "REACH_TASKS", "reach.task.>", timeout=1.0)
    finally:
        await nc.close()


async def test_other_refusals_never_extend_a_jetstream_call(secured: NatsServer, admin: Client):
    """Each refusal on the connection wakes waiting calls to check it; an unrelated one
    must not restart the call's timeout (with refusals every 0.2 s it would never end)."""
    nc = await connect_nats(as_user(secured, "registry"), secured.url, "registry-api")
    silent = await admin.nc.subscribe("reach.evt.agent.silent")  # takes it, never answers
    await admin.flush()
    api = JsApi(nc, timeout=1.0)
    await api.open()
    stop = asyncio.Event()

    async def refuse_often() -> None:
        while not stop.is_set():
            await nc.publish("reach.cap.logistics.track", b"{}")
            await nc.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    noise = asyncio.ensure_future(refuse_often())
    try:
        async with asyncio.timeout(20):  # only a guard against hanging
            with pytest.raises(nats.errors.TimeoutError):
                await api.request("reach.evt.agent.silent", b"?")
    finally:
        stop.set()
        await noise
        await silent.unsubscribe()
        await api.close()
        await nc.close()


async def test_a_request_woken_by_other_refusals_still_times_out(secured: NatsServer):
    """A client request woken by refusals that are not its own waits on under the same
    deadline, and times out then: not before it, not extended by each refusal, not left
    hanging. (Its instance takes the request and never answers: an agent would answer
    "timeout" itself at the deadline.)"""
    silent = await connect_nats(as_user(secured, "logistics-1"), secured.url, "silent")
    stop = asyncio.Event()
    noise: asyncio.Future[None] | None = None
    async with Client(settings=as_user(secured, "client"), name="shopper") as client:
        await listen_silently(silent, client.nc, "reach.agent.logistics-1.logistics.track")

        async def refuse_often() -> None:
            while not stop.is_set():
                await client.nc.publish("reach.hb.logistics-1", b"{}")  # not the client's
                with contextlib.suppress(Unauthorized):
                    await client.flush()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)

        loop = asyncio.get_running_loop()
        try:
            noise = asyncio.ensure_future(refuse_often())
            async with asyncio.timeout(20):  # only a guard against hanging
                sent = loop.time()
                with pytest.raises(RequestTimeout):
                    await client.request(
                        "logistics.track", {"order_id": "A-7"}, agent_id="logistics-1", timeout=1
                    )
                assert loop.time() - sent >= 1  # not cut short by a refusal
        finally:
            stop.set()
            if noise is not None:
                await noise
            await silent.close()
        assert client.stats.permission_violations >= 2


async def test_a_user_without_task_rights_cannot_submit(secured: NatsServer):
    async with Client(settings=as_user(secured, "aftersales-1"), name="aftersales-1") as c:
        with pytest.raises(Unauthorized, match="durable tasks"):
            await c.submit("logistics.reroute", {"order_id": "A-1"})


# -- and everyone can do their job ----------------------------------------------------------


async def tasks_init(server: NatsServer) -> None:
    """What a deployment does once, as admin: ``reach tasks init``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        "tasks",
        "init",
        env={
            **os.environ,
            "REACH_NATS_URL": server.url,
            "REACH_NATS_USER": "admin",
            "REACH_NATS_PASSWORD": PASSWORDS["admin"],
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    assert b"REACH_TASKS" in out


async def test_only_admin_creates_streams(secured: NatsServer, admin: Client):
    """A user able to create streams could make one, under a name Reach uses, whose
    subjects capture other users' requests and heartbeats: neither a client nor an agent
    may, even before the task streams exist."""
    js_admin = admin.nc.jetstream()
    for user, stream in (("client", "KV_reach_idem"), ("logistics-1", "REACH_DLQ")):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js_admin.delete_stream(stream)
        async with Client(settings=as_user(secured, user)) as client:
            js = client.nc.jetstream(timeout=2)
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
                await js.add_stream(name=stream, subjects=["reach.hb.>", "reach.agent.>"])
            with pytest.raises(Unauthorized):
                await client.flush()
        with pytest.raises(nats.js.errors.NotFoundError):
            await js_admin.stream_info(stream)


async def test_an_agent_cannot_make_a_consumer_of_other_tasks(secured: NatsServer):
    """Its consumer name is allowed, but only with its own filter in the API subject."""
    await tasks_init(secured)
    async with Client(settings=as_user(secured, "logistics-1")) as client:
        js = client.nc.jetstream(timeout=2)
        name = "logistics_reroute-7a8defb39b6e-high"
        config = nats.js.api.ConsumerConfig(
            name=name, durable_name=name, filter_subject="reach.task.>"
        )
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
            await js.add_consumer("REACH_TASKS", config)
        with pytest.raises(Unauthorized):
            await client.flush()


async def test_an_agent_puts_its_own_task_back_as_a_new_message(secured: NatsServer, admin: Client):
    """A task the agent cannot run (it lacks the tag) goes back as a new message on its
    last delivery, so waiting spends no deliveries: a publish on its own task subject,
    which the shipped permissions allow, with no refusal."""
    await tasks_init(secured)
    before = len(violations(secured))
    quick = {"task_max_deliver": 2, "task_max_attempts": 1, "task_retry_base": 0.05}
    track = logistics(as_user(secured, "logistics-1", **quick))
    async with Client(settings=as_user(secured, "client"), name="shopper") as client:
        ref = await client.submit("logistics.reroute", {"order_id": "G-1"}, required_tags=["gpu"])
        try:
            async with track:
                await eventually(lambda: track.task_stats.requeued >= 2, timeout=30)
            assert (await ref.status()).state.value == "PENDING"
            assert violations(secured)[before:] == []
        finally:  # no agent here has the tag: it would wait for ever
            subject = f"reach.task.{ref.task_id}.>"
            await admin.nc.jetstream().purge_stream("REACH_TASKS", subject=subject)


async def test_registry_agents_and_client_work_with_their_own_users(secured: NatsServer):
    """Requests (queue group, routed, direct), a broadcast, a durable task with its watch:
    all through the shipped permissions (task streams made at deploy time, as admin), with
    no refusal anywhere (server log included)."""
    await tasks_init(secured)
    before = len(violations(secured))
    heard: asyncio.Queue[str] = asyncio.Queue()
    async with Registry(settings=as_user(secured, "registry")):
        track = logistics(as_user(secured, "logistics-1"))
        refund = aftersales(as_user(secured, "aftersales-1"), heard)
        async with track, refund:
            async with Client(settings=as_user(secured, "client"), name="shopper") as client:
                assert (await client.request("aftersales.refund", {"order_id": "A-1"}))[
                    "refund"
                ] == "approved"
                # it follows what it called (reach_routes), and its watchdog's look at
                # those keys is allowed too
                await eventually(lambda: client.footprint()["table.records"] == 1, 10)
                assert client.footprint()["table.followed"] == 1
                js = client.nc.jetstream()
                await js.get_last_msg("KV_reach_routes", "$KV.reach_routes.aftersales.refund.*")
                await eventually(_fleet_of(client, 2), 10)
                reply = await client.call("logistics.track", {"order_id": "A-2"})
                assert reply.agent_id == "logistics-1"
                direct = await client.request(
                    "logistics.track", {"order_id": "A-3"}, agent_id="logistics-1"
                )
                assert direct["by"] == "logistics-1"
                assert await asyncio.wait_for(heard.get(), 10) == "order.status"
                ref = await client.submit("logistics.reroute", {"order_id": "A-4"})
                states = [rec.state.value async for rec in _until_final(ref)]
                assert states[-1] == "SUCCEEDED"
                assert (await ref.result(timeout=10))["booked_by"] == "logistics-1"
                await client.flush()
                assert client.stats.permission_violations == 0
            for agent in (track, refund):
                assert agent.client.stats.permission_violations == 0
    assert violations(secured)[before:] == []


def _fleet_of(client: Client, n: int):
    async def known() -> bool:
        return len(await client.agents()) == n

    return known


async def _until_final(ref: TaskRef) -> AsyncIterator[TaskRecord]:
    async for rec in ref.watch():
        yield rec
        if rec.final:
            return


async def test_a_cancel_and_the_sweep_work_with_their_own_users(secured: NatsServer, admin: Client):
    """A cancel takes the task's message out of the work queue (a client may delete task
    messages), and a sweep lists the task consumers to find messages given up without an
    advisory (the registry may): through the shipped permissions, with no refusal. (The
    sweep is run directly: a registry's would wait out the lock an earlier test's left.)"""
    await tasks_init(secured)
    before = len(violations(secured))
    settings = as_user(secured, "registry")
    nc = await connect_nats(settings, secured.url, "registry-sweep")
    owner = Background("sweep")
    try:
        async with Client(settings=as_user(secured, "client"), name="shopper") as client:
            ref = await client.submit("logistics.reroute", {"order_id": "A-5"})
            assert (await ref.cancel()).state.value == "CANCELLED"
            with pytest.raises(nats.js.errors.NotFoundError):
                await admin.nc.jetstream().get_msg(
                    "REACH_TASKS", subject=f"reach.task.{ref.task_id}.>", direct=True
                )
            await client.flush()
            assert client.stats.permission_violations == 0
        recovery = TaskRecovery(nc, settings, Subjects(settings.subject_prefix), owner)
        await recovery.sweep()
        assert (recovery.stats.sweeps, recovery.stats.errors) == (1, 0)
        await nc.flush()
    finally:
        await owner.close()
        await nc.close()
    assert violations(secured)[before:] == []


async def test_a_stream_under_allow_responses_true_is_stopped_by_its_agent(
    secured: NatsServer, caplog: pytest.LogCaptureFixture
):
    """The shipped agent users have ``allow_responses: true``: one message to a request's
    reply subject. A stream's opened frame is that one; the server refuses chunk 1. The
    agent hears the refusal, stops the handler (it would wait at its yield for credit that
    never comes) and logs a line naming allow_responses."""
    ended = asyncio.Event()
    produced: list[int] = []
    agent = Agent("logistics", "logistics-1", settings=as_user(secured, "logistics-1"))

    @agent.capability("logistics.track")
    async def track(ref: OrderRef) -> AsyncIterator[int]:
        try:
            for i in range(1_000):
                produced.append(i)
                yield i
        finally:
            ended.set()

    async with agent, Client(settings=as_user(secured, "client"), name="shopper") as client:
        stream = client.stream(
            "logistics.track", {"order_id": "A-1"}, agent_id="logistics-1", timeout=60
        )
        reading = asyncio.ensure_future(anext(stream))
        await eventually(ended.is_set, timeout=30)  # not the caller's 60 s
        assert agent.stats.streams_refused == 1
        assert agent.stats.streams_cancelled == 0
        assert len(produced) <= 16 + 1  # the first window, at most
        assert any("allow_responses" in r.getMessage() for r in caplog.records)
        assert not reading.done()  # nothing reached the caller; it waits for its timeout
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
