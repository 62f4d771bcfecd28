"""A 3-node JetStream cluster on loopback: the registry, agents, requests and durable tasks
run on it, every stream and bucket Reach makes is R3, and a crashed node does not stop them.

One cluster serves the whole file (it takes a second or more to elect); each test has its
own subject prefix, so its streams and buckets are its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.js import JetStreamContext

from reach import Agent, Client, ReachError, ReachSettings, Registry, Status, TaskContext, TaskState
from reach.testing import NatsCluster, eventually, unique_prefix


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    with NatsCluster(3) as nodes:
        yield nodes


def cluster_settings(cluster: NatsCluster, **changes: Any) -> ReachSettings:
    values: dict[str, Any] = {
        "nats_url": cluster.urls,
        "subject_prefix": unique_prefix(),
        "replicas": 3,
        "heartbeat_interval": 0.5,
        "lease_ttl": 3.0,
        "register_backoff": 0.05,
        "register_backoff_max": 0.3,
        "task_ack_wait": 3.0,
        "timeout_ms": 20_000,
        **changes,
    }
    return ReachSettings(**values)


def stream_names(settings: ReachSettings) -> list[str]:
    """Every stream Reach makes under the settings' prefix (buckets are KV_ streams)."""
    prefix = settings.subject_prefix
    upper = prefix.replace(".", "_").upper()
    buckets = [f"KV_{prefix}_{b}" for b in ("agents", "config", "tasks", "idem")]
    return [*buckets, f"{upper}_TASKS", f"{upper}_DLQ", f"{upper}_TASK_EVENTS"]


def fleet(settings: ReachSettings) -> tuple[Agent, Agent]:
    """An agent answering requests and one running durable tasks (both answer ``ping``)."""
    front = Agent("front", settings=settings)
    worker = Agent("worker", settings=settings)

    @front.capability("cl.ping")
    @worker.capability("cl.ping")
    async def ping(payload: dict[str, Any]) -> dict[str, Any]:
        return {"pong": payload["n"]}

    @worker.task("cl.work")
    async def work(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        return {"done": payload["n"], "attempt": ctx.attempt}

    return front, worker


async def both_up(client: Client, *agents: Agent) -> None:
    async def up() -> bool:
        seen = {r.info.agent_id: r.status for r in await client.agents()}
        return all(seen.get(a.agent_id) is Status.UP for a in agents)

    await eventually(up, timeout=30)


async def replica_peers(js: JetStreamContext, stream: str) -> tuple[int, list[str]]:
    """The stream's configured replicas and the peers that follow its leader."""
    info = await js.stream_info(stream)
    assert info.cluster is not None, stream
    return info.config.num_replicas or 1, sorted(p.name or "" for p in info.cluster.replicas or [])


@pytest.fixture
async def running(cluster: NatsCluster) -> AsyncIterator[tuple[ReachSettings, Client]]:
    """A registry, the two agents and a client on the cluster, every agent UP in the table."""
    await cluster.await_ready()  # a node a test before crashed may still be catching up
    settings = cluster_settings(cluster)
    front, worker = fleet(settings)
    async with Registry(settings=settings), front, worker, Client(settings=settings) as client:
        await both_up(client, front, worker)
        yield settings, client


async def test_registry_agents_requests_and_tasks_run_at_r3(
    cluster: NatsCluster, running: tuple[ReachSettings, Client]
):
    settings, client = running
    replies = [await client.call("cl.ping", {"n": n}) for n in range(6)]
    refs = [await client.submit("cl.work", {"n": n}) for n in range(3)]
    results = [await ref.result(timeout=60) for ref in refs]
    await client.set_task_type("cl.job", "cl.work")  # makes the config bucket
    js = client.nc.jetstream()
    shapes = {s: await replica_peers(js, s) for s in stream_names(settings)}
    consumers = await js.consumers_info(f"{settings.subject_prefix.upper()}_TASKS")

    assert [r.value for r in replies] == [{"pong": n} for n in range(6)]
    assert results == [{"done": n, "attempt": 1} for n in range(3)]
    assert [(await ref.status()).state for ref in refs] == [TaskState.SUCCEEDED] * 3
    for stream, (replicas, peers) in shapes.items():
        assert replicas == 3, stream
        assert len(peers) == 2, (stream, peers)
        assert set(peers) < set(cluster.names), (stream, peers)
    assert consumers  # the worker's durable consumer follows its stream: R3 too
    for c in consumers:
        assert c.cluster is not None, c.name
        assert len(c.cluster.replicas or []) == 2, c.name


async def test_streams_and_buckets_made_at_r1_are_left_as_they_are_and_named_in_warnings(
    cluster: NatsCluster, caplog: pytest.LogCaptureFixture
):
    r1 = cluster_settings(cluster, replicas=1)
    r3 = r1.model_copy(update={"replicas": 3})
    async with Registry(settings=r1), Client(settings=r1) as client:
        await client.submit("cl.later", {})  # makes the task streams and buckets at R1
    caplog.set_level(logging.WARNING, logger="reach.kv")
    async with Registry(settings=r3), Client(settings=r3) as client:
        await client.submit("cl.later", {})
        js = client.nc.jetstream()
        shapes = [await replica_peers(js, s) for s in stream_names(r1) if "config" not in s]
    warned = " | ".join(r.getMessage() for r in caplog.records if r.name == "reach.kv")
    assert shapes == [(1, [])] * 6  # not changed
    prefix, upper = r1.subject_prefix, r1.subject_prefix.upper()
    for stream in (f"KV_{prefix}_agents", f"KV_{prefix}_tasks", f"{upper}_TASKS"):
        assert f"stream {stream} has 1 replica(s), the settings ask for 3" in warned


async def test_reach_up_cluster_runs_three_routed_nodes_and_a_registry_at_r3(tmp_path: Path):
    up = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "reach.cli", "up", "--cluster", "3", "--port", "-1"),
        *("--data-dir", str(tmp_path / "data")),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,  # no nats-server.conf here: the nodes run on defaults
    )
    assert up.stdout is not None
    assert up.stderr is not None
    pids: list[int] = []
    try:
        async with asyncio.timeout(60):
            url = (await up.stdout.readline()).decode().strip()
            while not pids:
                line = (await up.stderr.readline()).decode()
                assert line, "reach up ended before it named its servers"
                if "nats-servers (pids" in line:
                    pids = [int(p) for p in line.split("pids ")[1].split(")")[0].split(", ")]
        settings = ReachSettings(nats_url=url, replicas=3)
        async with Client(settings=settings) as client:
            # the registry answered before the URL was printed, so its bucket is there
            shape = await replica_peers(client.nc.jetstream(), "KV_reach_agents")
            servers = len(client.nc.servers)
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await up.wait()
    assert len(url.split(",")) == 3
    assert servers == 3
    assert shape[0] == 3
    assert len(shape[1]) == 2
    assert up.returncode == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def lead_elsewhere(client: Client, streams: list[str], victim: str, heir: str) -> None:
    """Move the leaders of ``streams`` and of their replicated consumers from ``victim`` to
    ``heir`` (a leader stepdown with a preferred peer), so that ``victim`` is a follower."""
    js = client.nc.jetstream(timeout=1)
    body = json.dumps({"placement": {"preferred": heir}}).encode()

    async def led_by_victim() -> list[str]:
        subjects = []
        for stream in streams:
            info = await js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader == victim:
                subjects.append(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}")
            for c in await js.consumers_info(stream):
                if c.cluster is not None and c.cluster.replicas and c.cluster.leader == victim:
                    subjects.append(f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{c.name}")
        return subjects

    async def moved() -> bool:
        try:
            subjects = await led_by_victim()
            for subject in subjects:
                await client.nc.request(subject, body, timeout=1)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return False  # a group between leaders answers nothing: look again
        return not subjects

    await eventually(moved, timeout=30)


async def test_requests_and_tasks_go_on_while_a_follower_node_is_down(
    cluster: NatsCluster, running: tuple[ReachSettings, Client]
):
    settings, client = running
    await client.submit("cl.work", {"n": 0})  # the task streams exist before the crash
    meta = cluster.meta_leader()
    victim, heir = [name for name in cluster.names if name != meta][:2]
    streams = [s for s in stream_names(settings) if not s.endswith("_config")]
    await lead_elsewhere(client, streams, victim, heir)
    await cluster.akill_node(cluster.names.index(victim))

    async def answered() -> bool:
        try:
            return (await client.call("cl.ping", {"n": -1}, timeout=5)).value == {"pong": -1}
        except ReachError:
            return False  # both agents were on the dead node and are still reconnecting

    try:
        await eventually(answered, timeout=30)
        replies = [await client.call("cl.ping", {"n": n}, timeout=10) for n in range(4)]
        ref = await client.submit("cl.work", {"n": 8})
        result = await ref.result(timeout=60)
    finally:
        # The next test (if any) waits for the cluster to be healthy again.
        await cluster.nodes[cluster.names.index(victim)].astart()
    assert [r.value for r in replies] == [{"pong": n} for n in range(4)]
    assert result == {"done": 8, "attempt": 1}


class _Seen(logging.Handler):
    """Sets ``event`` when a record's message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.event = text, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@asynccontextmanager
async def no_quorum(cluster: NatsCluster) -> AsyncIterator[None]:
    """Nodes 1 and 2 killed: one node of three, no leader anywhere; both back on exit."""
    try:
        for i in (1, 2):
            await cluster.akill_node(i)
        yield
    finally:
        for i in (1, 2):
            await cluster.nodes[i].astart(30)  # a no-op for a node already running
        await cluster.await_ready()


async def first_done(work: asyncio.Task[Any], event: asyncio.Event) -> None:
    """Wait for ``event``; fail if ``work`` ends (gives up, or fails) first."""
    waiting = asyncio.create_task(event.wait())
    done, _ = await asyncio.wait({work, waiting}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    assert work not in done, work.exception()


async def test_an_agent_started_while_jetstream_has_no_quorum_waits_for_it(cluster: NatsCluster):
    """Agent.start used to die with nats-py's raw TimeoutError when the task stream had
    no leader (the cluster_failover chaos scenario): now it tries again until a leader is
    elected, then serves its tasks."""
    await cluster.await_ready()
    settings = cluster_settings(cluster, task_patience=90.0)
    async with Client(settings=settings) as client:
        first = await client.submit("cl.work", {"n": 1})  # the streams exist; no agent yet
    seen = _Seen("JetStream not answering")
    logging.getLogger("reach.tasks").addHandler(seen)
    _, worker = fleet(settings.model_copy(update={"nats_url": cluster.nodes[0].url}))
    try:
        async with no_quorum(cluster):
            starting = asyncio.create_task(worker.start())
            await first_done(starting, seen.event)
        await asyncio.wait_for(starting, 120)
        async with Client(settings=settings) as client:
            assert await (await client.task(first.task_id)).result(timeout=60) == {
                "done": 1,
                "attempt": 1,
            }
    finally:
        logging.getLogger("reach.tasks").removeHandler(seen)
        await worker.stop()


async def test_a_submit_while_jetstream_has_no_quorum_waits_for_it(cluster: NatsCluster):
    """A submit during a leader election failed with no-responders (349 of 1631 in the
    cluster_failover chaos run): now it publishes again (the same Nats-Msg-Id, stored
    once) until the stream has a leader."""
    await cluster.await_ready()
    settings = cluster_settings(cluster, task_patience=90.0, nats_url=cluster.nodes[0].url)
    _, worker = fleet(settings)
    seen = _Seen("JetStream not answering")
    logging.getLogger("reach.tasks").addHandler(seen)
    try:
        async with worker, Client(settings=settings) as client:
            await client.submit("cl.work", {"n": 0})  # the task side is set up
            async with no_quorum(cluster):
                submitting = asyncio.create_task(client.submit("cl.work", {"n": 2}))
                await first_done(submitting, seen.event)
            ref = await asyncio.wait_for(submitting, 120)
            assert await ref.result(timeout=60) == {"done": 2, "attempt": 1}
    finally:
        logging.getLogger("reach.tasks").removeHandler(seen)
