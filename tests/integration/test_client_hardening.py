"""The client's own hardening: true attempt outcomes, owned hedges and background work, one
routing-table watch at a time, and maps that stay bounded while agents come and go."""

import asyncio

import msgspec
import pytest

from reach import Client, Registry, Status
from reach._kv import agents_bucket
from reach.errors import NotStarted, ReachError
from reach.testing import eventually
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo
from tests.integration.test_registry import fast_settings, wait_status
from tests.integration.test_requests import listen_silently
from tests.integration.test_resilience import gated


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


def record(agent_id: str, capability: str = "ghost.do") -> bytes:
    info = AgentInfo(
        agent_id=agent_id, name="ghost", capabilities=[CapabilityInfo(name=capability)]
    )
    return msgspec.json.encode(AgentRecord(info=info, status=Status.UP))


async def watchers(client: Client) -> int:
    """Server-side consumers with a live subscriber on the client's agents bucket."""
    js = client.nc.jetstream()
    infos = await js.consumers_info(f"KV_{client.subjects.bucket('agents')}")
    return sum(1 for c in infos if c.push_bound)


async def test_caller_timeout_is_recorded_as_cancelled_not_as_a_success(settings):
    gate = asyncio.Event()
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with gated(settings, "w-stuck", gate):
            await wait_status(client, "w-stuck", Status.UP)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    client.call("work.do", {}, routing="affinity", affinity_key="k", timeout=30),
                    0.3,
                )
            sizes = client.footprint()
            gate.set()
    assert sizes["router.ewma"] == 0  # its cut-short latency taught nothing
    assert sizes["router.affinity"] == 0  # and the session did not move to it
    assert sizes["router.inflight"] == 0
    assert sizes["pending"] == 0
    assert client.stats.attempts_cancelled == 1


async def test_concurrent_rebuilds_leave_one_watch_and_close_removes_it(settings):
    # the client alone: no bucket yet, so its routing table starts stale
    client_settings = settings.model_copy(update={"heartbeat_interval": 1e-4})
    async with Client(settings=client_settings) as client:
        assert await client.agents() == []
        await agents_bucket(client.nc.jetstream(), client.subjects.bucket("agents"), create=True)
        # a reconnect and requests arriving together all want a fresh watch
        await asyncio.gather(client.on_reconnect(), client.agents(), client.agents())

        async def watching(n: int) -> bool:
            return await watchers(client) == n

        await eventually(lambda: watching(1))
        await asyncio.gather(client.on_reconnect(), client.on_reconnect(), client.agents())
        await eventually(lambda: watching(1))
        async with Client(settings=client_settings) as observer:
            await client.close()

            async def gone() -> bool:
                return await watchers(observer) == 0

            await eventually(gone)
        assert client.footprint()["background"] == 0


async def test_slow_changes_listener_drops_the_oldest_and_counts(settings):
    async with Client(settings=settings) as client:
        js = client.nc.jetstream()
        kv = await agents_bucket(js, client.subjects.bucket("agents"), create=True)
        changes = client.changes()
        first = asyncio.ensure_future(anext(changes))
        await eventually(lambda: client.footprint()["table.listeners"] == 1)
        await kv.put("g-0", record("g-0"))
        assert (await first).info.agent_id == "g-0"
        n = 1500
        for i in range(1, n + 1):
            await kv.put(f"g-{i}", record(f"g-{i}"))
        await eventually(lambda: client.footprint()["table.records"] == n + 1)
        sizes = client.footprint()
        dropped = client.stats.changes_dropped
        oldest_kept = await anext(changes)
        await changes.aclose()
        assert client.footprint()["table.listeners"] == 0
    assert sizes["table.queued"] == 1024
    assert dropped == n - 1024
    assert oldest_kept.info.agent_id == f"g-{n - 1024 + 1}"


async def test_router_state_goes_when_its_instance_leaves(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        gate = asyncio.Event()
        gate.set()
        agent = gated(settings, "w-leaves", gate)
        async with agent:
            await wait_status(client, "w-leaves", Status.UP)
            for _ in range(5):
                await client.call("work.do", {}, routing="affinity", affinity_key="s")
            assert client.footprint()["router.ewma"] == 1
            assert client.footprint()["router.affinity"] == 1
        await wait_status(client, "w-leaves", None)
        sizes = client.footprint()
    assert sizes["router.ewma"] == 0
    assert sizes["router.affinity"] == 0
    assert sizes["router.inflight"] == 0
    assert sizes["table.records"] == 0


async def test_ten_thousand_agent_ids_leave_no_trace_in_the_client(settings):
    n = 10_000
    async with Client(settings=settings) as client:
        js = client.nc.jetstream()
        kv = await agents_bucket(js, client.subjects.bucket("agents"), create=True)
        assert await client.agents() == []
        for start in range(0, n, 500):
            await asyncio.gather(
                *(kv.put(f"g-{i}", record(f"g-{i}")) for i in range(start, start + 500))
            )
        await eventually(lambda: client.footprint()["table.records"] == n, timeout=30)
        # nobody serves them: each attempt meets no responders (the instance is absent)
        for _ in range(20):
            with pytest.raises(Exception, match="ghost"):
                await client.request("ghost.do", {}, timeout=2, max_attempts=3)
        grown = client.footprint()
        for start in range(0, n, 500):
            await asyncio.gather(*(kv.delete(f"g-{i}") for i in range(start, start + 500)))
        await eventually(lambda: client.footprint()["table.records"] == 0, timeout=30)
        sizes = client.footprint()
    assert grown["router.absent"] > 0
    per_instance = [k for k in sizes if k.startswith(("table.", "router."))]
    assert {k: sizes[k] for k in per_instance} == dict.fromkeys(per_instance, 0)


async def test_a_crash_in_the_table_watch_is_counted_and_repaired(settings, monkeypatch):
    from reach._client.table import RoutingTable

    update = RoutingTable.update
    crashes: list[str] = []

    def broken_once(self, key, entry):
        if not crashes:
            crashes.append(key)
            raise RuntimeError("a bug in the table")
        update(self, key, entry)

    monkeypatch.setattr(RoutingTable, "update", broken_once)
    async with Client(settings=settings) as client:
        kv = await agents_bucket(
            client.nc.jetstream(), client.subjects.bucket("agents"), create=True
        )
        assert await client.agents() == []
        await kv.put("g-1", record("g-1"))  # crashes the watch consumer
        await eventually(lambda: crashes == ["g-1"])
        await kv.put("g-2", record("g-2"))

        async def repaired() -> bool:
            return [r.info.agent_id for r in await client.agents()] == ["g-1", "g-2"]

        await eventually(repaired)  # the watchdog rebuilt the watch from a fresh snapshot
        assert client.stats.watch_errors == 1
        assert client.stats.table_rebuilds >= 2


async def test_a_record_stored_under_another_agents_key_is_ignored(settings):
    gate = asyncio.Event()
    gate.set()
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with gated(settings, "w-good", gate):
            await wait_status(client, "w-good", Status.UP)
            kv = await agents_bucket(
                client.nc.jetstream(), client.subjects.bucket("agents"), create=False
            )
            await kv.put("w-liar", record("w-other", "work.do"))  # key and agent_id differ
            await kv.put("w-mark", record("w-mark", "mark.do"))  # the watch is ordered

            async def marked() -> bool:
                return "w-mark" in {r.info.agent_id for r in await client.agents()}

            await eventually(marked)
            for routing in ("balanced", "scored", "balanced", "scored"):
                reply = await client.call("work.do", {}, routing=routing, timeout=5)
                assert reply.value == {"by": "w-good"}
            ids = {r.info.agent_id for r in await client.agents()}
            ignored = client.stats.records_ignored
    assert "w-other" not in ids
    assert ignored == 1


async def test_a_close_while_routing_starts_leaves_the_next_connection_a_live_table(
    settings, monkeypatch
):
    from reach._client.watches import Watches

    ensure = Watches.ensure
    closes: list[bool] = []
    client = Client(settings=settings)

    async def ensure_then_close(self, nc):
        await ensure(self, nc)
        if not closes:  # the first start succeeds, then the client closes before it returns
            closes.append(True)
            await client.close()

    monkeypatch.setattr(Watches, "ensure", ensure_then_close)
    async with Registry(settings=settings):
        await client.connect()
        with pytest.raises(NotStarted):
            await client.agents()
        assert closes == [True]
        async with client:
            kv = await agents_bucket(
                client.nc.jetstream(), client.subjects.bucket("agents"), create=True
            )
            await kv.put("g-1", record("g-1"))
            with pytest.raises(ReachError, match="ghost"):
                await client.request("ghost.do", {}, timeout=2, max_attempts=1)
            assert [r.info.agent_id for r in await client.agents()] == ["g-1"]  # the fleet
            await kv.put("g-2", record("g-2"))
            await eventually(lambda: client.footprint()["table.records"] == 2)


async def test_deadlines_of_ended_requests_are_dropped(settings):
    """Requests' deadlines wait in one heap for the one timer: an ended request's stays
    until it comes due or the heap is compacted, so thousands of requests keep it small,
    and once nothing is pending the timer drops them all."""
    from reach import Agent

    agent = Agent("quick", "quick-1", settings=settings)

    @agent.capability("quick.op")
    async def op(req: dict) -> dict:
        return req

    async with agent, Client(settings=settings) as client:
        sizes = []
        for n in range(2000):
            await client.request("quick.op", {"n": n}, agent_id="quick-1", timeout=2)
            sizes.append(client.footprint()["deadlines"])
        assert max(sizes) <= 2 * 1 + 64 + 1  # (pending at most one, plus the one sent)
        await eventually(lambda: client.footprint()["deadlines"] == 0)
        assert client.footprint()["pending"] == 0


async def test_deadlines_of_pending_requests_survive_compaction(settings):
    """Fifty requests wait for answers that never come while hundreds of quick ones end,
    so the heap of deadlines is compacted under them: each still times out, never before
    its deadline. (The listener never answers; an agent would answer "timeout" itself.)"""
    import nats

    from reach import Agent, RequestTimeout

    agent = Agent("quick", "quick-1", settings=settings)

    @agent.capability("quick.op")
    async def op(req: dict) -> dict:
        return req

    async with agent, Client(settings=settings) as client:
        listener = await nats.connect(settings.nats_url)
        subject = client.subjects.agent("silent-1", "silent.op")
        await listen_silently(listener, client.nc, subject)
        loop = asyncio.get_running_loop()

        async def silent(timeout: float) -> None:
            sent = loop.time()
            with pytest.raises(RequestTimeout):
                await client.request("silent.op", {}, agent_id="silent-1", timeout=timeout)
            assert loop.time() - sent >= timeout

        try:
            async with asyncio.timeout(30):  # only a guard against hanging
                waiting = [asyncio.ensure_future(silent(0.5 + i / 50)) for i in range(50)]
                await eventually(lambda: client.footprint()["pending"] == 50)
                for n in range(300):
                    await client.request("quick.op", {"n": n}, agent_id="quick-1")
                assert client.footprint()["deadlines"] <= 2 * 51 + 64
                await asyncio.gather(*waiting)
        finally:
            await listener.close()
        await eventually(lambda: client.footprint()["deadlines"] == 0)


async def test_a_request_pending_when_the_connection_is_replaced_is_failed(settings):
    """Connecting again after the connection closed under the client (closed by its user,
    or by nats-py) starts a new inbox: a request still waiting on the old one can never be
    answered, so it fails at once instead of waiting forever."""
    import nats

    from reach import ConnectionFailed

    async with Client(settings=settings) as client:
        listener = await nats.connect(settings.nats_url)
        try:
            subject = client.subjects.agent("stuck-1", "stuck.op")
            await listen_silently(listener, client.nc, subject)
            waiting = asyncio.ensure_future(
                client.request("stuck.op", {}, agent_id="stuck-1", timeout=60)
            )
            await eventually(lambda: client.footprint()["pending"] == 1)
            await client.nc.close()
            await client.connect()
            async with asyncio.timeout(10):  # only a guard against hanging
                with pytest.raises(ConnectionFailed, match="closed while waiting"):
                    await waiting
            assert client.footprint()["pending"] == 0
        finally:
            await listener.close()
