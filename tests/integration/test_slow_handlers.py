"""Handlers that take seconds: the caller's whole deadline goes to the first attempt, and
a timed-out attempt is never run again unasked (the rule in sdk/PROTOCOL.md, "Timeouts and
retries"). Each test counts the handler's runs."""

import asyncio
from contextlib import AsyncExitStack

import pytest

import reach
from reach import Agent, Client, Context, Registry, Status
from tests.integration.test_registry import fast_settings, wait_status


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


def slow(settings, agent_id: str, runs: list[str], seconds: float) -> Agent:
    """An agent whose handler takes ``seconds``; each run is counted as it starts."""
    agent = Agent("slowpoke", agent_id, settings=settings)

    @agent.capability("slow.answer")
    async def answer(job: dict, ctx: Context) -> dict:
        runs.append(agent_id)
        await asyncio.sleep(seconds)  # the work itself: a slow LLM or order system
        return {"by": agent_id}

    return agent


@pytest.mark.parametrize("share", [0.6, 0.95])
@pytest.mark.parametrize("instances", [1, 2])
@pytest.mark.parametrize("registry", [False, True], ids=["queue-group", "routed"])
async def test_a_handler_inside_the_deadline_is_answered_and_runs_once(
    settings, share, instances, registry
):
    timeout = 5.0  # the default: a handler at 95% of it still has 250 ms to spare
    runs: list[str] = []
    async with AsyncExitStack() as stack:
        if registry:
            await stack.enter_async_context(Registry(settings=settings))
        client = await stack.enter_async_context(Client(settings=settings))
        for i in range(instances):
            await stack.enter_async_context(slow(settings, f"slow-{i}", runs, share * timeout))
        if registry:
            for i in range(instances):
                await wait_status(client, f"slow-{i}", Status.UP)
        reply = await client.call("slow.answer", {})  # the default timeout
    # the agents have stopped (drained): every run that was ever sent has been counted
    assert reply.value == {"by": reply.agent_id}
    assert runs == [reply.agent_id]


@pytest.mark.parametrize("idempotent", [False, True])
async def test_a_timed_out_attempt_is_not_run_again_through_the_queue_group(settings, idempotent):
    """No registry: the queue group chooses, so a retry could land on the same instance
    while the first run goes on. It is never sent, even when the caller allows retries."""
    runs: list[str] = []
    async with Client(settings=settings) as client:
        async with slow(settings, "slow-0", runs, 30), slow(settings, "slow-1", runs, 30):
            with pytest.raises(reach.RequestTimeout) as info:
                await client.call(
                    "slow.answer", {}, timeout=1.0, max_attempts=3, idempotent=idempotent
                )
    assert len(runs) == 1
    assert [a.outcome for a in info.value.attempts] == ["timeout"]


def gated(settings, agent_id: str, runs: list[str], gate: asyncio.Event) -> Agent:
    agent = Agent("slowpoke", agent_id, settings=settings, drain_timeout=0.2)

    @agent.capability("slow.answer")
    async def answer(job: dict, ctx: Context) -> dict:
        runs.append(agent_id)
        if agent_id.startswith("stuck"):
            await asyncio.sleep(job.get("pause", 0))  # the work: slower than quick-1
            await gate.wait()  # hangs while cleared
        return {"by": agent_id}

    return agent


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_timed_out_attempt_moves_to_a_faster_instance_only_when_the_caller_allows(
    settings, idempotent
):
    gate = asyncio.Event()
    runs: list[str] = []
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with gated(settings, "stuck-0", runs, gate), gated(settings, "quick-1", runs, gate):
            await wait_status(client, "stuck-0", Status.UP)
            await wait_status(client, "quick-1", Status.UP)
            gate.set()
            await _warm_both(client)
            gate.clear()
            runs.clear()
            call = client.call(
                "slow.answer",
                {},
                timeout=3.0,
                routing="affinity",
                affinity_key="s",
                idempotent=idempotent,
            )
            if idempotent:
                reply = await call
                assert reply.agent_id == "quick-1"
            else:
                with pytest.raises(reach.RequestTimeout):
                    await call
    # the session's instance first; then the other only when the work may run twice
    assert runs == (["stuck-0", "quick-1"] if idempotent else ["stuck-0"])


async def _warm_both(client: Client) -> None:
    """The client learns both latencies (stuck-0 the slower, as it pauses 0.2 s), and the
    session 's' sticks to stuck-0."""
    await client.call("slow.answer", {}, agent_id="quick-1")
    reply = await client.call("slow.answer", {"pause": 0.2}, agent_id="stuck-0", affinity_key="s")
    assert reply.agent_id == "stuck-0"
