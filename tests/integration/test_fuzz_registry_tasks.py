"""Property: garbage on every subject a registry and a task consumer listen on is refused
or dropped, and counted, and they keep serving real traffic.

The registry: its API (register/deregister with and without an agent id, route, list)
answers an error body or a valid reply to anything, and heartbeats that do not decode, or
that name another agent or impossible numbers, are dropped and counted. A task consumer:
task messages that do not decode go to the dead-letter stream, and real tasks still run.
"""

import asyncio
from contextlib import AsyncExitStack

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reach import Agent, Client, ReachSettings, Registry, TaskState
from reach.testing import eventually, unique_prefix
from reach.wire import ErrorBody, Header, Heartbeat
from reach.wire.tasks import TaskSubmit


class Harness:
    """A registry, an agent with a durable task, and a client, on a loop of their own."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.stack = AsyncExitStack()
        self.settings = ReachSettings(
            nats_url=url, subject_prefix=unique_prefix(), heartbeat_interval=0.5, lease_ttl=5
        )
        self.registry = Registry(settings=self.settings)
        self.agent_id = "fuzz-" + unique_prefix()
        self.agent = Agent("fuzz", self.agent_id, settings=self.settings)

        @self.agent.capability("fuzz.echo")
        async def echo(req: dict) -> dict:
            return req

        @self.agent.task("fuzz.job")
        async def job(req: dict) -> dict:
            return {"done": req.get("n")}

        self.client = Client(settings=self.settings)
        self.run(self.registry.start())
        self.run(self.agent.start())
        self.run(self.client.connect())
        self.run(eventually(self.agent_known, timeout=20))
        self.subjects = self.client.subjects

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def agent_known(self) -> bool:
        return any(r.info.agent_id == self.agent_id for r in await self.client.agents())

    async def raw(self, subject: str, data: bytes, headers: dict | None):
        try:
            return await self.client.nc.request(subject, data, timeout=2, headers=headers)
        except nats.errors.TimeoutError:
            return None

    async def still_serves(self) -> None:
        assert await self.client.request("fuzz.echo", {"n": 1}) == {"n": 1}
        assert await self.agent_known()

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.agent.stop())
        self.run(self.registry.stop())
        self.run(self.stack.aclose())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@pytest.fixture(scope="module")
def harness(nats_server):
    h = Harness(nats_server.url)
    yield h
    h.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)
ids = st.sampled_from(["fuzz-x", "a", "Z_9-q"]) | st.text(min_size=1, max_size=70)
bodies = (
    st.binary(max_size=300)
    | json_values.map(msgspec.json.encode)
    # near misses: the right tags with wrong, huge, or absurd fields
    | st.builds(
        lambda t, v: msgspec.json.encode({"type": t, **v}),
        st.sampled_from(
            [
                "reach.registry.register",
                "reach.registry.deregister",
                "reach.registry.route",
                "reach.registry.list",
                "reach.agent.heartbeat",
                "reach.task.submit",
            ]
        ),
        st.dictionaries(
            st.sampled_from(
                ["agent_id", "info", "capability", "limit", "load", "seq", "task_id", "payload"]
            ),
            json_values | ids | st.integers(min_value=-(2**70), max_value=2**70),
            max_size=5,
        ),
    )
)
headers = st.none() | st.dictionaries(
    st.sampled_from([Header.PRIORITY, Header.DEADLINE, Header.ATTEMPT, "X-Other"]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1),
    max_size=3,
)


def decodes(data: bytes, kind: type):
    """``data`` decoded as ``kind``, or None."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError:
        return None


FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(
    verb=st.sampled_from(["register", "deregister", "route", "list", "register.", "deregister."]),
    agent_id=ids.filter(lambda s: "." not in s and " " not in s and s.isprintable()),
    data=bodies,
    hdrs=headers,
)
def test_registry_api_answers_an_error_or_a_valid_reply(harness, verb, agent_id, data, hdrs):
    async def check():
        s = harness.subjects
        subject = s.registry(verb.rstrip(".")) + (f".{agent_id}" if verb.endswith(".") else "")
        before = harness.registry.stats.bad_requests
        msg = await harness.raw(subject, data, hdrs)
        assert msg is not None, subject  # an API request always gets an answer
        code = (msg.headers or {}).get(Header.SERVICE_ERROR_CODE)
        if code is not None:
            assert msgspec.json.decode(msg.data, type=ErrorBody).code == "bad_request"
            assert harness.registry.stats.bad_requests == before + 1
        await harness.still_serves()

    harness.run(check())


@FUZZ
@given(
    agent_id=ids.filter(lambda s: "." not in s and " " not in s and s.isprintable()),
    data=bodies,
)
def test_bad_heartbeats_are_dropped_and_counted(harness, agent_id, data):
    async def check():
        stats = harness.registry.stats
        before = (stats.heartbeats, stats.dropped_malformed, stats.dropped_spoofed)
        await harness.client.nc.publish(harness.subjects.heartbeat(agent_id), data)
        await eventually(lambda: harness.registry.stats.heartbeats > before[0])
        after = harness.registry.stats
        hb = decodes(data, Heartbeat)
        if hb is None:
            assert after.dropped_malformed == before[1] + 1
        elif hb.agent_id != agent_id:
            assert after.dropped_spoofed == before[2] + 1
        # nothing it sent is stored for an agent nobody registered (it is asked to register)
        records = harness.registry.records()
        assert agent_id == harness.agent_id or agent_id not in records
        await harness.still_serves()

    harness.run(check())


@FUZZ
@given(data=bodies, hdrs=headers, prio=st.sampled_from(["high", "normal", "low"]))
def test_garbage_task_messages_go_to_the_dlq_and_real_tasks_still_run(harness, data, hdrs, prio):
    async def check():
        js = harness.client.nc.jetstream()
        task_id = "fuzz" + unique_prefix()[-8:]
        subject = harness.subjects.task(task_id, "fuzz.job", prio)
        invalid = harness.agent.task_stats.invalid
        await js.publish(subject, data, headers=hdrs)
        if not decodes(data, TaskSubmit):
            # did not decode: counted, and moved to the dead-letter stream
            await eventually(lambda: harness.agent.task_stats.invalid == invalid + 1)
        ref = await harness.client.submit("fuzz.job", {"n": 7})
        rec = await ref.wait(timeout=30)
        assert rec.state is TaskState.SUCCEEDED
        await harness.still_serves()

    harness.run(check())
