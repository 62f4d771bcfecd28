"""Property: random bytes, JSON and headers sent to every subject an agent listens on
only ever produce an error reply (or are ignored), and the agent keeps serving.

Every fuzzed subject is this test's own: its unique prefix on the session server, and the
NATS services subjects (``$SRV.<verb>``, ``$SRV.<verb>.<name>``, ``$SRV.<verb>.<name>.<id>``)
on a server of their own, where no other test's agent can hear them."""

import asyncio
from contextlib import AsyncExitStack

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reach import Agent, Client, ReachSettings
from reach.testing import NatsServer, eventually, unique_prefix
from reach.wire import ErrorBody, Header, Heartbeat


class Order(msgspec.Struct):
    order_id: str
    qty: int


class Harness:
    """An agent and a client on their own loop: on the server at ``url``, or (``None``) on a
    nats-server of their own."""

    def __init__(self, url: str | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.stack = AsyncExitStack()
        own = url is None
        if url is None:
            url = self.run(self.stack.enter_async_context(NatsServer())).url
        self.settings = ReachSettings(nats_url=url, subject_prefix=unique_prefix())
        self.agent_id = "fuzz-" + unique_prefix()
        self.agent = Agent("fuzz", self.agent_id, settings=self.settings, max_queue=1000)
        self.heard: list = []

        @self.agent.capability("order.place")
        async def place(order: Order) -> dict:
            return {"ok": order.order_id}

        @self.agent.on_topic("order.>")
        async def on_topic(update: Order) -> None:
            self.heard.append(update)

        self.client = Client(settings=self.settings)
        self.run(self.agent.start())
        self.run(self.client.connect())
        s = self.client.subjects
        self.cap_subjects = [s.cap("order.place"), s.agent(self.agent_id, "order.place")]
        self.ping = s.ping(self.agent_id)
        self.srv = [
            subject
            for verb in ("PING", "INFO", "STATS")
            for subject in (
                f"$SRV.{verb}",
                f"$SRV.{verb}.fuzz",
                f"$SRV.{verb}.fuzz.{self.agent_id}",
            )
        ]
        self.topic = s.topic("order.status")
        # On a shared server, $SRV.<verb> and $SRV.<verb>.<name> reach other tests' agents.
        self.shared = (
            [] if own else [self.run(self.client.nc.subscribe(f"$SRV.{t}")) for t in ("*", "*.*")]
        )
        self.run(self.client.flush())

    def sent_to_others(self) -> int:
        """Messages this harness sent where agents of other tests would hear them."""
        return sum(sub.pending_msgs for sub in self.shared)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def raw(self, subject: str, data: bytes, headers: dict | None) -> nats.aio.msg.Msg | None:
        try:
            return await self.client.nc.request(subject, data, timeout=0.5, headers=headers)
        except nats.errors.TimeoutError:
            return None

    async def still_serves(self) -> None:
        assert await self.client.request("order.place", {"order_id": "x", "qty": 1}) == {"ok": "x"}

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.agent.stop())
        self.run(self.stack.aclose())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@pytest.fixture(scope="module")
def harness(nats_server):
    h = Harness(nats_server.url)
    yield h
    h.close()


@pytest.fixture(scope="module")
def own_server_harness():
    h = Harness(None)
    yield h
    h.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)
bodies = (
    st.binary(max_size=300)
    | json_values.map(msgspec.json.encode)
    | st.builds(lambda o, q: msgspec.json.encode({"order_id": o, "qty": q}), st.text(), json_values)
)
header_text = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20
)
headers = st.none() | st.dictionaries(
    st.sampled_from(
        [
            Header.PRIORITY,
            Header.DEADLINE,
            Header.REQUEST_ID,
            Header.ATTEMPT,
            Header.CALLER,
            "X-Other",
        ]
    ),
    header_text | st.integers(min_value=0, max_value=2**63).map(str),
    max_size=4,
)
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def valid_order(data: bytes) -> bool:
    try:
        msgspec.json.decode(data, type=Order)
    except msgspec.DecodeError:
        return False
    return True


@FUZZ
@given(which=st.integers(0, 1), data=bodies, hdrs=headers)
def test_capability_subjects_answer_errors_or_valid_results(harness, which, data, hdrs):
    async def check():
        msg = await harness.raw(harness.cap_subjects[which], data, hdrs)
        if msg is None:
            # Only an already-expired deadline is dropped without an answer.
            assert hdrs
            assert Header.DEADLINE in hdrs
            assert int(hdrs[Header.DEADLINE]) <= harness.agent.heartbeat().sent_ms
        elif msg.headers and Header.SERVICE_ERROR_CODE in msg.headers:
            body = msgspec.json.decode(msg.data, type=ErrorBody)
            assert body.code in ("bad_request", "resource_exhausted")
        else:
            assert valid_order(data)
            assert set(msgspec.json.decode(msg.data)) == {"ok"}
        await harness.still_serves()
        assert harness.sent_to_others() == 0

    harness.run(check())


@FUZZ
@given(data=bodies, hdrs=headers, idx=st.integers(0, 9))
def test_ping_and_srv_subjects_always_answer_their_own_shape(own_server_harness, data, hdrs, idx):
    h = own_server_harness  # the only agent on its server: every $SRV form is fuzzed

    async def check():
        subject = h.ping if idx == 9 else h.srv[idx]
        msg = await h.raw(subject, data, hdrs)
        assert msg is not None
        if subject == h.ping:
            assert msgspec.json.decode(msg.data, type=Heartbeat).agent_id == h.agent_id
        else:
            assert msgspec.json.decode(msg.data)["id"] == h.agent_id
        await h.still_serves()

    h.run(check())


@FUZZ
@given(data=bodies, hdrs=headers)
def test_topic_listener_ignores_garbage_and_keeps_serving(harness, data, hdrs):
    async def check():
        before = (len(harness.heard), harness.agent.stats.invalid)
        await harness.client.nc.publish(harness.topic, data, headers=hdrs)
        await harness.client.nc.publish(harness.topic, b'{"order_id":"ok","qty":1}')
        await eventually(lambda: len(harness.heard) == before[0] + 1 + valid_order(data))
        if not valid_order(data):
            assert harness.agent.stats.invalid == before[1] + 1
        await harness.still_serves()
        assert harness.sent_to_others() == 0

    harness.run(check())
