"""The registry cannot be knocked over: start and stop, bounded state, checked input, clocks."""

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace

import msgspec
import nats
import nats.errors
import pytest

import reach
from reach import Client, Registry, Status, _kv
from reach._background import Background
from reach._registry import api
from reach._registry.counters import RegistryStats
from reach._registry.heartbeats import Heartbeats
from reach._registry.state import Core, Entries, Throttle
from reach._registry.writer import RecordWriter
from reach._subjects import Subjects
from reach.testing import NatsServer, eventually
from reach.wire import AgentRecord, CapabilityInfo, Control, ListQuery, ListReply, Registration

from .registry_wire import (
    ERROR,
    Relay,
    WireAgent,
    beat,
    deregister,
    fast_settings,
    heartbeat,
    info,
    register,
    stored,
)
from .test_registry import make_agent


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


@pytest.fixture(scope="module")
def server_without_jetstream() -> Iterator[NatsServer]:
    with NatsServer(jetstream=False) as server:
        yield server


async def nothing_left_behind(before: set[asyncio.Task]) -> None:
    """No task the registry (or its NATS connection) started is still alive."""
    await eventually(lambda: not (asyncio.all_tasks() - before), timeout=5)


# -- start and stop ----------------------------------------------------------------------


async def test_start_without_jetstream_raises_reach_error_and_leaves_nothing(
    server_without_jetstream,
):
    settings = fast_settings(server_without_jetstream.url)
    registry = Registry(settings=settings)
    before = asyncio.all_tasks()
    async with asyncio.timeout(30):  # a guard against hanging, not a measurement
        with pytest.raises(reach.ReachError, match="JetStream"):
            await registry.start()
    await nothing_left_behind(before)
    assert registry.footprint()["background"] == 0


async def test_start_when_the_bucket_cannot_be_created_raises_and_leaves_nothing(settings):
    # Someone else's stream already captures the bucket's subjects: creating it must fail.
    bucket = settings.subject_prefix.replace(".", "_") + "_agents"
    nc = await nats.connect(settings.nats_url)
    await nc.jetstream().add_stream(name=f"squat_{bucket}", subjects=[f"$KV.{bucket}.>"])
    await nc.close()
    registry = Registry(settings=settings)
    before = asyncio.all_tasks()
    async with asyncio.timeout(30):
        with pytest.raises(reach.ReachError, match=bucket):
            await registry.start()
    await nothing_left_behind(before)
    assert registry.footprint()["background"] == 0


async def test_requests_in_flight_during_stop_are_answered(settings):
    """Stop drains: every request the server handed to the registry before stop() began is
    answered (none refused, none lost); later ones find no one."""
    registry = Registry(settings=settings)
    await registry.start()
    nc = await nats.connect(settings.nats_url)
    try:
        answers: dict[str, bool] = {}  # reply subject -> refused?
        inbox = nc.new_inbox()

        async def on_reply(msg) -> None:
            answers[msg.subject] = bool(msg.headers and ERROR in msg.headers)

        await nc.subscribe(f"{inbox}.*", cb=on_reply)
        subject = f"{settings.subject_prefix}.registry.register"
        n = 300
        for i in range(n):
            body = msgspec.json.encode(Registration(info=info(f"flight-{i}")))
            await nc.publish(f"{subject}.flight-{i}", body, reply=f"{inbox}.{i}")
        await nc.flush()  # the server has them all: each is the registry's now
        await registry.stop()
        await eventually(lambda: len(answers) == n)
        assert not any(answers.values())
        with pytest.raises(nats.errors.NoRespondersError):
            await register(nc, settings, info("flight-late"))
    finally:
        await nc.close()
    assert registry.footprint()["background"] == 0


async def test_start_that_cannot_finish_raises_connection_failed_and_leaves_nothing(settings):
    """Every step of start() is bounded by start_timeout and says ConnectionFailed: here the
    server never sees the subscriptions (nor the flush after them)."""
    trigger = f"SUB {settings.subject_prefix}.hb.*".encode()
    async with Relay(settings.nats_url, trigger, hold=False) as relay:
        registry = Registry(relay.url, settings=settings, start_timeout=1.0)
        before = asyncio.all_tasks()
        async with asyncio.timeout(30):  # a guard against hanging, not a measurement
            with pytest.raises(reach.ConnectionFailed, match="subscribe"):
                await registry.start()
        assert relay.triggered.is_set()
        await nothing_left_behind(before)
        assert registry.footprint()["background"] == registry.footprint()["subscriptions"] == 0


async def test_stop_during_start_leaves_nothing_serving(settings):
    trigger = f"SUB {settings.subject_prefix}.hb.*".encode()
    async with Relay(settings.nats_url, trigger) as relay:
        registry = Registry(relay.url, settings=settings)
        starting = asyncio.create_task(registry.start())
        await relay.triggered.wait()  # start() is halfway: its subscriptions are held
        stopping = asyncio.create_task(registry.stop())
        relay.release()
        await starting
        await stopping
        assert registry.footprint()["subscriptions"] == 0
        assert registry.footprint()["background"] == 0
        await eventually(lambda: relay.open == 0)
        nc = await nats.connect(settings.nats_url)
        try:
            with pytest.raises(nats.errors.NoRespondersError):
                await register(nc, settings, info("geo-late"))
        finally:
            await nc.close()


async def test_concurrent_starts_open_one_connection(settings):
    async with Relay(settings.nats_url) as relay:
        registry = Registry(relay.url, settings=settings)
        await asyncio.gather(registry.start(), registry.start())
        assert relay.connections == 1
        await registry.stop()
        await eventually(lambda: relay.open == 0)


async def test_a_stopped_registry_starts_again(settings):
    registry = Registry(settings=settings)
    await registry.start()
    await registry.stop()
    async with (
        registry,
        Client(settings=settings) as client,
        WireAgent(client.nc, settings, "geo-again"),
    ):
        await eventually(lambda: "geo-again" in registry.records())


# -- bounded state -----------------------------------------------------------------------


async def test_ten_thousand_agent_ids_leave_the_registry_and_the_client_small(nats_server):
    # Long leases: this test is about churn through the API, not about expiry.
    settings = fast_settings(nats_server.url, lease_ttl=60.0)
    n, batch = 10_000, 500
    async with (
        Registry(settings=settings) as registry,
        Client(settings=settings) as client,
        make_agent(settings, "geo-steady"),  # a fleet is never silent: the bucket keeps moving
    ):
        nc = client.nc
        await client.agents()  # the client follows the table from here on
        for start in range(0, n, batch):
            replies = await asyncio.gather(
                *(
                    register(nc, settings, info(f"churn-{i}", capability="ghost.do"))
                    for i in range(start, start + batch)
                )
            )
            assert all(not r.headers or ERROR not in r.headers for r in replies)
        await eventually(lambda: registry.footprint()["records"] == n + 1, timeout=30)
        await eventually(lambda: client.footprint()["table.records"] == n + 1, timeout=30)
        # The client routes to them: nobody answers, so every attempt leaves router state
        # (in-flight counts, absences) for an instance that is about to go.
        for _ in range(20):
            with pytest.raises(reach.ReachError):
                await client.request("ghost.do", {}, timeout=2)
        grown = client.footprint()
        assert grown["router.absent"] > 0
        for start in range(0, n, batch):
            await asyncio.gather(
                *(deregister(nc, settings, f"churn-{i}") for i in range(start, start + batch))
            )
        # Heartbeats from ids nobody registered: each gets a "register" request, no state.
        for i in range(n):
            await heartbeat(nc, settings, f"ghost-{i}", beat(f"ghost-{i}", 1))
        await client.flush()
        await eventually(lambda: registry.stats.reregister_requests >= n, timeout=30)

        def small() -> bool:
            return all(size <= 16 for size in registry.footprint().values())

        await eventually(small, timeout=30)
        await eventually(lambda: client.footprint()["table.records"] == 1, timeout=30)
        assert await client.request("geo.lookup", {}) == {"by": "geo-steady"}
        sizes = client.footprint()
        assert registry.stats.registrations >= n + 1
        assert registry.stats.deregistrations == n
        assert list(registry.records()) == ["geo-steady"]
    # Only geo-steady may have left a trace in the client, in any map.
    per_instance = {k: v for k, v in sizes.items() if k.startswith(("table.", "router."))}
    assert all(size <= 2 for size in per_instance.values()), per_instance


async def test_a_list_too_big_for_one_message_is_refused_or_paged(settings):
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        nc = client.nc
        metadata = {f"key{i}": "x" * 150 for i in range(64)}  # about 10 kB per record
        n = nc.max_payload // 10_000 + 20
        ids = [f"geo-big-{i:04d}" for i in range(n)]
        for agent_id in ids:
            big = msgspec.structs.replace(info(agent_id), metadata=metadata)
            reply = await register(nc, settings, big)
            assert not reply.headers or ERROR not in reply.headers, reply.headers
        await eventually(lambda: len(registry.records()) == n)
        subject = client.subjects.registry("list")
        msg = await nc.request(subject, b"{}", timeout=10)
        assert msg.headers[ERROR] == "400"
        assert "limit" in msg.headers["Nats-Service-Error"]
        pages: list[list[str]] = []
        after = None
        while True:
            query = msgspec.json.encode(ListQuery(limit=1000, after=after))
            page = msgspec.json.decode(
                (await nc.request(subject, query, timeout=10)).data, type=ListReply
            )
            pages.append([r.info.agent_id for r in page.agents])
            after = page.next_after
            if after is None:
                break
        assert len(pages) >= 2
        assert [agent_id for page in pages for agent_id in page] == ids
        small = msgspec.json.encode(ListQuery(limit=3))
        page = msgspec.json.decode(
            (await nc.request(subject, small, timeout=10)).data, type=ListReply
        )
        assert [r.info.agent_id for r in page.agents] == ids[:3]
        assert page.next_after == ids[2]


async def test_a_bug_behind_a_request_is_failed_not_bad_request(settings, monkeypatch):
    """Only the decoding and checking of a request make bad_request; a ValueError from our
    own code is a failure of ours (500), not the caller's fault."""

    def broken_rank(*args: object) -> list[object]:
        raise ValueError("a bug in ranking")

    monkeypatch.setattr(api, "rank", broken_rank)
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        body = b'{"type": "reach.registry.route", "capability": "geo.lookup"}'
        msg = await client.nc.request(client.subjects.registry("route"), body, timeout=10)
        assert msg.headers[ERROR] == "500"
        assert registry.stats.bad_requests == 0


# -- checked input -----------------------------------------------------------------------


async def test_heartbeat_numbers_out_of_range_are_clamped_and_counted(settings):
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        nc = client.nc
        async with WireAgent(nc, settings, "geo-liar"):
            lies = beat(
                "geo-liar", 5, load=-1e9, inflight=-5, queue_len=-3, latency_ms=-7.0, served=-1
            )
            await heartbeat(nc, settings, "geo-liar", lies)

            async def renewed() -> bool:
                record = await stored(nc, settings, "geo-liar")
                return record is not None and record.heartbeat is not None

            await eventually(renewed)
            hb = (await stored(nc, settings, "geo-liar")).heartbeat
            assert (hb.seq, hb.load, hb.inflight, hb.queue_len, hb.latency_ms, hb.served) == (
                5,
                0.0,
                0,
                0,
                0.0,
                0,
            )
            assert registry.stats.clamped == 1
            # Too big to be a number (JSON has no NaN or inf): dropped, counted, not stored.
            body = beat("geo-liar", 6).replace(b'"latency_ms":0.0', b'"latency_ms":1e999')
            await heartbeat(nc, settings, "geo-liar", body)
            huge = beat("geo-liar", 7, load=1e300, latency_ms=1e300, queue_len=10**30)
            await heartbeat(nc, settings, "geo-liar", huge)

            async def seven() -> bool:
                record = await stored(nc, settings, "geo-liar")
                return record is not None and record.heartbeat.seq == 7

            await eventually(seven)
            hb = (await stored(nc, settings, "geo-liar")).heartbeat
            assert hb.load == 1.0
            assert 0 < hb.latency_ms < 1e300
            assert 0 < hb.queue_len < 10**30
            assert registry.stats.clamped == 2
            assert registry.stats.dropped_malformed == 1


@pytest.mark.parametrize(
    ("what", "body"),
    [
        ("capability", info("geo-badcap", capability="Geo Lookup!")),
        ("capability", info("geo-wild", capability="geo.*")),
        ("agent_id", info("geo bad id")),
        ("tag", info("geo-badtag", tags=("",))),
        ("tag", info("geo-commatag", tags=("a,b",))),
        ("max_concurrency", msgspec.structs.replace(info("geo-zero"), max_concurrency=0)),
        (
            "version",
            msgspec.structs.replace(
                info("geo-badver"), capabilities=[CapabilityInfo(name="geo.lookup", version="")]
            ),
        ),
    ],
)
async def test_invalid_registration_is_refused_and_counted(settings, what, body):
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        # the subject's token must be one (an invalid id in the body is what is refused)
        token = body.agent_id.replace(" ", "-")
        reply = await register(client.nc, settings, body, subject_id=token)
        assert reply.headers[ERROR] == "400"
        assert what in reply.headers["Nats-Service-Error"]
        assert registry.stats.bad_requests == 1
        assert registry.records() == {}
        assert await stored(client.nc, settings, body.agent_id) is None


async def test_a_body_naming_another_agent_than_its_subject_is_refused(nats_server, caplog):
    """register.<id> and deregister.<id> act only on <id>: a body naming another agent is
    bad_request (counted, logged once per sender), and neither agent's key changes."""
    settings = fast_settings(nats_server.url, lease_ttl=60.0)  # no expiry meanwhile
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        nc = client.nc
        reply = await register(nc, settings, info("geo-victim"))
        assert not reply.headers or ERROR not in reply.headers, reply.headers
        before = await stored(nc, settings, "geo-victim")
        assert before is not None
        forged = info("geo-victim", capability="geo.steal")
        for _ in range(2):
            reply = await register(nc, settings, forged, subject_id="geo-thief")
            assert reply.headers[ERROR] == "400"
            assert "geo-thief" in reply.headers["Nats-Service-Error"]
            reply = await deregister(nc, settings, "geo-victim", subject_id="geo-thief")
            assert reply.headers[ERROR] == "400"
        stats = registry.stats
        assert (stats.bad_requests, stats.mismatched_requests) == (4, 4)
        assert (stats.registrations, stats.deregistrations) == (1, 0)
        assert await stored(nc, settings, "geo-victim") == before
        assert await stored(nc, settings, "geo-thief") is None
        assert set(registry.records()) == {"geo-victim"}
        warned = [r for r in caplog.records if "geo-thief" in r.getMessage()]
        assert len(warned) == 1, warned


async def test_the_old_subjects_without_an_id_still_work_and_are_counted(nats_server):
    """Agents from before the id was in the subject keep registering during an upgrade
    (registries first); each such request is counted so operators see when none remain."""
    settings = fast_settings(nats_server.url, lease_ttl=60.0)
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        nc = client.nc
        reply = await register(nc, settings, info("geo-old"), legacy=True)
        assert not reply.headers or ERROR not in reply.headers, reply.headers
        assert await stored(nc, settings, "geo-old") is not None
        reply = await deregister(nc, settings, "geo-old", legacy=True)
        assert not reply.headers or ERROR not in reply.headers, reply.headers
        assert await stored(nc, settings, "geo-old") is None
        assert registry.stats.legacy_requests == 2
        assert (registry.stats.registrations, registry.stats.deregistrations) == (1, 1)


async def test_corrupt_record_is_replaced_by_the_next_registration(settings):
    async with Registry(settings=settings) as registry, Client(settings=settings) as client:
        kv = await client.nc.jetstream().key_value(client.subjects.bucket("agents"))
        await kv.put("geo-corrupt", b"\x00 not a record")
        await eventually(lambda: registry.stats.corrupt_records >= 1)
        reply = await register(client.nc, settings, info("geo-corrupt"))
        assert not reply.headers or ERROR not in reply.headers, reply.headers
        record = await stored(client.nc, settings, "geo-corrupt")
        assert record is not None
        assert record.status == Status.UP


async def test_corrupt_record_of_a_running_agent_is_healed_by_its_heartbeats(settings):
    async with (
        Registry(settings=settings),
        Client(settings=settings) as client,
        make_agent(settings, "geo-heal"),
    ):
        nc = client.nc

        async def up() -> bool:
            record = await stored(nc, settings, "geo-heal")
            return record is not None and record.status == Status.UP

        await eventually(up)
        kv = await nc.jetstream().key_value(client.subjects.bucket("agents"))
        await kv.put("geo-heal", b"{garbage")
        await eventually(up)
        entry = await kv.get("geo-heal")
        assert msgspec.json.decode(entry.value, type=AgentRecord).info.agent_id == "geo-heal"


# -- clocks ------------------------------------------------------------------------------


async def test_wall_clock_step_back_does_not_silence_reregister_requests(settings, monkeypatch):
    """Throttling "register again" requests is a local interval: the monotonic clock."""
    async with (
        Registry(settings=settings) as registry,
        Client(settings=settings) as client,
        make_agent(settings, "geo-steady"),  # keeps the bucket moving, as a fleet does
    ):
        nc = client.nc
        asked: list[str] = []

        async def on_ctl(msg):
            asked.append(msgspec.json.decode(msg.data, type=Control).command)

        await nc.subscribe(client.subjects.ctl("ghost"), cb=on_ctl)
        await client.flush()
        await heartbeat(nc, settings, "ghost", beat("ghost", 1))
        await eventually(lambda: asked == ["register"])
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() - 3600)  # NTP steps back an hour

        async def asked_again() -> bool:
            await heartbeat(nc, settings, "ghost", beat("ghost", 2))
            await client.flush()
            return len(asked) >= 2

        await eventually(asked_again, timeout=10)
        assert registry.stats.reregister_requests >= 2


async def test_removed_keys_leave_no_permanent_marker_in_the_bucket(settings):
    """Every write carries a TTL, deletes included: churn cannot grow the bucket forever
    (a plain delete marker stays in the stream until the bucket is dropped)."""
    async with Registry(settings=settings), Client(settings=settings) as client:
        nc = client.nc
        async with WireAgent(nc, settings, "geo-brief"):
            pass
        await deregister(nc, settings, "geo-brief")
        stream = f"KV_{client.subjects.bucket('agents')}"
        subject = f"$KV.{client.subjects.bucket('agents')}.geo-brief"
        newest = await nc.jetstream().get_msg(stream, subject=subject)
        assert newest.headers["KV-Operation"] == "DEL"
        assert newest.headers["Nats-TTL"].endswith("ms")


async def test_a_heartbeat_racing_a_deregistration_does_not_ask_the_agent_back(settings):
    """A heartbeat whose write loses to a deregistration (or that arrives just after one)
    is late: the draining agent must not be asked to register again (a ghost record)."""
    nc = await nats.connect(settings.nats_url)
    try:
        subjects = Subjects(settings.subject_prefix)
        bucket = subjects.bucket("agents")
        js = nc.jetstream()
        await _kv.agents_bucket(js, bucket, create=True)
        stats = RegistryStats()
        core = Core(
            settings=settings,
            subjects=subjects,
            registry_id="registry-test",
            bucket=bucket,
            routes=subjects.bucket("routes"),
            stats=stats,
            entries=Entries(stats),  # no watch: this replica sees only its own writes
            throttle=Throttle(),
            owner=Background("registry-test"),
            nc=nc,
            js=js,
        )
        leases = RecordWriter(core)
        heartbeats = Heartbeats(core, leases, max_inflight=4)
        record = AgentRecord(info=info("geo-leaving"), status=Status.PAUSED)
        await leases.write("geo-leaving", record, ttl=60.0, last=0)
        # Another replica deregisters it; this one has not seen that yet.
        await _kv.delete(js, bucket, "geo-leaving", last=None, ttl=_kv.MARKER_TTL)

        async def beat_once(seq: int) -> None:
            data = beat("geo-leaving", seq)
            await heartbeats.on_message(
                SimpleNamespace(subject=subjects.heartbeat("geo-leaving"), data=data)
            )
            await heartbeats.wait_idle()

        await beat_once(1)  # its write loses the compare-and-set to the delete
        assert stats.reregister_requests == 0
        await leases.remove("geo-leaving", last=None)  # now this replica deleted it itself
        await beat_once(2)
        assert stats.reregister_requests == 0
        # An agent that keeps heartbeating long after is not late: it is asked.
        core.entries.prune(older_than=time.monotonic() + 1)
        await beat_once(3)
        assert stats.reregister_requests == 1
        await core.owner.close()
    finally:
        await nc.close()
