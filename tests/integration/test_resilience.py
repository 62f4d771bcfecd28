"""Failover, retries and protection against a real server, registry and agents."""

import asyncio
import os
import signal
import sys

import pytest

import reach
from reach import Agent, Client, Context, Registry, Status
from reach.testing import NatsServer, eventually
from tests.integration.test_registry import fast_settings, wait_status


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


def worker(settings, agent_id, calls=None, *, delay=0.0, fail=False, **kw):
    agent = Agent("worker", agent_id, settings=settings, **kw)

    @agent.capability("work.do")
    async def do(job: dict, ctx: Context) -> dict:
        if calls is not None:
            calls.append(agent_id)
        if delay:
            await asyncio.sleep(delay)  # simulated work
        if fail:
            raise RuntimeError("broken")
        return {"by": agent_id, "attempt": ctx.attempt}

    return agent


def gated(settings, agent_id: str, gate: asyncio.Event) -> Agent:
    """An agent whose answers wait for ``gate`` (set: instant)."""
    agent = Agent("worker", agent_id, settings=settings, drain_timeout=0.2)

    @agent.capability("work.do")
    async def do(job: dict, ctx: Context) -> dict:
        await gate.wait()
        return {"by": agent_id}

    return agent


async def test_failover_on_sigkill_loses_no_request(settings):
    env = {
        **os.environ,
        "REACH_NATS_URL": settings.nats_url,
        "REACH_SUBJECT_PREFIX": settings.subject_prefix,
        "REACH_HEARTBEAT_INTERVAL": "0.2",
        "REACH_LEASE_TTL": "1",
    }
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "reach.examples.logistics",
            env=env,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for _ in range(3)
    ]
    try:
        async with Registry(settings=settings), Client(settings=settings) as client:
            await eventually(lambda: _count(client, "logistics.track", 3), timeout=30)
            failures: list[BaseException] = []
            served: dict[str, int] = {}

            async def load(n: int) -> None:
                for i in range(n):
                    try:
                        r = await client.call("logistics.track", {"order_id": f"o{i}"}, timeout=5)
                        served[r.agent_id] = served.get(r.agent_id, 0) + 1
                    except reach.ReachError as exc:
                        failures.append(exc)

            workers = [asyncio.create_task(load(60)) for _ in range(8)]
            await eventually(lambda: sum(served.values()) >= 100)
            victim = procs[0]
            os.kill(victim.pid, signal.SIGKILL)
            await victim.wait()
            await asyncio.gather(*workers)
    finally:
        for p in procs:
            if p.returncode is None:
                p.terminate()
                await p.wait()
    assert failures == []
    assert sum(served.values()) == 480
    assert len(served) == 3


async def _count(client: Client, capability: str, n: int) -> bool:
    return len(await client.agents(capability)) == n


async def test_failover_on_resource_exhausted(settings):
    gate = asyncio.Event()
    busy = Agent("worker", "w-busy", settings=settings, max_concurrency=1, max_queue=0)
    calls: list[str] = []

    @busy.capability("work.do")
    async def blocked(job: dict) -> dict:
        calls.append("w-busy")
        await gate.wait()
        return {"by": "w-busy"}

    async with Registry(settings=settings), Client(settings=settings) as client:
        async with busy, worker(settings, "w-free", calls):
            await wait_status(client, "w-busy", Status.UP)
            await wait_status(client, "w-free", Status.UP)
            hold = asyncio.create_task(client.request("work.do", {}, agent_id="w-busy"))
            await eventually(lambda: calls == ["w-busy"])
            replies = [await client.call("work.do", {}, routing="scored") for _ in range(6)]
            gate.set()
            await hold
    assert {r.agent_id for r in replies} == {"w-free"}


async def test_refusals_are_counted_as_attempts_with_backoff(settings):
    busy = Agent("worker", "w-full", settings=settings, max_concurrency=1, max_queue=0)
    gate = asyncio.Event()
    started = asyncio.Event()

    @busy.capability("work.do")
    async def blocked(job: dict) -> dict:
        started.set()
        await gate.wait()
        return {}

    async with busy, Client(settings=settings) as client:
        hold = asyncio.create_task(client.request("work.do", {}))
        await started.wait()
        with pytest.raises(reach.ResourceExhausted, match="all busy") as info:
            await client.request("work.do", {}, max_attempts=3)
        gate.set()
        await hold
    assert [a.outcome for a in info.value.attempts] == ["resource_exhausted"] * 3
    assert all(a.agent_id == "w-full" for a in info.value.attempts)


async def test_failed_is_not_retried(settings):
    calls: list[str] = []
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with (
            worker(settings, "w-bad", calls, fail=True),
            worker(settings, "w-bad2", calls, fail=True),
        ):
            await wait_status(client, "w-bad", Status.UP)
            await wait_status(client, "w-bad2", Status.UP)
            with pytest.raises(reach.HandlerFailed) as info:
                await client.request("work.do", {})
    assert len(calls) == 1
    assert [a.outcome for a in info.value.attempts] == ["failed"]


async def test_direct_never_substitutes(settings):
    calls: list[str] = []
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with worker(settings, "w-live", calls):
            await wait_status(client, "w-live", Status.UP)
            gone = worker(settings, "w-gone", calls)
            async with gone:
                await wait_status(client, "w-gone", Status.UP)
            with pytest.raises(reach.AgentUnavailable) as info:
                await client.request("work.do", {}, agent_id="w-gone", max_attempts=3)
    assert calls == []
    assert [a.agent_id for a in info.value.attempts] == ["w-gone"]


async def test_degraded_instance_gets_no_high_priority(settings):
    calls: list[str] = []
    slow = worker(settings, "w-slow", calls, delay=1.0)
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with slow, worker(settings, "w-ok", calls):
            await wait_status(client, "w-slow", Status.UP)
            await wait_status(client, "w-ok", Status.UP)
            # three handler timeouts within 10 s: the agent degrades itself
            for _ in range(3):
                with pytest.raises(reach.RequestTimeout):
                    await client.request("work.do", {}, agent_id="w-slow", timeout=0.1)
            await wait_status(client, "w-slow", Status.DEGRADED)
            calls.clear()
            for _ in range(20):
                r = await client.call("work.do", {}, priority="high")
                assert r.agent_id == "w-ok"
            # and the agent itself refuses high priority sent straight to it
            with pytest.raises(reach.ResourceExhausted, match="DEGRADED"):
                await client.request("work.do", {}, agent_id="w-slow", priority="high")
    assert set(calls) == {"w-ok"}


async def test_weights_and_task_types_change_without_restart(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with worker(settings, "w-1"):
            await wait_status(client, "w-1", Status.UP)
            assert (await client.request("work.do", {}, routing="scored"))["by"] == "w-1"
            async with Client(settings=settings) as admin:
                await admin.set_routing_weights("work.do", threshold=0.99)
                await admin.set_task_type("refund-request", "work.do")

            async def refused() -> bool:
                try:
                    await client.request("work.do", {}, routing="scored")
                except reach.CapabilityNotFound:
                    return True
                return False

            await eventually(refused)
            assert (await client.request("refund-request", {}))["by"] == "w-1"
            async with Client(settings=settings) as admin:
                await admin.set_routing_weights("work.do", threshold=0.3)

            async def served() -> bool:
                return not await refused()

            await eventually(served)


async def test_affinity_sticks_to_the_instance_that_served_the_session(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        a, b, c = (worker(settings, f"w-{x}") for x in "abc")
        async with a, b, c:
            for agent_id in ("w-a", "w-b", "w-c"):
                await wait_status(client, agent_id, Status.UP)
            first = await client.call("work.do", {}, routing="affinity", affinity_key="s-1")
            for _ in range(10):
                again = await client.call("work.do", {}, routing="affinity", affinity_key="s-1")
                assert again.agent_id == first.agent_id
            sticky = next(x for x in (a, b, c) if x.agent_id == first.agent_id)
            await sticky.stop()
            await wait_status(client, first.agent_id, None)
            moved = await client.call("work.do", {}, routing="affinity", affinity_key="s-1")
            assert moved.agent_id != first.agent_id


async def test_hedge_loser_is_cancelled_awaited_and_not_a_success(settings):
    slow_gate, fast_gate = asyncio.Event(), asyncio.Event()
    slow_gate.set()
    fast_gate.set()
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with gated(settings, "w-slow", slow_gate):
            await wait_status(client, "w-slow", Status.UP)
            for _ in range(30):  # the session sticks to w-slow; p95 learnt from quick answers
                reply = await client.call("work.do", {}, routing="affinity", affinity_key="s")
                assert reply.agent_id == "w-slow"
            async with gated(settings, "w-fast", fast_gate):
                await wait_status(client, "w-fast", Status.UP)
                slow_gate.clear()  # from now on w-slow sits on its requests
                reply = await client.call(
                    "work.do", {}, routing="affinity", affinity_key="s", hedge=True, timeout=10
                )
                inflight = client.footprint()["router.inflight"]
                cancelled = client.stats.attempts_cancelled
                sticky = await client.pick("work.do", routing="affinity", affinity_key="s")
                slow_gate.set()
    assert reply.agent_id == "w-fast"
    assert inflight == 0  # the loser was awaited before the call returned
    assert cancelled == 1  # and recorded as cancelled, not ok
    assert sticky == "w-fast"  # the session stays with the winner


async def test_cancelled_hedged_call_cancels_and_awaits_both_attempts(settings):
    gate = asyncio.Event()
    gate.set()
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with gated(settings, "w-h1", gate), gated(settings, "w-h2", gate):
            await wait_status(client, "w-h1", Status.UP)
            await wait_status(client, "w-h2", Status.UP)
            for _ in range(30):  # learn the p95 from quick answers
                await client.call("work.do", {})
            gate.clear()
            call = asyncio.create_task(client.call("work.do", {}, hedge=True, timeout=30))
            await eventually(lambda: client.footprint()["pending"] == 2)  # both sent
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            sizes = client.footprint()
            cancelled = client.stats.attempts_cancelled
            gate.set()
    assert sizes["router.inflight"] == 0
    assert sizes["pending"] == 0
    assert cancelled == 2


async def test_rate_limit_fails_fast_on_the_client(nats_server):
    settings = fast_settings(nats_server.url).model_copy(
        update={"rate_limits": {"work.do": (0.001, 2.0)}}
    )
    async with worker(settings, "w-rl"), Client(settings=settings) as client:
        await client.request("work.do", {})
        await client.request("work.do", {})
        with pytest.raises(reach.ResourceExhausted, match="rate limit"):
            await client.request("work.do", {})


async def test_registry_down_requests_still_served_on_last_known_table(settings):
    registry = Registry(settings=settings)
    await registry.start()
    async with Client(settings=settings) as client, worker(settings, "w-last"):
        await wait_status(client, "w-last", Status.UP)
        await registry.stop()
        for _ in range(5):
            assert (await client.request("work.do", {}))["by"] == "w-last"
        await wait_status(client, "w-last", None)  # the lease expired by itself
        assert (await client.request("work.do", {}))["by"] == "w-last"  # queue group


async def test_a_hedge_that_fails_is_recorded_against_the_instance_that_answered(settings):
    roles: dict[str, str] = {}
    hedge_asked, release = asyncio.Event(), asyncio.Event()

    def busy_agent(agent_id: str) -> Agent:
        agent = Agent("worker", agent_id, settings=settings, drain_timeout=0.2)

        @agent.capability("work.do")
        async def do(job: dict, ctx: Context) -> dict:
            role = roles.get(agent_id)
            if role == "first":  # fails once the hedge has gone out
                await hedge_asked.wait()
                raise reach.ResourceExhausted("busy")
            if role == "hedge":  # fails last, so its error is the one raised
                hedge_asked.set()
                await release.wait()
                raise reach.ResourceExhausted("busy")
            return {"by": agent_id}

        return agent

    async with Registry(settings=settings), Client(settings=settings) as client:
        async with busy_agent("w-x"), busy_agent("w-y"):
            await wait_status(client, "w-x", Status.UP)
            await wait_status(client, "w-y", Status.UP)
            for _ in range(30):  # the session sticks to one; p95 learnt from quick answers
                first = await client.call("work.do", {}, routing="affinity", affinity_key="s")
            hedge = "w-y" if first.agent_id == "w-x" else "w-x"
            roles.update({first.agent_id: "first", hedge: "hedge"})
            call = asyncio.create_task(
                client.request(
                    "work.do",
                    {},
                    routing="affinity",
                    affinity_key="s",
                    hedge=True,
                    max_attempts=1,
                    timeout=10,
                )
            )
            # the hedge was asked and the first instance's refusal is back
            await eventually(lambda: hedge_asked.is_set() and client.footprint()["pending"] == 1)
            release.set()
            with pytest.raises(reach.RemoteError) as info:
                await call
    assert [a.agent_id for a in info.value.attempts] == [hedge]


async def test_config_writes_wait_out_jetstream_then_fail_with_one_reach_error():
    """A config write tried while JetStream cannot answer (here: off; in a cluster: a
    bucket just made, its leader not yet elected) is tried again for ``task_patience``,
    then ends as ``ConnectionFailed`` naming JetStream, never as a raw nats-py error."""
    async with NatsServer(jetstream=False) as server:
        settings = reach.ReachSettings(nats_url=server.url, task_patience=0.5)
        async with Client(settings=settings) as admin:
            with pytest.raises(reach.ConnectionFailed, match="JetStream did not answer"):
                await asyncio.wait_for(admin.set_task_type("refund-request", "work.do"), 10)
            with pytest.raises(reach.ConnectionFailed, match="JetStream did not answer"):
                await asyncio.wait_for(admin.set_routing_weights("work.do", threshold=0.5), 10)
