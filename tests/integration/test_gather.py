"""Asking every instance at once (``Client.gather``, ``reach call --all``): one outcome per
instance, the errors a request would raise, early returns that leave nothing behind."""

import asyncio
import json

import nats
import pytest

from chaos.proxy import Proxy
from reach import (
    Agent,
    AgentUnavailable,
    CapabilityNotFound,
    Client,
    ConfigurationError,
    Registry,
    Reply,
    RequestTimeout,
    Status,
    Telemetry,
)
from reach.cli import build_parser
from reach.testing import eventually
from tests.integration.registry_wire import ERROR, fast_settings, info, register
from tests.integration.test_cli_tasks import reach_cli
from tests.integration.test_registry import wait_status
from tests.integration.test_telemetry import tracing

CAP = "inspect.seen"


@pytest.fixture
def settings(nats_server):
    # leases long enough that an instance whose connection is gone stays in the table
    # (UP) for the whole test, as it does for a while after a crash
    return fast_settings(nats_server.url, lease_ttl=60.0)


def inspector(
    settings, agent_id: str, *, gate: asyncio.Event | None = None, tags=(), runs=None
) -> Agent:
    """Answers at once, or, with ``gate``, once the gate is set."""
    agent = Agent("inspector", agent_id, settings=settings, tags=list(tags), drain_timeout=0.2)

    @agent.capability(CAP)
    async def seen(req: dict) -> dict:
        if runs is not None:
            runs.append(agent_id)
        if gate is not None:
            await gate.wait()
        return {"by": agent_id, "machine": req["machine"]}

    return agent


async def dead_instance(settings, agent_id: str) -> None:
    """An instance that registered (UP in the table) and whose connection is gone."""
    nc = await nats.connect(settings.nats_url)
    try:
        reply = await register(nc, settings, info(agent_id, capability=CAP))
        assert not reply.headers or ERROR not in reply.headers, reply.headers
    finally:
        await nc.close()


async def all_up(client: Client, *agent_ids: str) -> None:
    for agent_id in agent_ids:
        await wait_status(client, agent_id, Status.UP)


def requests(telemetry: Telemetry, outcome: str) -> float | None:
    return telemetry.registry.get_sample_value(
        "reach_client_requests_total", {"capability": CAP, "policy": "gather", "outcome": outcome}
    )


async def test_each_instance_gets_its_own_outcome_fast_slow_and_dead(settings):
    """A fast instance's Reply, a timeout for one that answers after the deadline, and
    agent_unavailable (no responders) for one whose connection is gone: no exception
    for all, nothing left pending, and each outcome taught the router and the metrics."""
    gate = asyncio.Event()
    telemetry = Telemetry()
    async with (
        Registry(settings=settings),
        Client(settings=settings, telemetry=telemetry) as client,
        inspector(settings, "fast-1"),
        inspector(settings, "slow-1", gate=gate),
    ):
        await dead_instance(settings, "dead-1")
        await all_up(client, "fast-1", "slow-1", "dead-1")
        result = await client.gather(CAP, {"machine": 17}, timeout=2.0)
        sizes = client.footprint()
        counted = {o: requests(telemetry, o) for o in ("ok", "timeout", "no_responders")}
        gate.set()
    assert list(result) == ["dead-1", "fast-1", "slow-1"]  # agent id order
    fast = result["fast-1"]
    assert isinstance(fast, Reply)
    assert (fast.value, fast.agent_id) == ({"by": "fast-1", "machine": 17}, "fast-1")
    slow = result["slow-1"]
    assert isinstance(slow, RequestTimeout)
    assert slow.capability == CAP
    dead = result["dead-1"]
    assert isinstance(dead, AgentUnavailable)
    assert (dead.agent_id, dead.outcome) == ("dead-1", "no_responders")
    assert list(result.replies) == ["fast-1"]
    assert list(result.errors) == ["dead-1", "slow-1"]
    assert (result.unanswered, result.skipped) == ((), {})
    assert sizes["pending"] == 0
    assert sizes["router.inflight"] == 0
    assert sizes["router.absent"] == 1  # dead-1: passed over by requests until it answers
    assert sizes["router.ewma"] == 1  # fast-1's latency was learnt
    assert counted == {"ok": 1.0, "timeout": 1.0, "no_responders": 1.0}


async def test_min_replies_returns_early_and_cancels_the_rest(settings):
    gate = asyncio.Event()
    runs: list[str] = []
    telemetry = Telemetry()
    async with (
        Registry(settings=settings),
        Client(settings=settings, telemetry=telemetry) as client,
        inspector(settings, "fast-1"),
        inspector(settings, "fast-2"),
        inspector(settings, "slow-1", gate=gate, runs=runs),
    ):
        await all_up(client, "fast-1", "fast-2", "slow-1")
        result = await client.gather(CAP, {"machine": 17}, timeout=60.0, min_replies=2)
        assert not gate.is_set()  # returned while slow-1 could not have answered
        sizes = client.footprint()
        cancelled = client.stats.attempts_cancelled
        samples = [
            requests(telemetry, "ok"),
            requests(telemetry, "cancelled"),
            telemetry.registry.get_sample_value(
                "reach_client_requests_in_flight", {"capability": CAP}
            ),
            telemetry.registry.get_sample_value(
                "reach_client_attempts_total", {"capability": CAP, "outcome": "cancelled"}
            ),
        ]
        await eventually(lambda: runs == ["slow-1"])  # it was asked all the same
        gate.set()
    assert list(result.replies) == ["fast-1", "fast-2"]
    assert result.unanswered == ("slow-1",)
    assert "slow-1" not in result
    assert (sizes["pending"], sizes["router.inflight"]) == (0, 0)
    assert cancelled == 1
    # the one not waited for has no outcome as a request (no failure), only its attempt
    # counts as cancelled; nothing stays in flight
    assert samples == [2.0, None, 0.0, 1.0]


async def test_a_cancelled_gather_leaves_no_request_behind(settings):
    gate = asyncio.Event()
    runs: list[str] = []
    async with (
        Registry(settings=settings),
        Client(settings=settings) as client,
        inspector(settings, "slow-1", gate=gate, runs=runs),
        inspector(settings, "slow-2", gate=gate, runs=runs),
    ):
        await all_up(client, "slow-1", "slow-2")
        gathering = asyncio.create_task(client.gather(CAP, {"machine": 1}, timeout=60.0))
        await eventually(lambda: sorted(runs) == ["slow-1", "slow-2"])
        gathering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gathering
        sizes = client.footprint()
        gate.set()
    assert (sizes["pending"], sizes["router.inflight"]) == (0, 0)
    assert client.stats.attempts_cancelled == 2


async def test_required_tags_choose_who_is_asked_and_paused_instances_are_named(settings):
    async with (
        Registry(settings=settings),
        Client(settings=settings) as client,
        inspector(settings, "eu-1", tags=["eu"]),
        inspector(settings, "eu-2", tags=["eu"]) as paused,
        inspector(settings, "us-1", tags=["us"]),
    ):
        await all_up(client, "eu-1", "eu-2", "us-1")
        await paused.pause()
        await wait_status(client, "eu-2", Status.PAUSED)
        eu = await client.gather(CAP, {"machine": 3}, required_tags=["eu"])
        everyone = await client.gather(CAP, {"machine": 3})
        with pytest.raises(CapabilityNotFound, match="lack tag 'gpu'"):
            await client.gather(CAP, {"machine": 3}, required_tags=["gpu"])
        with pytest.raises(CapabilityNotFound, match=r"not 2\.x"):
            await client.gather(CAP, {"machine": 3}, version="2.0")
    assert list(eu.replies) == ["eu-1"]
    assert eu.skipped == {"eu-2": "is PAUSED"}
    assert list(everyone.replies) == ["eu-1", "us-1"]
    assert everyone.errors == {}


async def test_an_empty_fleet_raises_capability_not_found_and_bad_arguments_raise(settings):
    async with Registry(settings=settings), Client(settings=settings) as client:
        with pytest.raises(CapabilityNotFound, match=f"no live agent offers '{CAP}'"):
            await client.gather(CAP, {"machine": 1}, timeout=5.0)
        for bad in (
            {"min_replies": 0},
            {"timeout": 0},
            {"priority": "urgent"},
            {"request_id": "x" * 300},
        ):
            with pytest.raises(ConfigurationError):
                await client.gather(CAP, {"machine": 1}, **bad)
        assert client.footprint()["pending"] == 0


async def test_a_gather_without_a_routing_table_raises_request_timeout(settings):
    """A gather asks the instances the table lists: a table that never loads (connected,
    but JetStream never answers) is a RequestTimeout, not a guess through the queue group."""
    async with Proxy(settings.nats_url) as proxy:
        behind = settings.model_copy(update={"nats_url": proxy.url})
        async with Client(settings=behind) as client:
            proxy.pause()
            with pytest.raises(RequestTimeout, match="routing table did not load"):
                await client.gather(CAP, {"machine": 1}, timeout=1.0)
            proxy.resume()
            assert client.footprint()["pending"] == 0


async def test_a_gather_has_a_span_over_one_span_per_instance(settings):
    provider, exporter, _ = tracing()
    async with (
        Registry(settings=settings),
        Client(settings=settings, telemetry=Telemetry(tracer_provider=provider)) as client,
        inspector(settings, "fast-1"),
        inspector(settings, "fast-2"),
    ):
        await all_up(client, "fast-1", "fast-2")
        await client.gather(CAP, {"machine": 5})
    spans = exporter.get_finished_spans()
    (top,) = [s for s in spans if s.name == f"gather {CAP}"]
    assert top.attributes["reach.routing_policy"] == "gather"
    assert top.attributes["reach.gather.asked"] == 2
    assert top.attributes["reach.gather.answered"] == 2
    assert top.attributes["reach.outcome"] == "ok"
    sends = [s for s in spans if s.name == f"send {CAP}"]
    assert sorted(s.attributes["reach.agent_id"] for s in sends) == ["fast-1", "fast-2"]
    assert all(s.parent.span_id == top.context.span_id for s in sends)


async def test_reach_call_all_prints_one_line_per_instance(settings):
    async with (
        Registry(settings=settings),
        Client(settings=settings) as client,
        inspector(settings, "eu-1"),
        inspector(settings, "eu-2") as paused,
    ):
        await all_up(client, "eu-1", "eu-2")
        await paused.pause()
        await wait_status(client, "eu-2", Status.PAUSED)
        code, out, err = await reach_cli(settings, "call", "--all", CAP, '{"machine": 17}')
        assert code == 0, err
        assert out.splitlines() == [
            'eu-1  {"by": "eu-1", "machine": 17}',
            "eu-2  skipped: is PAUSED",
        ]
        await dead_instance(settings, "dead-1")
        await wait_status(client, "dead-1", Status.UP)
        code, out, err = await reach_cli(settings, "call", "--all", CAP, '{"machine": 17}')
    assert code == 1, err  # an instance failed: said on its line, and in the exit code
    lines = out.splitlines()
    assert lines[0].startswith("dead-1  error: agent_unavailable: ")
    assert lines[1:] == ['eu-1    {"by": "eu-1", "machine": 17}', "eu-2    skipped: is PAUSED"]


def test_reach_call_takes_all_or_one_agent_not_both(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["call", "--all", "--agent", "a-1", CAP])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert json.loads(build_parser().parse_args(["call", "--all", CAP]).payload) is None


async def test_unknown_and_down_instances_are_named_not_asked(nats_server):
    """gather.py, docs/calling.md: UNKNOWN and DOWN instances are not asked, and the
    result names them under ``skipped`` with their status, so that a missing answer is
    never silent. One instance froze (its connection is up; it neither heartbeats nor
    answers: UNKNOWN while the registry's probe waits), one is gone (DOWN, kept by a long
    ``down_grace``); neither is asked, both are named, the live one answers."""
    settings = fast_settings(nats_server.url, probe_timeout=60.0, down_grace=60.0)
    frozen = await nats.connect(settings.nats_url)
    try:
        asked: list[str] = []

        async def record(msg) -> None:
            asked.append(msg.subject)

        await frozen.subscribe(f"{settings.subject_prefix}.agent.frozen-1.>", cb=record)
        await frozen.flush()
        async with (
            Registry(settings=settings),
            Client(settings=settings) as client,
            inspector(settings, "live-1"),
        ):
            reply = await register(frozen, settings, info("frozen-1", capability=CAP))
            assert not reply.headers or ERROR not in reply.headers, reply.headers
            await dead_instance(settings, "dead-1")
            await wait_status(client, "live-1", Status.UP)
            await wait_status(client, "frozen-1", Status.UNKNOWN)
            await wait_status(client, "dead-1", Status.DOWN)
            result = await client.gather(CAP, {"machine": 5}, timeout=5.0)
        assert list(result) == ["live-1"]
        assert list(result.replies) == ["live-1"]
        assert result.skipped == {"dead-1": "is DOWN", "frozen-1": "is UNKNOWN"}
        assert [s for s in asked if not s.endswith(".$ping")] == [], "a frozen one was asked"
    finally:
        await frozen.close()
