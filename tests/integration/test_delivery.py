"""The request path's shortcuts through nats-py (``reach._delivery``), held to the installed
nats-py on a real server: delivery in the reading task, and writing through."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats
import pytest

import reach
from reach import Agent, ReachSettings
from reach._agent.lifecycle import State
from reach._delivery import (
    DirectQueue,
    publish,
    shortcuts_allowed,
    subscribe_direct,
    write_through,
)
from reach._nats import leave
from reach.testing import eventually


def fast(conn: nats.NATS) -> nats.NATS:
    """A plain connection with the shortcuts on, as ``connect_nats`` makes them."""
    conn.reach_shortcuts = shortcuts_allowed(conn)  # type: ignore[attr-defined]
    return conn


@pytest.fixture
async def nc(reach_settings: ReachSettings) -> AsyncIterator[nats.NATS]:
    """A plain nats-py connection to the test's server."""
    conn = fast(await nats.connect(reach_settings.nats_url))
    yield conn
    await conn.close()


async def test_messages_are_delivered_in_nats_py_reading_task(nc: nats.NATS):
    seen: list[tuple[bytes, str]] = []

    def deliver(msg: nats.aio.msg.Msg) -> None:
        task = asyncio.current_task()
        assert task is not None
        seen.append((msg.data, task.get_coro().__qualname__))  # type: ignore[union-attr]

    sub = await subscribe_direct(nc, "direct.a", deliver)
    # the installed nats-py is as subscribe_direct expects (else it fell back)
    assert isinstance(sub._pending_queue, DirectQueue)
    for n in range(3):
        await nc.publish("direct.a", str(n).encode())
    await nc.flush()
    await eventually(lambda: len(seen) == 3)
    assert seen == [
        (b"0", "Client._read_loop"),
        (b"1", "Client._read_loop"),
        (b"2", "Client._read_loop"),
    ]


async def test_direct_messages_arrive_as_nats_py_builds_them(nc: nats.NATS):
    """Read by reach (no status) or by nats-py (a status, as no-responders): a direct
    subscription gets what a plain one gets, counted as nats-py counts; other
    subscriptions on the connection, and a direct one that left, are nats-py's."""
    direct: list[nats.aio.msg.Msg] = []
    plain: list[nats.aio.msg.Msg] = []

    async def on_plain(msg: nats.aio.msg.Msg) -> None:
        plain.append(msg)

    sub = await subscribe_direct(nc, "same.>", direct.append)
    assert nc._process_msg.reads_direct  # reach reads for it (the installed nats-py fits)
    await nc.subscribe("same.>", cb=on_plain)
    sent = [
        ("same.a", b"one", "", None),
        ("same.b", b"", "rep.1", {"Reach-Deadline": "17", "X-Other": "v"}),
    ]
    for subject, data, reply, headers in sent:
        await nc.publish(subject, data, reply=reply, headers=headers)
    await nc.flush()
    await eventually(lambda: len(direct) == 2 and len(plain) == 2)

    def seen(msgs: list[nats.aio.msg.Msg]) -> list[tuple[object, ...]]:
        return [(m.subject, m.data, m.reply, m.headers, m._client, m.sid) for m in msgs]

    assert [(m.subject, m.data, m.reply, m.headers) for m in direct] == [
        (s, d, r, h) for s, d, r, h in sent
    ]
    assert [row[:5] for row in seen(direct)] == [row[:5] for row in seen(plain)]
    assert {m.sid for m in direct} == {sub._id}
    assert sub.delivered == 2
    assert nc.stats["in_msgs"] == 4
    assert nc.stats["in_bytes"] == 2 * len(b"one")
    # a status message (no one listens: 503) is read by nats-py, then handed over alike
    inbox = nc.new_inbox()
    await subscribe_direct(nc, inbox + ".*", direct.append)
    await nc.publish("nobody.listens", b"", reply=inbox + ".1", headers={"X": "1"})
    await eventually(lambda: len(direct) == 3)
    assert direct[-1].headers is not None
    assert direct[-1].headers.get("Status") == "503"
    # a direct subscription that left gets nothing more
    await sub.unsubscribe()
    await nc.publish("same.c", b"late")
    await nc.flush()
    await eventually(lambda: len(plain) == 3)
    assert len(direct) == 3


async def test_a_delivery_that_raises_is_counted_and_reading_goes_on(
    reach_settings: ReachSettings,
    nc: nats.NATS,
):
    good: list[bytes] = []

    def deliver(msg: nats.aio.msg.Msg) -> None:
        if msg.data == b"bad":
            raise RuntimeError("a bug in the deliver function")
        good.append(msg.data)

    sub = await subscribe_direct(nc, "direct.b", deliver)
    for data in (b"bad", b"ok", b"bad", b"ok"):
        await nc.publish("direct.b", data)
    await nc.flush()
    await eventually(lambda: len(good) == 2)
    assert isinstance(sub._pending_queue, DirectQueue)
    assert sub._pending_queue.failures == 2
    # the connection still reads: a request over it is answered
    responder = fast(await nats.connect(reach_settings.nats_url))

    async def echo(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(msg.data)

    await responder.subscribe("direct.echo", cb=echo)
    await responder.flush()

    async def answered() -> bool:  # the server passes the new interest on a moment late
        try:
            return (await nc.request("direct.echo", b"hi", timeout=5)).data == b"hi"
        except nats.errors.NoRespondersError:
            return False

    await eventually(answered)
    await responder.close()


async def test_nothing_stays_pending_and_draining_waits_for_nothing(nc: nats.NATS):
    count = 0

    def deliver(msg: nats.aio.msg.Msg) -> None:
        nonlocal count
        count += 1

    sub = await subscribe_direct(nc, "direct.c", deliver)
    for _ in range(2000):
        await nc.publish("direct.c", b"x" * 1024)
    await nc.flush()
    await eventually(lambda: count == 2000)
    # nats-py counts bytes as it queues; a count never taken back would end in
    # "slow consumer" drops once it passed the subscription's limit
    assert sub.pending_bytes == 0
    await asyncio.wait_for(leave(nc, sub), 10)  # returns: nothing is ever pending
    assert sub not in nc._subs.values()


async def test_write_through_empties_nats_py_buffer_at_once(reach_settings: ReachSettings):
    nc = fast(await nats.connect(reach_settings.nats_url))
    got: list[bytes] = []
    other = fast(await nats.connect(reach_settings.nats_url))
    try:

        async def on_msg(msg: nats.aio.msg.Msg) -> None:
            got.append(msg.data)

        await other.subscribe("direct.d", cb=on_msg)
        await other.flush()
        await nc.publish("direct.d", b"one")
        assert nc._pending_data_size > 0  # nats-py holds it for its flusher's next turn
        write_through(nc)
        assert nc._pending_data_size == 0  # written, with no turn of the loop
        await eventually(lambda: got == [b"one"])
        # nats-py's flusher, woken for it, finds nothing, and goes on working
        await nc.publish("direct.d", b"two")
        await nc.flush()
        await eventually(lambda: got == [b"one", b"two"])
        await nc.close()
        write_through(nc)  # a closed connection: nothing to do, nothing raised
    finally:
        if not nc.is_closed:
            await nc.close()
        await other.close()


@pytest.mark.parametrize("alone", [True, False])
async def test_publish_frames_as_nats_py_does(
    reach_settings: ReachSettings, nc: nats.NATS, alone: bool
):
    """The same message, sent by nats-py's publish and by ours, written at once (alone) or
    by nats-py's flusher, arrives the same: subject, reply, payload and headers (values
    cleaned of line breaks as nats-py does)."""
    listener = fast(await nats.connect(reach_settings.nats_url))
    got: list[nats.aio.msg.Msg] = []

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        got.append(msg)

    await listener.subscribe("now.>", cb=on_msg)
    await listener.flush()

    probes = [0]

    async def heard() -> bool:  # the server passes the listener's interest on a moment late
        probes[0] += 1
        await nc.publish("now.probe", b"")  # empty: counted in out_msgs, not in out_bytes
        await nc.flush()
        return any(m.subject == "now.probe" for m in got)

    await eventually(heard)
    cases = [
        ("now.a", b"", "", None),
        ("now.b", b"x" * 300, "now.reply.1", None),
        ("now.c", b"{}", "now.reply.2", {"Reach-Deadline": "1733000000000"}),
        ("now.d", b"body", "", {"Reach-Caller": " a\r\nb ", "Reach-Request-Id": "r-1"}),
    ]
    try:
        for subject, payload, reply, headers in cases:
            await nc.publish(subject, payload, reply=reply, headers=headers)
            await nc.flush()
            assert publish(nc, subject, payload, reply, headers, alone=alone)
            assert (nc._pending_data_size == 0) is alone  # written, or held for the flusher
        await eventually(lambda: sum(m.subject != "now.probe" for m in got) == 2 * len(cases))
        seen = [(m.subject, m.data, m.reply, m.headers) for m in got if m.subject != "now.probe"]
        assert seen[0::2] == seen[1::2]
        assert seen[-1][3] == {"Reach-Caller": "a  b", "Reach-Request-Id": "r-1"}
        assert nc.stats["out_msgs"] - probes[0] == 2 * len(cases)
        assert nc.stats["out_bytes"] == 2 * sum(len(case[1]) for case in cases)
    finally:
        await listener.close()


async def test_publish_keeps_order_and_leaves_to_nats_py_what_it_would_refuse(
    reach_settings: ReachSettings, nc: nats.NATS
):
    """A message never overtakes what nats-py holds; what nats-py would check, refuse or
    wait for goes through nats-py's own publish (False: nothing written nor held)."""
    listener = fast(await nats.connect(reach_settings.nats_url))
    got: list[bytes] = []

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        got.append(msg.data)

    await listener.subscribe("order.>", cb=on_msg)
    await listener.flush()
    try:
        await nc.publish("order.a", b"1")  # held for the flusher's next turn
        assert publish(nc, "order.b", b"2", alone=True)  # written with it, after it
        assert nc._pending_data_size == 0
        assert publish(nc, "order.c", b"3")  # held, and nats-py's flusher kicked for it
        assert nc._pending_data_size > 0
        await eventually(lambda: got == [b"1", b"2", b"3"])
        assert nc._pending_data_size == 0
    finally:
        await listener.close()
    held = nc.stats["out_msgs"]
    assert not publish(nc, "bad subject", b"x")
    assert not publish(nc, "order.d", b"x", reply="bad\r\nPUB x 0")
    assert not publish(nc, "order.d", b"x", headers={"baggage": "k=v"})  # not ours
    assert not publish(nc, "order.d", b"x" * (nc.max_payload + 1))
    nc._max_pending_size = 8  # nats-py would flush and wait first
    assert not publish(nc, "order.d", b"x" * 16)
    nc._max_pending_size = 0
    connected = nc._status
    for status in (nc.DRAINING_SUBS, nc.DRAINING_PUBS, nc.RECONNECTING):
        nc._status = status  # nats-py raises, or holds it for the next connection
        assert not publish(nc, "order.d", b"x", alone=True)
    nc._status = connected
    await nc.close()
    assert not publish(nc, "order.d", b"x", alone=True)
    assert nc.stats["out_msgs"] == held
    assert nc._pending_data_size == 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_write_through_leaves_a_closed_socket_to_the_flusher(
    reach_settings: ReachSettings, loop: str
):
    """A socket reset that nats-py has not read yet: nothing is written nor raised, and
    nats-py's flusher keeps what it was woken for (it notices, and reconnects)."""

    async def scenario() -> None:
        nc = fast(await nats.connect(reach_settings.nats_url, allow_reconnect=False))
        try:
            await nc.publish("direct.e", b"lost")  # held for the flusher's next turn
            held = nc._pending_data_size
            nc._transport._io_writer.transport.abort()
            assert nc.is_connected  # nats-py has not noticed yet
            write_through(nc)
            assert (nc._pending_data_size, nc._flush_queue.qsize()) == (held, 1)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        idle = fast(await nats.connect(reach_settings.nats_url, allow_reconnect=False))
        try:
            idle._transport._io_writer.transport.abort()
            # nor is a message written to it: it is held for the flusher, as nats-py would
            assert publish(idle, "direct.e", b"lost", alone=True)
            assert idle._pending_data_size > 0
        finally:
            with contextlib.suppress(Exception):
                await idle.close()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")  # the `fast` extra, which make installs
        uvloop.run(scenario())
    else:
        asyncio.run(scenario())


async def test_requests_during_stop_are_refused_not_left_waiting(
    reach_settings: ReachSettings, reach_client: reach.Client, monkeypatch: pytest.MonkeyPatch
):
    """Refusals leave from tasks owned until the subscriptions are gone: a direct request
    that comes once the agent has closed its workers (and waits for a handler that
    ignores its cancellation) is still told at once that the agent is stopping."""
    # the stop waits this long for the stubborn handler: the window the request comes in
    monkeypatch.setattr("reach._agent.workers._CLOSE_GRACE", 5.0)
    agent = Agent("stubborn", settings=reach_settings, max_concurrency=1, drain_timeout=0.1)
    entered, cut, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    @agent.capability("stub.op")
    async def op(req: dict) -> dict:
        entered.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                cut.set()  # the workers are being closed; the stop waits for this a while
        return {}

    await agent.start()
    first = asyncio.create_task(
        reach_client.request("stub.op", {}, agent_id=agent.agent_id, timeout=30)
    )
    await entered.wait()
    stopping = asyncio.create_task(agent.stop())
    try:
        await asyncio.wait_for(cut.wait(), 30)
        assert agent.state is State.DRAINING
        with pytest.raises(reach.AgentUnavailable, match="is stopping"):
            await reach_client.request("stub.op", {}, agent_id=agent.agent_id, timeout=5)
    finally:
        release.set()
        await stopping
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_refusals_leave_from_one_task_and_a_flood_is_bounded(
    reach_settings: ReachSettings,
):
    """Refusals are made in nats-py's reading task, as fast as requests come: they queue
    for one sending task, and past the queue's bound they are counted, not kept."""
    agent = Agent("flooded", settings=reach_settings, max_queue=4)

    @agent.capability("flood.op")
    async def op(req: dict) -> dict:
        return req

    listener = fast(await nats.connect(reach_settings.nats_url))
    got: list[str] = []

    async def on_reply(msg: nats.aio.msg.Msg) -> None:
        got.append(msg.headers.get("Nats-Service-Error-Code", "") if msg.headers else "")

    await listener.subscribe("flood.replies.*", cb=on_reply)
    await listener.flush()
    try:
        async with agent:
            intake = agent._intake
            bound = 300
            # an entry costs its reply subject and message plus 200 bytes (intake._cost)
            intake._outbox_budget = bound * (len("flood.replies.0000") + len("full") + 200)
            flood = bound + 100
            for i in range(flood):  # one burst, no turn of the loop between
                reply = f"flood.replies.{i:04d}"
                msg = nats.aio.msg.Msg(_client=listener, subject="x", reply=reply)
                intake._refuse(msg, "resource_exhausted", "full")
            assert len(intake.refusals) == 1  # one sender, not a task per refusal
            assert agent.stats.unsent_refusals == 100
            # what waits is where to answer, not the requests (a flood's payloads)
            assert not any(isinstance(part, nats.aio.msg.Msg) for e in intake._outbox for part in e)
            await eventually(lambda: len(got) == bound)
            assert set(got) == {"429"}
    finally:
        await listener.close()


async def test_the_refusal_outbox_is_bounded_in_bytes_not_in_count(
    reach_settings: ReachSettings,
):
    """Refusals waiting for their sender hold their reply subjects: bounded by count only
    (nats-py's 524,288 pending messages), long subjects made that gigabytes. The outbox
    holds 4 MiB at most (each refusal's subject and message, plus 200 bytes), whatever
    the subjects' length; what is queued is all sent, and the room comes back."""
    agent = Agent("flooded", settings=reach_settings, max_queue=4)

    @agent.capability("flood.op")
    async def op(req: dict) -> dict:
        return req

    listener = await nats.connect(reach_settings.nats_url)
    got = 0

    async def on_reply(msg: nats.aio.msg.Msg) -> None:
        nonlocal got
        got += 1

    await listener.subscribe("flood.replies.>", cb=on_reply)
    await listener.flush()
    budget, tail = 4 * 1024 * 1024, "x" * 1980  # a subject may be up to ~4 KB long
    cost = len(f"flood.replies.0000.{tail}") + len("full") + 200
    fits = budget // cost
    try:
        async with agent:
            intake = agent._intake
            for i in range(fits + 500):  # one burst, no turn of the loop between
                reply = f"flood.replies.{i:04d}.{tail}"
                msg = nats.aio.msg.Msg(_client=listener, subject="x", reply=reply)
                intake._refuse(msg, "resource_exhausted", "full")
            assert len(intake._outbox) == fits  # ~1,900 here: bytes, not 524,288 entries
            assert agent.stats.unsent_refusals == 500
            await eventually(lambda: got == fits, timeout=30)
            assert intake._outbox_bytes == 0  # sent: the room is back
            msg = nats.aio.msg.Msg(_client=listener, subject="x", reply="flood.replies.last")
            intake._refuse(msg, "resource_exhausted", "full")
            await eventually(lambda: got == fits + 1, timeout=30)
            assert agent.stats.unsent_refusals == 500
    finally:
        await listener.close()


async def test_a_burst_that_finds_the_agent_full_is_refused_in_full(
    reach_settings: ReachSettings, nc: nats.NATS
):
    """A thousand requests in one read of the socket, to an agent with room for two: each
    of the rest is told at once (resource_exhausted), none left to its timeout."""
    agent = Agent("busy", settings=reach_settings, max_concurrency=1, max_queue=1)
    release = asyncio.Event()

    @agent.capability("burst.op")
    async def op(req: dict) -> dict:
        await release.wait()
        return req

    codes: list[str] = []

    async def on_reply(msg: nats.aio.msg.Msg) -> None:
        codes.append(msg.headers.get("Nats-Service-Error-Code", "") if msg.headers else "ok")

    await nc.subscribe("burst.replies.*", cb=on_reply)
    async with agent:
        subject = agent.subjects.cap("burst.op")
        for i in range(1000):
            await nc.publish(subject, b"{}", reply=f"burst.replies.{i}")
        await nc.flush()
        await eventually(lambda: len(codes) == 998, timeout=30)
        assert set(codes) == {"429"}
        assert agent.stats.unsent_refusals == 0
        release.set()
        await eventually(lambda: len(codes) == 1000, timeout=30)
