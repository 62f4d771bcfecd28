"""The agent's queue: priorities, a full queue, deadlines, graceful drain."""

import asyncio

import nats
import pytest

import reach
from reach import Agent, Client, Context, Priority
from reach.testing import eventually
from reach.wire import Header


async def wait_queue(agent: Agent, length: int) -> None:
    await eventually(lambda: agent.queue_len == length)


def gated_agent(settings, order, gate, **kw) -> Agent:
    agent = Agent("worker", settings=settings, **kw)

    @agent.capability("work.do")
    async def do(job: dict, ctx: Context) -> dict:
        order.append(job["n"])
        if job.get("wait"):
            await gate.wait()
        return {"n": job["n"], "priority": ctx.priority.value}

    return agent


async def test_priority_order_under_load(reach_settings, reach_client):
    order: list = []
    gate = asyncio.Event()
    agent = gated_agent(reach_settings, order, gate, max_concurrency=1, max_queue=10)
    async with agent:
        blocker = asyncio.create_task(reach_client.request("work.do", {"n": 0, "wait": True}))
        await eventually(lambda: order == [0])
        queued = []
        for n, prio in [(1, "low"), (2, "normal"), (3, "high"), (4, "low"), (5, "high")]:
            queued.append(
                asyncio.create_task(reach_client.request("work.do", {"n": n}, priority=prio))
            )
            await wait_queue(agent, len(queued))
        gate.set()
        results = await asyncio.gather(blocker, *queued)
    assert order == [0, 3, 5, 2, 1, 4]
    assert [r["priority"] for r in results[1:]] == ["low", "normal", "high", "low", "high"]


async def test_full_queue_answers_resource_exhausted_at_once(reach_settings, reach_client):
    order: list = []
    gate = asyncio.Event()
    agent = gated_agent(reach_settings, order, gate, max_concurrency=1, max_queue=1)
    async with agent:
        running = asyncio.create_task(reach_client.request("work.do", {"n": 1, "wait": True}))
        await eventually(lambda: order == [1])
        waiting = asyncio.create_task(reach_client.request("work.do", {"n": 2}))
        await eventually(lambda: agent.queue_len == 1)
        with pytest.raises(reach.ResourceExhausted, match="full") as info:
            await reach_client.request("work.do", {"n": 3}, timeout=60, max_attempts=1)
        assert info.value.retryable
        assert info.value.agent_id == agent.agent_id
        assert [a.outcome for a in info.value.attempts] == ["resource_exhausted"]
        gate.set()
        assert [r["n"] for r in await asyncio.gather(running, waiting)] == [1, 2]
    assert order == [1, 2]
    assert agent.stats.rejected == 1


async def test_expired_deadline_is_dropped_unrun_and_counted(reach_settings, reach_client):
    order: list = []
    agent = gated_agent(reach_settings, order, asyncio.Event(), agent_id="w-1")
    nc = reach_client.nc
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    async with agent:
        subject = reach_client.subjects.agent("w-1", "work.do")
        await nc.publish(subject, b'{"n": 1}', reply=inbox, headers={Header.DEADLINE: "1000"})
        # Same subscription, so the expired request is handled before this one.
        assert (await reach_client.request("work.do", {"n": 2}, agent_id="w-1"))["n"] == 2
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=0.2)
    assert order == [2]
    assert agent.stats.expired == 1


async def test_handler_past_its_deadline_is_cancelled_and_worker_freed(
    reach_settings, reach_client
):
    agent = Agent("slow", settings=reach_settings, max_concurrency=1)
    cancelled = asyncio.Event()

    @agent.capability("slow.op")
    async def op(req: dict) -> dict:
        if req.get("hang"):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return {"ok": True}

    async with agent:
        with pytest.raises(reach.RequestTimeout):
            await reach_client.request("slow.op", {"hang": True}, timeout=0.3)
        await cancelled.wait()
        assert await reach_client.request("slow.op", {}) == {"ok": True}


async def test_bad_headers_get_bad_request(reach_settings, reach_client):
    agent = gated_agent(reach_settings, [], asyncio.Event())
    async with agent:
        for headers in ({Header.PRIORITY: "urgent"}, {Header.DEADLINE: "soon"}):
            msg = await reach_client.nc.request(
                reach_client.subjects.cap("work.do"), b'{"n":1}', headers=headers, timeout=5
            )
            assert msg.headers[Header.SERVICE_ERROR_CODE] == "400"


async def test_graceful_drain_under_load_loses_no_accepted_request(reach_settings):
    served: dict[str, int] = {}

    def make(agent_id):
        agent = Agent(
            "drainer",
            agent_id,
            settings=reach_settings,
            max_concurrency=4,
            max_queue=1000,
            drain_timeout=30,
        )

        @agent.capability("work.slow")
        async def slow(job: dict) -> dict:
            await asyncio.sleep(0.005)  # simulated work, not synchronisation
            served[agent_id] = served.get(agent_id, 0) + 1
            return {"n": job["n"], "by": agent_id}

        return agent

    a, b = make("d-a"), make("d-b")
    await a.start()
    await b.start()
    async with Client(settings=reach_settings) as client:
        n = 400
        tasks = [
            asyncio.create_task(client.call("work.slow", {"n": i}, timeout=30)) for i in range(n)
        ]
        await eventually(lambda: served.get("d-a", 0) >= 10)
        await a.stop()
        replies = await asyncio.gather(*tasks)
        await b.stop()
    assert sorted(r.value["n"] for r in replies) == list(range(n))
    assert sum(served.values()) == n
    assert served["d-a"] > 0
    assert served["d-b"] > 0


async def test_stop_past_drain_timeout_tells_callers(reach_settings, reach_client):
    agent = Agent("stuck", settings=reach_settings, max_concurrency=1, drain_timeout=0.1)
    started = asyncio.Event()

    @agent.capability("stuck.op")
    async def op(req: dict) -> dict:
        started.set()
        await asyncio.Event().wait()
        return {}

    await agent.start()
    pending = asyncio.create_task(reach_client.request("stuck.op", {}, timeout=30))
    queued = asyncio.create_task(reach_client.request("stuck.op", {}, timeout=30))
    await started.wait()
    await eventually(lambda: agent.queue_len == 1)
    await agent.stop()
    for task in (pending, queued):
        with pytest.raises(reach.AgentUnavailable, match="no agent alive") as info:
            await task
        # told at once that the agent stopped; the retry then found nobody
        assert info.value.attempts[0].outcome == "agent_unavailable"
        assert info.value.attempts[-1].outcome == "no_responders"


async def test_priority_enum_and_string_are_equivalent(reach_settings, reach_client):
    agent = gated_agent(reach_settings, [], asyncio.Event())
    async with agent:
        a = await reach_client.request("work.do", {"n": 1}, priority=Priority.HIGH)
        b = await reach_client.request("work.do", {"n": 2}, priority="high")
    assert a["priority"] == b["priority"] == "high"


async def test_queue_overload_degrades_then_recovers(reach_settings, reach_client):
    order: list = []
    gate = asyncio.Event()
    agent = gated_agent(reach_settings, order, gate, max_concurrency=1, max_queue=5)
    async with agent:
        running = asyncio.create_task(reach_client.request("work.do", {"n": 0, "wait": True}))
        await eventually(lambda: order == [0])
        queued = []
        for n in range(1, 5):  # 4 of 5 queued: 80%
            assert agent.status == reach.Status.UP
            queued.append(asyncio.create_task(reach_client.request("work.do", {"n": n})))
            await wait_queue(agent, n)
        assert agent.status == reach.Status.DEGRADED
        assert agent.state == "DEGRADED"
        with pytest.raises(reach.ResourceExhausted, match="DEGRADED"):
            await reach_client.request("work.do", {"n": 9}, priority="high", max_attempts=1)
        gate.set()
        await asyncio.gather(running, *queued)
        assert agent.status == reach.Status.UP
    assert order == [0, 1, 2, 3, 4]
