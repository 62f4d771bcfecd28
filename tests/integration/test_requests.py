"""Request/reply against a real nats-server: typed handlers, errors, routing."""

import asyncio
import logging
from collections import Counter

import msgspec
import nats
import pytest

import reach
from reach import Agent, Client, Context
from reach.testing import eventually
from reach.wire import ErrorBody, Header


class Translate(msgspec.Struct):
    text: str
    to: str = "fr"


class Translated(msgspec.Struct):
    text: str
    lang: str


def translator(settings, agent_id=None, calls=None, **kw) -> Agent:
    agent = Agent("translator", agent_id, settings=settings, **kw)

    @agent.capability("text.translate", version="1.2")
    async def translate(req: Translate, ctx: Context) -> Translated:
        if calls is not None:
            calls.append((ctx.agent_id, req.text))
        if req.text == "boom":
            raise RuntimeError("secret internal detail")
        if req.text == "refuse":
            raise reach.BadRequest("cannot translate that")
        return Translated(text=req.text.upper(), lang=req.to)

    return agent


async def test_typed_handler_round_trip(reach_settings, reach_client):
    async with translator(reach_settings, "tr-1"):
        reply = await reach_client.call(
            "text.translate", Translate(text="hi"), response_type=Translated
        )
    assert reply.value == Translated(text="HI", lang="fr")
    assert reply.agent_id == "tr-1"
    assert reply.request_id
    # rounded to the microsecond, as the gateway and the CLI show them
    assert reply.latency_ms == round(reply.latency_ms, 3) > 0


async def test_invalid_payload_is_bad_request_naming_field_and_handler_not_called(
    reach_settings, reach_client
):
    calls: list = []
    async with translator(reach_settings, calls=calls):
        with pytest.raises(reach.BadRequest, match=r"\$\.text") as info:
            await reach_client.request("text.translate", {"text": 42})
        with pytest.raises(reach.BadRequest, match="text"):
            await reach_client.request("text.translate", {"to": "de"})
        with pytest.raises(reach.BadRequest):
            await reach_client.request("text.translate", b"not json")
    assert calls == []
    assert info.value.code == "bad_request"
    assert not info.value.retryable


async def test_handler_exception_is_generic_failed_and_logged_with_request_id(
    reach_settings, reach_client, caplog
):
    caplog.set_level(logging.ERROR, logger="reach.agent")
    async with translator(reach_settings):
        with pytest.raises(reach.HandlerFailed) as info:
            await reach_client.request("text.translate", {"text": "boom"}, request_id="rid-42")
        assert "secret" not in str(info.value)
        assert "rid-42" in str(info.value)
        # the agent still serves afterwards
        assert (await reach_client.request("text.translate", {"text": "ok"}))["text"] == "OK"
    logged = [r for r in caplog.records if "rid-42" in r.getMessage()]
    assert logged
    assert logged[0].exc_info is not None
    assert "secret internal detail" in str(logged[0].exc_info[1])


async def test_handler_may_refuse_with_a_protocol_error(reach_settings, reach_client):
    async with translator(reach_settings):
        with pytest.raises(reach.BadRequest, match="cannot translate that"):
            await reach_client.request("text.translate", {"text": "refuse"})


async def test_direct_routing_reaches_only_that_instance(reach_settings, reach_client):
    calls: list = []
    async with translator(reach_settings, "tr-a", calls), translator(reach_settings, "tr-b", calls):
        for _ in range(10):
            reply = await reach_client.call("text.translate", {"text": "x"}, agent_id="tr-b")
            assert reply.agent_id == "tr-b"
    assert {agent for agent, _ in calls} == {"tr-b"}


async def test_no_instance_fails_fast_not_by_timeout(reach_settings, reach_client):
    async with asyncio.timeout(10):
        with pytest.raises(reach.CapabilityNotFound, match=r"text\.translate"):
            await reach_client.request("text.translate", {"text": "x"}, timeout=60)
        async with translator(reach_settings, "tr-1"):
            with pytest.raises(reach.AgentUnavailable, match=r"tr\-gone") as info:
                await reach_client.request(
                    "text.translate", {"text": "x"}, agent_id="tr-gone", timeout=60
                )
    assert info.value.agent_id == "tr-gone"


async def test_queue_group_serves_each_request_exactly_once_across_instances(
    reach_settings, reach_client
):
    calls: list = []
    agents = [translator(reach_settings, f"tr-{i}", calls) for i in range(3)]
    for agent in agents:
        await agent.start()
    try:
        n = 90
        replies = await asyncio.gather(
            *(reach_client.call("text.translate", {"text": f"m{i}"}) for i in range(n))
        )
    finally:
        for agent in agents:
            await agent.stop()
    texts = Counter(text for _, text in calls)
    assert len(texts) == n
    assert set(texts.values()) == {1}
    assert {r.value["text"] for r in replies} == {f"M{i}" for i in range(n)}
    assert {agent for agent, _ in calls} == {"tr-0", "tr-1", "tr-2"}


async def test_error_reply_follows_nats_services_convention(reach_settings, reach_client):
    async with translator(reach_settings, "tr-1"):
        msg = await reach_client.nc.request(
            reach_client.subjects.cap("text.translate"), b"{}", timeout=5
        )
    assert msg.headers[Header.SERVICE_ERROR_CODE] == "400"
    assert msg.headers[Header.AGENT] == "tr-1"
    body = msgspec.json.decode(msg.data, type=ErrorBody)
    assert body.code == "bad_request"
    assert body.retryable is False


async def test_plain_nats_client_can_call_without_headers(reach_settings, reach_client):
    async with translator(reach_settings, "tr-plain"):
        msg = await reach_client.nc.request(
            reach_client.subjects.cap("text.translate"), b'{"text":"plain"}', timeout=5
        )
    assert msgspec.json.decode(msg.data) == {"text": "PLAIN", "lang": "fr"}
    # A success reply is header-free; its reply-to is the answering instance's direct subject.
    assert not msg.headers
    assert msg.reply == reach_client.subjects.agent("tr-plain", "text.translate")


async def test_reply_headers_when_asked_for(reach_settings, reach_client):
    async with translator(reach_settings, "tr-h", reply_headers=True):
        reply = await reach_client.call("text.translate", {"text": "h"})
        msg = await reach_client.nc.request(
            reach_client.subjects.cap("text.translate"), b'{"text":"h"}', timeout=5
        )
    assert reply.agent_id == "tr-h"
    assert reply.duration_ms is not None
    assert reply.duration_ms >= 0
    assert msg.headers[Header.AGENT] == "tr-h"
    assert float(msg.headers[Header.DURATION_MS]) >= 0


async def test_handler_can_call_other_capabilities(reach_settings, reach_client):
    front = Agent("front", settings=reach_settings)

    @front.capability("support.ask")
    async def ask(q: dict, ctx: Context) -> dict:
        return await ctx.client.request("text.translate", {"text": q["q"]}, timeout=ctx.remaining())

    async with translator(reach_settings), front:
        assert await reach_client.request("support.ask", {"q": "nested"}) == {
            "text": "NESTED",
            "lang": "fr",
        }


async def test_invalid_arguments_raise_before_sending(reach_client):
    with pytest.raises(ValueError, match="wildcard"):
        await reach_client.request("text.*", {})
    with pytest.raises(reach.ConfigurationError, match="priority"):
        await reach_client.request("text.translate", {}, priority="urgent")
    with pytest.raises(ValueError, match="agent_id"):
        await reach_client.request("text.translate", {}, agent_id="a.b")
    for timeout in (0, -1.5):  # one rule, whatever the call
        for ask in (reach_client.request, reach_client.call, reach_client.gather):
            with pytest.raises(reach.ConfigurationError, match="timeout must be positive"):
                await ask("text.translate", {}, timeout=timeout)
        with pytest.raises(reach.ConfigurationError, match="timeout must be positive"):
            reach_client.stream("text.translate", {}, timeout=timeout)


async def test_ping_answers_with_live_load(reach_settings, reach_client):
    async with translator(reach_settings, "tr-p", max_concurrency=4):
        msg = await reach_client.nc.request(reach_client.subjects.ping("tr-p"), b"", timeout=5)
    hb = msgspec.json.decode(msg.data, type=reach.wire.Heartbeat)
    assert hb.agent_id == "tr-p"
    assert hb.status == reach.Status.UP


async def test_connection_failure_is_a_clear_error(nats_server):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = reach.ReachSettings(nats_url=f"nats://127.0.0.1:{port}", connect_timeout=0.5)
    with pytest.raises(reach.ConnectionFailed, match=str(port)):
        await Client(settings=settings).connect()


async def test_client_used_before_connect_says_so(reach_settings):
    with pytest.raises(reach.NotStarted):
        await Client(settings=reach_settings).request("a.b", {})


async def test_eventually_helper(reach_settings):
    hits = []
    agent = translator(reach_settings)
    async with agent, Client(settings=reach_settings) as c:
        task = asyncio.create_task(c.request("text.translate", {"text": "e"}))
        await eventually(lambda: agent.stats.served == 1)
        hits.append(await task)
    assert hits == [{"text": "E", "lang": "fr"}]


async def test_closing_a_client_fails_its_pending_requests(reach_settings):
    agent = Agent("never", settings=reach_settings, drain_timeout=0.1)
    started = asyncio.Event()

    @agent.capability("never.answers")
    async def hang(req: dict) -> dict:
        started.set()
        await asyncio.Event().wait()
        return {}

    async with agent:
        client = await Client(settings=reach_settings).connect()
        pending = asyncio.create_task(client.request("never.answers", {}, timeout=60))
        await started.wait()
        await client.close()
        with pytest.raises(reach.ConnectionFailed, match="closed"):
            await pending


async def test_a_payload_over_max_payload_fails_on_the_client_with_a_clear_error(
    reach_settings, reach_client
):
    """nats-py's own MaxPayloadError escaped from call(), request() and publish()."""
    served = []
    agent = Agent("big", settings=reach_settings)

    @agent.capability("big.op")
    async def op(payload: bytes) -> dict:
        served.append(len(payload))
        return {}

    big = b"x" * (reach_client.nc.max_payload + 1)
    # within max_payload alone, over it with the headers: the server would close the
    # connection (failing every call on it); refused before it is sent
    edge = b"x" * (reach_client.nc.max_payload - 10)
    async with agent:
        with pytest.raises(reach.ConfigurationError, match="with its headers"):
            await reach_client.call("big.op", edge)
        assert reach_client.connected
        for send in (
            lambda: reach_client.call("big.op", big),
            lambda: reach_client.request("big.op", big, agent_id=agent.agent_id),
            lambda: reach_client.publish("big.topic", big),
        ):
            with pytest.raises(reach.ConfigurationError, match="max_payload") as info:
                await send()
            assert str(reach_client.nc.max_payload) in str(info.value)
        assert await reach_client.request("big.op", b"small") == {}
    assert served == [5]


async def test_a_long_request_id_with_a_payload_near_the_limit_is_refused_on_the_client(
    reach_settings, reach_client
):
    """The size check assumed small headers; a request id is the caller's to choose, so a
    long one with a payload just under max_payload went out and the server closed the
    connection. Request ids are bounded instead."""
    near = b"x" * (reach_client.nc.max_payload - 5000)
    with pytest.raises(reach.ConfigurationError, match="request_id"):
        await reach_client.call("big.op", near, request_id="r" * 6000, timeout=2)
    assert reach_client.connected


async def listen_silently(listener: nats.NATS, caller: nats.NATS, subject: str) -> None:
    """Take the requests on ``subject`` and never answer. The server makes a new
    subscription's interest known to other connections a moment after its own flush
    returns (meanwhile it answers no-responders; about 1 request in 10 here), so wait
    until a probe from the caller's connection arrives."""
    sub = await listener.subscribe(subject)

    async def heard() -> bool:
        await caller.publish(subject, b"probe")
        try:
            await sub.next_msg(timeout=0.05)
        except nats.errors.TimeoutError:
            return False
        return True

    await eventually(heard)


async def test_each_request_times_out_at_its_own_deadline(reach_settings, reach_client):
    """The client's one timer serves every pending request: each gives up at its own
    deadline, never before it, whatever the order they were sent in; a request due sooner
    than all others brings the timer forward. (The listener takes requests and never
    answers: an agent would answer "timeout" itself at the caller's deadline.)"""
    listener = await nats.connect(reach_settings.nats_url)
    subject = reach_client.subjects.agent("silent-1", "silent.op")
    await listen_silently(listener, reach_client.nc, subject)
    loop = asyncio.get_running_loop()
    ended: list[float] = []

    async def ask(timeout: float) -> None:
        sent = loop.time()
        with pytest.raises(reach.RequestTimeout):
            await reach_client.request("silent.op", {}, agent_id="silent-1", timeout=timeout)
        assert loop.time() - sent >= timeout  # never before its deadline
        ended.append(timeout)

    try:
        async with asyncio.timeout(20):  # only a guard against hanging
            await asyncio.gather(*(ask(t) for t in (1.3, 0.1, 0.7)))
        assert ended == [0.1, 0.7, 1.3]
        # one due in a minute sets the timer a minute ahead; one due sooner brings it
        # forward, and times out while the other still waits
        later = asyncio.ensure_future(ask(60))
        await eventually(lambda: reach_client.footprint()["pending"] == 1)
        async with asyncio.timeout(20):
            await ask(0.2)
        assert not later.done()
        later.cancel()
        with pytest.raises(asyncio.CancelledError):
            await later
    finally:
        await listener.close()
