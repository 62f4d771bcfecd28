"""Clients follow only what they call: the registry copies each lease into ``reach_routes``
under ``<capability>.<agent id>``, and a client watches one capability's keys from its
first call on, or the whole fleet once it asks for it."""

import nats.js.errors
import pytest

from reach import Agent, CapabilityNotFound, Client, ReachSettings, Registry
from reach._client import watches
from reach.testing import eventually

from .registry_wire import fast_settings


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


def serving(settings, agent_id: str, *capabilities: str) -> Agent:
    agent = Agent("multi", agent_id, settings=settings)

    async def answer(q: dict) -> dict:
        return {"by": agent_id}

    for name in capabilities:
        agent.capability(name)(answer)
    return agent


async def route_keys(client: Client) -> set[str]:
    try:
        kv = await client.nc.jetstream().key_value(client.subjects.bucket("routes"))
        return set(await kv.keys())
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NoKeysError):
        return set()


def keys_are(client: Client, check):
    async def holds() -> bool:
        return check(await route_keys(client))

    return holds


def held(client: Client) -> tuple[int, int]:
    footprint = client.footprint()
    return footprint["table.records"], footprint["table.followed"]


async def test_each_lease_is_copied_under_every_capability_it_serves(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with serving(settings, "m-1", "x.a", "x.b"), serving(settings, "m-2", "x.b"):
            want = {"x.a.m-1", "x.b.m-1", "x.b.m-2"}
            await eventually(keys_are(client, lambda keys: keys == want))
        # deregistered: the copies go with the leases
        await eventually(keys_are(client, lambda keys: keys == set()))


async def test_a_client_holds_the_capabilities_it_called_and_the_whole_fleet_on_demand(
    settings,
):
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with (
            serving(settings, "m-1", "x.a", "x.b"),
            serving(settings, "m-2", "x.b"),
            serving(settings, "m-3", "x.c"),
        ):
            await eventually(keys_are(client, lambda keys: len(keys) == 4))
            assert (await client.request("x.a", {}))["by"] == "m-1"
            assert held(client) == (1, 1)  # m-1 only: nothing of x.b's m-2 or x.c's m-3
            assert (await client.request("x.b", {}))["by"] in {"m-1", "m-2"}
            await eventually(lambda: held(client) == (2, 2))
            assert [r.info.agent_id for r in await client.agents("x.c")] == ["m-3"]
            assert held(client) == (3, 3)
            ids = [r.info.agent_id for r in await client.agents()]  # the whole fleet, kept
            assert ids == ["m-1", "m-2", "m-3"]
            assert held(client) == (3, 0)
            assert (await client.request("x.a", {}))["by"] == "m-1"
        await eventually(lambda: held(client) == (0, 0))  # gone from the whole table too


async def test_an_agent_that_leaves_one_followed_capability_stays_for_another(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with serving(settings, "m-1", "x.a", "x.b"):
            async with serving(settings, "m-2", "x.a"):
                await client.request("x.a", {})
                await client.request("x.b", {})
                await eventually(lambda: held(client) == (2, 2))
            await eventually(lambda: held(client) == (1, 2))  # m-2 left x.a, and the table
            assert [r.info.agent_id for r in await client.agents("x.a")] == ["m-1"]
            assert [r.info.agent_id for r in await client.agents("x.b")] == ["m-1"]


async def test_past_the_limit_of_capabilities_a_client_follows_the_whole_fleet(
    settings, monkeypatch
):
    monkeypatch.setattr(watches, "MAX_FOLLOWED", 2)
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with serving(settings, "m-1", "x.a", "x.b", "x.c"), serving(settings, "m-2", "x.d"):
            await eventually(keys_are(client, lambda keys: len(keys) == 4))
            await client.request("x.a", {})
            await client.request("x.b", {})
            assert held(client) == (1, 2)
            await client.request("x.c", {})  # a third: one watch of everything instead
            assert held(client)[1] == 0
            await eventually(lambda: held(client) == (2, 0))


async def test_a_reopened_client_follows_its_capabilities_afresh(settings):
    async with Registry(settings=settings), serving(settings, "m-1", "x.a", "x.b"):
        client = Client(settings=settings)
        await client.connect()
        await client.request("x.a", {})
        await client.request("x.b", {})
        await client.close()
        assert held(client) == (0, 0)  # nothing followed once closed
        async with client:
            await client.connect()
            await client.request("x.b", {})
            async with serving(settings, "m-2", "x.b"):
                await eventually(lambda: held(client) == (2, 1))  # the new one is seen


async def test_a_capability_is_followed_only_once_its_watch_has_loaded(settings, monkeypatch):
    """While a capability's watch loads, a call that needs the table (a version) waits
    for it like the first call does, instead of finding nothing and going to the queue
    group, which would ignore the version."""
    import asyncio

    from reach import _kv
    from reach.errors import ReachError

    async with Registry(settings=settings), serving(settings, "m-1", "x.a"):
        async with serving(settings, "m-2", "x.b"), Client(settings=settings) as client:
            await client.request("x.b", {})  # the table runs
            gate, entered = asyncio.Event(), asyncio.Event()
            real = _kv.routes_bucket

            async def held_back(*args, **kw):
                entered.set()
                await gate.wait()
                return await real(*args, **kw)

            monkeypatch.setattr(_kv, "routes_bucket", held_back)
            first = asyncio.create_task(client.request("x.a", {}, timeout=30))
            await entered.wait()
            with pytest.raises(ReachError) as caught:
                await client.request("x.a", {}, version="9", timeout=1)
            assert "routing table did not load" in str(caught.value)
            gate.set()
            assert (await first)["by"] == "m-1"
            with pytest.raises(CapabilityNotFound):
                await client.request("x.a", {}, version="9", timeout=3)


async def test_without_the_routes_bucket_a_client_follows_the_whole_fleet(settings):
    """A registry from before the routes bucket (or one not allowed to make it) writes
    leases only: a client then follows them all, as clients of that time did, instead of
    finding no instance and sending everything to the queue group."""
    async with Registry(settings=settings), serving(settings, "m-1", "x.a", "x.b"):
        async with Client(settings=settings) as admin:
            await eventually(keys_are(admin, lambda keys: len(keys) == 2))
            await admin.nc.jetstream().delete_key_value(admin.subjects.bucket("routes"))
        async with Client(settings=settings) as client:
            assert (await client.request("x.a", {}, version="1.0"))["by"] == "m-1"
            assert held(client) == (1, 0)  # the whole fleet (one agent), no view


async def test_a_copy_carries_the_lease_and_its_ttl_and_a_dropped_capability_is_deleted(
    settings,
):
    """PROTOCOL 7.2: each copy is the lease's value with the lease's ``Nats-TTL`` (so it
    expires with it, registry or not), and a registration that no longer lists a
    capability deletes that capability's copy."""
    from reach.wire import AgentInfo, CapabilityInfo

    from .registry_wire import register

    def offering(*names: str) -> AgentInfo:
        caps = [CapabilityInfo(name=n, version="1.0") for n in names]
        return AgentInfo(agent_id="w-1", name="wire", capabilities=caps)

    async with Registry(settings=settings), Client(settings=settings) as client:
        nc, js = client.nc, client.nc.jetstream()
        await register(nc, settings, offering("x.a", "x.b"))
        await eventually(keys_are(client, lambda keys: keys == {"x.a.w-1", "x.b.w-1"}))
        agents, routes = client.subjects.bucket("agents"), client.subjects.bucket("routes")

        async def same_as_lease() -> bool:
            lease = await js.get_last_msg(f"KV_{agents}", f"$KV.{agents}.w-1")
            copy = await js.get_last_msg(f"KV_{routes}", f"$KV.{routes}.x.b.w-1")
            ttls = (copy.headers["Nats-TTL"], lease.headers["Nats-TTL"])
            return copy.data == lease.data and ttls == ("1000ms", "1000ms")

        await eventually(same_as_lease)
        await register(nc, settings, offering("x.b"))  # x.a no longer listed
        await eventually(keys_are(client, lambda keys: keys == {"x.b.w-1"}))
        gone = await js.get_last_msg(f"KV_{routes}", f"$KV.{routes}.x.a.w-1")
        assert gone.headers["KV-Operation"] == "DEL"
        await eventually(same_as_lease)


async def test_a_registry_refused_the_routes_bucket_serves_leases_and_says_so(tmp_path, caplog):
    """A deployment whose registry user may not use the routes bucket (permissions from
    before it): the registry still starts and serves the leases, warns once naming the
    bucket and the subjects to allow, and a client follows the whole fleet."""
    from pathlib import Path

    from reach.testing import NatsServer, unique_prefix

    prefix = unique_prefix()
    routes = f"{prefix}_routes"
    denied = [f"$JS.API.STREAM.CREATE.KV_{routes}", f"$JS.API.STREAM.INFO.KV_{routes}"]
    config = tmp_path / "server.conf"
    config.write_text(
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "authorization { users: [\n"
        f"  {{ user: reg, password: p, permissions: {{ publish: {{ deny: {denied!r} }} }} }}\n"
        "  { user: all, password: p }\n"
        "] }\n".replace("'", '"')
    )
    async with NatsServer(config_file=Path(config)) as server:
        base = fast_settings(server.url).model_dump()
        base["subject_prefix"] = prefix
        mine = ReachSettings(**{**base, "nats_user": "reg", "nats_password": "p"})
        others = ReachSettings(**{**base, "nats_user": "all", "nats_password": "p"})
        async with Registry(settings=mine, tasks=False) as registry:
            async with serving(others, "m-1", "x.a"), Client(settings=others) as client:
                assert (await client.request("x.a", {}))["by"] == "m-1"
                assert held(client) == (1, 0)  # the whole fleet
                assert registry.stats.write_errors == 0
        warned = [r.getMessage() for r in caplog.records if "refused bucket" in r.message]
        assert len(warned) == 1
        assert f"$KV.{routes}.>" in warned[0]


async def test_a_gather_follows_its_capability_after_a_call_to_another(settings):
    async with Registry(settings=settings), serving(settings, "m-1", "x.a"):
        async with serving(settings, "m-2", "x.b"), serving(settings, "m-3", "x.b"):
            async with Client(settings=settings) as client:
                await eventually(keys_are(client, lambda keys: len(keys) == 3))
                assert (await client.request("x.a", {}))["by"] == "m-1"
                gathered = await client.gather("x.b", {}, timeout=10)
                assert sorted(gathered.replies) == ["m-2", "m-3"]
                assert held(client) == (3, 2)


async def test_a_client_refused_the_routes_follows_the_whole_fleet_and_says_so(tmp_path, caplog):
    """A client whose user may not read the routes bucket (permissions from before it)
    routes on the leases, and says once what to allow."""
    from pathlib import Path

    from reach.testing import NatsServer, unique_prefix

    prefix = unique_prefix()
    routes = f"{prefix}_routes"
    denied = f"$JS.API.STREAM.INFO.KV_{routes}"
    config = tmp_path / "server.conf"
    config.write_text(
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "authorization { users: [\n"
        f'  {{ user: cli, password: p, permissions: {{ publish: {{ deny: ["{denied}"] }} }} }}\n'
        "  { user: all, password: p }\n"
        "] }\n"
    )
    async with NatsServer(config_file=Path(config)) as server:
        base = fast_settings(server.url).model_dump()
        base["subject_prefix"] = prefix
        mine = ReachSettings(**{**base, "nats_user": "cli", "nats_password": "p"})
        others = ReachSettings(**{**base, "nats_user": "all", "nats_password": "p"})
        async with Registry(settings=others), serving(others, "m-1", "x.a"):
            async with Client(settings=mine) as client:
                assert (await client.request("x.a", {}, timeout=30))["by"] == "m-1"
                await eventually(lambda: held(client) == (1, 0))  # the whole fleet
    warned = [r.getMessage() for r in caplog.records if "refused this user bucket" in r.message]
    assert len(warned) == 1


async def test_a_routes_bucket_not_made_at_the_start_is_made_later(settings, monkeypatch):
    """JetStream did not answer for the routes bucket at the registry's start (a stream
    leader not yet elected, say): the registry serves the leases and tries again, with
    backoff, until the bucket is made; then the copies follow the next writes."""
    from reach import _kv
    from reach._registry import service

    real, failed = _kv.routes_bucket, []

    async def not_yet(js, bucket, *, create, replicas=1):
        if create and len(failed) < 2:
            failed.append(bucket)
            raise TimeoutError("no answer")
        return await real(js, bucket, create=create, replicas=replicas)

    monkeypatch.setattr(_kv, "routes_bucket", not_yet)
    monkeypatch.setattr(service, "_ROUTES_WAIT", 0.05)
    async with Registry(settings=settings), serving(settings, "m-1", "x.a"):
        async with Client(settings=settings) as client:
            await eventually(keys_are(client, lambda keys: keys == {"x.a.m-1"}))
            assert len(failed) == 2
