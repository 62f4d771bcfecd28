"""Where a call may go after a timeout or a lost connection (sdk/PROTOCOL.md, "Time and
timeouts"): never back to an instance whose work may still be running, at once elsewhere
when the caller allows the work to run twice, and on waiting when it does not."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

import reach
from chaos.proxy import Proxy
from reach import Agent, Client, Context, Registry, Status
from reach.testing import eventually
from tests.integration.test_registry import fast_settings, wait_status


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


def member(settings, agent_id: str, runs: list[str], gate: asyncio.Event, **kw) -> Agent:
    """Answers at once while ``gate`` is set, else holds each request until it is."""
    agent = Agent("member", agent_id, settings=settings, drain_timeout=0.2, **kw)

    @agent.capability("member.work")
    async def work(job: dict, ctx: Context) -> dict:
        runs.append(agent_id)
        await asyncio.sleep(job.get("pause", 0))  # the work: slower on some instances
        if job.get("hold", True):
            await gate.wait()
        return {"by": agent_id}

    return agent


async def test_a_timed_out_instance_is_not_tried_again_after_a_fast_failure(settings):
    """A times out (cut short: B is known faster), B refuses (busy): the call ends, and
    never goes back to A, where the first run may still be going."""
    stuck, busy = asyncio.Event(), asyncio.Event()
    runs: list[str] = []
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with (
            member(settings, "a-stuck", runs, stuck),
            member(settings, "b-busy", runs, busy, max_concurrency=1, max_queue=0),
        ):
            await wait_status(client, "a-stuck", Status.UP)
            await wait_status(client, "b-busy", Status.UP)
            stuck.set()
            busy.set()
            await client.call("member.work", {}, agent_id="b-busy")
            sticky = await client.call(
                "member.work", {"pause": 0.2}, agent_id="a-stuck", affinity_key="s"
            )
            assert sticky.agent_id == "a-stuck"
            stuck.clear()
            busy.clear()
            holder = asyncio.create_task(client.request("member.work", {}, agent_id="b-busy"))
            await eventually(lambda: runs[-1:] == ["b-busy"])  # its only slot is taken
            runs.clear()
            with pytest.raises(reach.ReachError) as info:
                await client.call(
                    "member.work",
                    {},
                    timeout=3.0,
                    routing="affinity",
                    affinity_key="s",
                    idempotent=True,
                )
            busy.set()
            await holder
    outcomes = [(a.agent_id, a.outcome) for a in info.value.attempts]
    assert outcomes == [("a-stuck", "timeout"), ("b-busy", "resource_exhausted")]
    assert runs == ["a-stuck"]


async def _pinned(client: Client, agent_id: str) -> None:
    """The session 'p' sticks to ``agent_id``."""
    reply = await client.call("member.work", {"hold": False}, agent_id=agent_id, affinity_key="p")
    assert reply.agent_id == agent_id


@contextlib.asynccontextmanager
async def pinned_behind_proxy(
    settings, runs: list[str], slow: asyncio.Event, free: asyncio.Event
) -> AsyncIterator[tuple[Proxy, Client]]:
    """A client behind a proxy (to cut), slow-0 and free-1 UP, the session 'p' on slow-0."""
    async with Proxy(settings.nats_url) as proxy, Registry(settings=settings):
        behind = settings.model_copy(update={"nats_url": proxy.url})
        async with (
            Client(settings=behind) as client,
            member(settings, "slow-0", runs, slow),
            member(settings, "free-1", runs, free),
        ):
            await wait_status(client, "slow-0", Status.UP)
            await wait_status(client, "free-1", Status.UP)
            await _pinned(client, "slow-0")
            runs.clear()
            yield proxy, client


async def test_a_lost_connection_fails_over_at_once_when_the_work_may_run_twice(settings):
    gate, free = asyncio.Event(), asyncio.Event()
    free.set()
    runs: list[str] = []
    async with pinned_behind_proxy(settings, runs, gate, free) as (proxy, client):
        call = asyncio.create_task(
            client.call(
                "member.work",
                {"hold": True},
                timeout=20.0,
                routing="affinity",
                affinity_key="p",
                idempotent=True,
            )
        )
        await eventually(lambda: runs == ["slow-0"])  # the first attempt runs there
        loop = asyncio.get_running_loop()
        cut_at = loop.time()
        proxy.cut()
        reply = await call
        took = loop.time() - cut_at
        gate.set()
    assert reply.agent_id == "free-1"
    assert runs == ["slow-0", "free-1"]
    assert took < 10.0  # at once after the reconnect, not at the 20 s deadline


async def test_a_call_waits_on_across_a_reconnect_when_its_work_may_not_run_twice(settings):
    gate = asyncio.Event()
    runs: list[str] = []
    async with pinned_behind_proxy(settings, runs, gate, gate) as (proxy, client):
        call = asyncio.create_task(
            client.call("member.work", {}, timeout=20.0, routing="affinity", affinity_key="p")
        )
        await eventually(lambda: runs == ["slow-0"])
        before = client.nc.stats["reconnects"]
        proxy.cut()
        await eventually(lambda: client.nc.stats["reconnects"] > before and client.connected)
        # a round trip through the new connection: the server has the inbox again
        await client.call("member.work", {"hold": False}, agent_id="free-1")
        assert not call.done()  # still waiting: its answer may still come
        gate.set()  # slow-0 answers after the reconnect, and the answer comes through
        reply = await call
    assert reply.agent_id == "slow-0"
    assert runs == ["slow-0", "free-1"]  # the handler ran once; free-1 ran the round trip


async def test_a_routing_table_that_never_loads_costs_a_call_no_more_than_its_deadline(
    settings,
):
    async with Proxy(settings.nats_url) as proxy:
        behind = settings.model_copy(update={"nats_url": proxy.url})
        async with Client(settings=behind) as client:
            proxy.pause()  # connected, but JetStream (and everyone else) never answers
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(reach.RequestTimeout, match="routing table did not load"):
                await client.call("member.work", {}, timeout=1.0, version="1")
            assert loop.time() - started < 1.0  # half the deadline went to the table
            started = loop.time()
            with pytest.raises(reach.RequestTimeout):
                await client.call("member.work", {}, timeout=1.0)
            assert loop.time() - started < 1.5  # the deadline, with the loop's own slack
            proxy.resume()


@pytest.mark.parametrize("gone", [True, False], ids=["gone", "alive"])
async def test_a_timed_out_instance_that_is_gone_leaves_the_queue_group_to_idempotent_work(
    settings, gone: bool
):
    """No registry renews the leases, so the table empties while an idempotent call waits
    on doomed-0 (cut short: live-1 was known faster). At its timeout the only way left is
    the queue group. A ping to doomed-0 that nobody answers (its connection is gone, its
    work with it) lets the call go there, to live-1; an instance that answers the ping may
    still be running the work, so the call ends with the timeout."""
    gate, free = asyncio.Event(), asyncio.Event()
    free.set()
    runs: list[str] = []
    async with Proxy(settings.nats_url) as proxy, Client(settings=settings) as client:
        behind = settings.model_copy(update={"nats_url": proxy.url})
        async with member(behind, "doomed-0", runs, gate), member(settings, "live-1", runs, free):
            async with Registry(settings=settings):
                await wait_status(client, "doomed-0", Status.UP)
                await wait_status(client, "live-1", Status.UP)
                await _pinned(client, "doomed-0")
                await client.call("member.work", {"hold": False}, agent_id="live-1")  # known fast
            runs.clear()
            call = asyncio.create_task(
                client.call(
                    "member.work",
                    {},
                    timeout=6.0,
                    routing="affinity",
                    affinity_key="p",
                    idempotent=True,
                )
            )
            await eventually(lambda: runs == ["doomed-0"])
            if gone:
                await proxy.close()  # doomed-0's connection ends, and it cannot come back

            async def emptied() -> bool:
                return not await client.agents("member.work")

            await eventually(emptied, timeout=4)
            assert not call.done()  # the table emptied while the first attempt waited
            if gone:
                reply = await call
                assert reply.agent_id == "live-1"
                assert runs == ["doomed-0", "live-1"]
            else:
                with pytest.raises(reach.RequestTimeout):
                    await call
                assert runs == ["doomed-0"]
            gate.set()
