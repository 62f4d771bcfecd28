"""Durable topics against a real nats-server: a subscriber that was away misses nothing,
the instances of a name share the messages, every name gets every one, failures come back
and end in the DLQ, from which a replay brings them back to that name alone; history
(``since``) meets live messages without a gap or a duplicate; ``ordered`` keeps order."""

import asyncio
import contextlib
import datetime
import json

import nats
import pytest
from nats.js.api import StreamConfig

from chaos.proxy import Proxy
from reach import (
    Agent,
    Client,
    ConfigurationError,
    NotStored,
    ReachError,
    ReachSettings,
    RequestTimeout,
)
from reach.testing import NatsServer, eventually, unique_prefix

from .test_cli_tasks import reach_cli


@pytest.fixture
def settings(reach_settings):
    return reach_settings.model_copy(
        update={
            "topic_ack_wait": 2.0,
            "topic_retry_base": 0.05,
            "topic_retry_cap": 0.1,
            "topic_max_deliver": 3,
            "topic_lag_interval": 0.2,
            "drain_timeout": 2.0,
        }
    )


def sensor_alarm(settings, seen, name="alarm", *, gate=None, ordered=False, pattern="sensor.>"):
    """An agent whose durable handler records each report's ``n`` (after ``gate``, if
    given, is set)."""
    agent = Agent(name, settings=settings)

    @agent.on_topic(pattern, durable=True, ordered=ordered)
    async def on_report(report: dict) -> None:
        if gate is not None:
            await gate.wait()
        seen.append(report["n"])

    return agent


async def publish_all(client, numbers, topic="sensor.hall"):
    for n in numbers:
        assert await client.publish(topic, {"n": n}, durable=True) > 0


async def test_a_subscriber_cut_off_from_the_server_misses_nothing(settings):
    proxy = await Proxy(settings.nats_url).start()
    try:
        seen: list[int] = []
        agent = sensor_alarm(settings.model_copy(update={"nats_url": proxy.url}), seen)
        async with agent, Client(settings=settings) as client:
            await publish_all(client, range(10))
            await eventually(lambda: set(seen) == set(range(10)))
            proxy.pause()  # a partition: no reset, no EOF; deliveries wait in the proxy
            await publish_all(client, range(10, 30))
            proxy.cut()  # then the connection goes, and what waited with it
            await publish_all(client, range(30, 50))
            proxy.resume()  # it reconnects
            await eventually(lambda: set(seen) == set(range(50)), timeout=30)
            assert proxy.cuts == 1
            # each is acked after its handler returned: the last acks may still be on the way
            await eventually(lambda: agent.topic_cells()["sensor.>"].acked >= 50)
    finally:
        await proxy.close()


async def test_what_is_published_while_every_instance_is_stopped_waits_for_the_next(settings):
    seen: list[int] = []
    async with Client(settings=settings) as client:
        async with sensor_alarm(settings, seen):
            await publish_all(client, range(5))
            await eventually(lambda: sorted(seen) == list(range(5)))
        await publish_all(client, range(5, 15))  # nobody of the name runs now
        async with sensor_alarm(settings, seen):  # a new instance, the same name
            await eventually(lambda: sorted(seen) == list(range(15)))


async def test_a_subscriber_misses_nothing_across_a_server_restart():
    async with NatsServer() as server:
        settings = ReachSettings(
            nats_url=server.url,
            subject_prefix=unique_prefix(),
            topic_ack_wait=2.0,
            task_patience=20.0,
        )
        seen: list[int] = []
        gate = asyncio.Event()
        agent = sensor_alarm(settings, seen, gate=gate)
        async with agent, Client(settings=settings) as client:
            await publish_all(client, range(20))  # held: the handlers wait for the gate
            await eventually(lambda: agent.topic_cells()["sensor.>"].running > 0)
            await server.akill()
            await server.astart()  # same port, same store
            await eventually(lambda: client.connected and agent.client.connected, timeout=30)

            async def stored(n: int) -> bool:
                try:
                    await client.publish("sensor.hall", {"n": n}, durable=True)
                except NotStored:
                    return False  # JetStream still recovering its streams
                return True

            for n in range(20, 30):
                await eventually(lambda n=n: stored(n), timeout=30)
            gate.set()
            await eventually(lambda: set(seen) == set(range(30)), timeout=30)


async def test_the_instances_of_a_name_share_the_messages_each_once(settings):
    a_seen: list[int] = []
    b_seen: list[int] = []
    release = asyncio.Event()  # every handler waits until both instances hold one

    def instance(seen):
        agent = Agent("alarm", settings=settings)

        @agent.on_topic("sensor.>", durable=True)
        async def on_report(report: dict) -> None:
            seen.append(report["n"])
            if a_seen and b_seen:
                release.set()
            await release.wait()

        return agent

    a, b = instance(a_seen), instance(b_seen)
    async with a, b, Client(settings=settings) as client:
        await publish_all(client, range(100))
        await eventually(lambda: len(a_seen) + len(b_seen) >= 100, timeout=30)
        redelivered = sum(x.topic_cells()["sensor.>"].redelivered for x in (a, b))
        assert redelivered == 0  # so each message must have been handled exactly once
        assert a_seen
        assert b_seen
        assert sorted(a_seen + b_seen) == list(range(100))


async def test_two_names_each_get_every_message(settings):
    alarm_seen: list[int] = []
    archive_seen: list[int] = []
    alarm = sensor_alarm(settings, alarm_seen, "alarm")
    archive = sensor_alarm(settings, archive_seen, "archive")
    async with alarm, archive, Client(settings=settings) as client:
        await publish_all(client, range(40))
        await client.publish("sensor.hall", {"n": 40})  # plain: stored too, unacknowledged
        await eventually(lambda: len(alarm_seen) >= 41 and len(archive_seen) >= 41)
        assert sorted(alarm_seen) == list(range(41))
        assert sorted(archive_seen) == list(range(41))


async def test_a_failing_message_comes_back_then_goes_to_the_dlq_then_replays_to_its_name(
    settings,
):
    fixed = asyncio.Event()
    runs: list[int] = []
    archive_seen: list[int] = []
    alarm = Agent("alarm", settings=settings)

    @alarm.on_topic("sensor.>", durable=True)
    async def on_report(report: dict, topic: str) -> None:
        runs.append(report["n"])
        if not fixed.is_set():
            raise RuntimeError(f"cannot read {topic}")

    archive = sensor_alarm(settings, archive_seen, "archive")
    async with alarm, archive, Client(settings=settings) as client:
        await publish_all(client, [7], topic="sensor.door")
        cells = alarm.topic_cells()["sensor.>"]
        await eventually(lambda: cells.dead_lettered == 1, timeout=20)
        assert runs == [7, 7, 7]  # topic_max_deliver runs, with backoff between them
        assert (cells.failed, cells.redelivered, cells.acked) == (3, 2, 0)
        assert archive_seen == [7]  # the other name handled it once

        [letter] = await client.dead_letters(topic="sensor.>")
        assert (letter.kind, letter.topic, letter.group, letter.capability) == (
            "topic",
            "sensor.door",
            "alarm",
            "",
        )
        assert letter.reason == "failed"
        assert "RuntimeError: cannot read sensor.door" in letter.error
        assert json.loads(letter.data) == {"n": 7}
        with pytest.raises(ReachError, match="not a task"):
            letter.submit()

        fixed.set()
        code, out, err = await reach_cli(settings, "dlq", "replay", str(letter.seq))
        assert code == 0, err
        assert "delivered again to agent alarm's subscription" in err
        assert int(out) > 0
        await eventually(lambda: cells.acked == 1)
        assert runs == [7, 7, 7, 7]
        assert await client.dead_letters(topic="sensor.>") == []
        assert archive_seen == [7]  # a replay goes to the name that gave up on it alone
        assert archive.topic_cells()["sensor.>"].delivered == 1


async def test_a_message_whose_instance_went_silent_goes_to_another(settings):
    proxy = await Proxy(settings.nats_url).start()
    try:
        stuck = asyncio.Event()  # never set: the silent instance's handlers hang
        a_seen: list[int] = []
        b_seen: list[int] = []
        # the silent instance's open pull request (up to 5 s) still takes redeliveries:
        # enough deliveries that they reach the live one before the DLQ
        settings = settings.model_copy(update={"topic_max_deliver": 10})
        a_settings = settings.model_copy(update={"nats_url": proxy.url, "drain_timeout": 0.2})
        a = sensor_alarm(a_settings, a_seen, gate=stuck)
        b = sensor_alarm(settings, b_seen)
        async with Client(settings=settings) as client:
            async with a:
                await publish_all(client, range(5))
                await eventually(lambda: a.topic_cells()["sensor.>"].running == 5)
                proxy.pause()  # silent: no in_progress, no ack
                async with b:
                    await eventually(lambda: sorted(b_seen) == list(range(5)), timeout=30)
                    cells = b.topic_cells()["sensor.>"]
                    # each is acked after its handler returned: the last may be on the way
                    await eventually(lambda: cells.acked == 5)
                    assert (cells.redelivered, cells.acked, cells.dead_lettered) == (5, 5, 0)
                    assert a_seen == []
                proxy.resume()
    finally:
        await proxy.close()


async def test_ordered_handles_one_at_a_time_in_order_across_instances(settings):
    log: list[tuple[str, int]] = []
    failed_once: set[int] = set()

    def instance(tag):
        agent = Agent("ledger", settings=settings)

        @agent.on_topic("account.>", durable=True, ordered=True)
        async def on_entry(entry: dict) -> None:
            log.append((tag, entry["n"]))
            if entry["n"] % 7 == 0 and entry["n"] not in failed_once:
                failed_once.add(entry["n"])
                raise RuntimeError("try again")  # comes back before anything after it

        return agent

    async with instance("a"), instance("b"), Client(settings=settings) as client:
        for n in range(30):
            await client.publish(f"account.{n % 2}", {"n": n}, durable=True)
        await eventually(lambda: len(log) >= 30 + 5, timeout=30)
        order = [n for _, n in log]
        # each failed message was retried at once in its place: nothing overtook it
        expected = [m for n in range(30) for m in ([n, n] if n % 7 == 0 else [n])]
        assert order == expected
        assert {tag for tag, _ in log} <= {"a", "b"}


async def test_since_reads_history_then_live_without_gap_or_duplicate(settings):
    async with Client(settings=settings) as client:
        await publish_all(client, range(30), topic="feed.a")

        async def live() -> None:
            await publish_all(client, range(30, 60), topic="feed.b")

        publisher = asyncio.ensure_future(live())  # races the subscription's start
        async with await client.subscribe("feed.>", since=1) as sub:
            got = [await sub.next(timeout=10) for _ in range(60)]
            await publisher
            await publish_all(client, [60], topic="feed.a")
            after = await sub.next(timeout=10)
        assert [m.json()["n"] for m in got] == list(range(60))
        assert [m.seq for m in got] == list(range(1, 61))
        assert after.json() == {"n": 60}  # next after the seam: nothing twice
        assert {m.topic for m in got} == {"feed.a", "feed.b"}
        assert all(m.time is not None for m in got)

        mark = datetime.datetime.now(datetime.UTC)
        await publish_all(client, [61], topic="feed.a")
        async with await client.subscribe("feed.a", since=mark) as sub:
            assert (await sub.next(timeout=10)).json() == {"n": 61}
        async with await client.subscribe("feed.a", since=datetime.timedelta(hours=1)) as sub:
            assert (await sub.next(timeout=10)).json() == {"n": 0}
        with pytest.raises(ConfigurationError, match="sequence starts at 1"):
            await client.subscribe("feed.a", since=0)


async def test_durable_publishes_reach_plain_subscribers_on_every_instance(settings):
    seen: dict[str, list[int]] = {"a": [], "b": []}

    def instance(tag):
        agent = Agent("panel", settings=settings)

        @agent.on_topic("sensor.*")  # plain: every instance gets every message
        async def on_report(report: dict) -> None:
            seen[tag].append(report["n"])

        return agent

    async with instance("a"), instance("b"), Client(settings=settings) as client:
        await client.publish("sensor.hall", {"n": 1}, durable=True)
        await client.publish("sensor.hall", {"n": 2})  # plain: stored too, once the stream is
        await eventually(lambda: seen == {"a": [1, 2], "b": [1, 2]})
        async with await client.subscribe("sensor.hall", since=1) as sub:
            assert [(await sub.next(timeout=10)).json()["n"] for _ in range(2)] == [1, 2]


async def test_not_stored_says_why(settings):
    async with Client(settings=settings) as client:
        with pytest.raises(NotStored, match="does not exist") as caught:
            await client.subscribe("sensor.>", since=1)
        assert caught.value.reason == "no_stream"
        # a stream made by hand for some topics only
        nc = await nats.connect(settings.nats_url)
        try:
            upper = settings.subject_prefix.upper()
            prefix = settings.subject_prefix
            await nc.jetstream().add_stream(
                StreamConfig(name=f"{upper}_TOPICS", subjects=[f"{prefix}.topic.kept.>"])
            )
        finally:
            await nc.close()
        assert await client.publish("kept.one", {"n": 1}, durable=True) == 1
        with pytest.raises(NotStored, match="no stream stores") as caught:
            await client.publish("other.one", {"n": 2}, durable=True)
        assert (caught.value.reason, caught.value.code, caught.value.topic) == (
            "no_stream",
            "not_stored",
            "other.one",
        )


async def test_a_durable_subscription_outside_a_hand_made_stream_is_refused_at_start(settings):
    nc = await nats.connect(settings.nats_url)
    try:
        prefix = settings.subject_prefix
        await nc.jetstream().add_stream(
            StreamConfig(
                name=f"{prefix.upper()}_TOPICS",
                subjects=[f"{prefix}.topic.kept.>", f"{prefix}.topicredo.>"],
            )
        )
    finally:
        await nc.close()
    agent = sensor_alarm(settings, [])  # sensor.> is not kept
    with pytest.raises(ConfigurationError, match=r"does not keep durable topic 'sensor\.>'"):
        await agent.start()
    kept = sensor_alarm(settings, [], pattern="kept.*")
    async with kept:  # inside the stream's subjects: fine
        assert kept.topic_cells()["kept.*"].delivered == 0


async def test_not_stored_without_jetstream():
    async with NatsServer(jetstream=False) as server:
        settings = ReachSettings(nats_url=server.url, task_patience=0.5)
        async with Client(settings=settings) as client:
            with pytest.raises(NotStored, match="JetStream on") as caught:
                await client.publish("sensor.hall", {"n": 1}, durable=True)
            assert caught.value.reason == "jetstream_unavailable"
            assert await client.publish("sensor.hall", {"n": 1}) == 0  # plain still works
            with pytest.raises(NotStored, match="JetStream on") as caught:
                await client.subscribe("sensor.>", since=60)  # history needs it too
            assert caught.value.reason == "jetstream_unavailable"


async def test_lag_is_sampled_and_exported(settings):
    gate = asyncio.Event()
    seen: list[int] = []
    agent = sensor_alarm(settings.model_copy(update={"topic_concurrency": 1}), seen, gate=gate)
    async with agent, Client(settings=settings) as client:
        await publish_all(client, range(20))
        cells = agent.topic_cells()["sensor.>"]
        await eventually(lambda: (cells.lag or 0) >= 15)
        text = agent.telemetry.exposition().decode()
        assert 'reach_agent_topic_lag{agent="alarm",topic="sensor.>"}' in text
        gate.set()
        await eventually(lambda: len(seen) == 20)
        await eventually(lambda: cells.lag == 0 and cells.acked == 20)  # acks follow handlers
        text = agent.telemetry.exposition().decode()
        assert 'reach_agent_topic_acked_total{agent="alarm",topic="sensor.>"} 20.0' in text


async def test_publish_listen_since_and_topics_init_from_the_command_line(settings):
    code, out, err = await reach_cli(settings, "topics", "init", "--json")
    assert code == 0, err
    assert json.loads(out)["streams"][0].endswith("_TOPICS")
    code, out, err = await reach_cli(settings, "publish", "sensor.hall", '{"n": 1}', "--durable")
    assert (code, out.strip()) == (0, "1"), err
    listen = ("listen", "sensor.>", "--since", "1h", "--count", "1")
    code, out, err = await reach_cli(settings, *listen)
    assert code == 0, err
    line = json.loads(out)
    assert (line["topic"], line["data"], line["seq"]) == ("sensor.hall", {"n": 1}, 1)


async def add_stream_by_hand(settings, name, subjects):
    """A stream made outside Reach (an operator's, at deploy time)."""
    nc = await nats.connect(settings.nats_url)
    try:
        await nc.jetstream().add_stream(StreamConfig(name=name, subjects=subjects))
    finally:
        await nc.close()


async def test_since_on_a_topic_a_hand_made_stream_does_not_keep_says_so(settings):
    prefix = settings.subject_prefix
    await add_stream_by_hand(
        settings,
        f"{prefix.upper()}_TOPICS",
        [f"{prefix}.topic.sensor.>", f"{prefix}.topicredo.>"],
    )
    async with Client(settings=settings) as client:
        with pytest.raises(NotStored, match=r"does not keep topic 'order\.x'") as caught:
            await client.subscribe("order.x", since=datetime.timedelta(minutes=10))
        assert caught.value.reason == "no_stream"
        assert f"{prefix}.topic.sensor.>" in caught.value.message  # what it does keep
        await client.publish("sensor.hall", {"n": 1}, durable=True)
        async with await client.subscribe("sensor.*", since=1) as sub:  # kept: fine
            assert (await sub.next(timeout=10)).json() == {"n": 1}
    code, out, err = await reach_cli(settings, "listen", "order.x", "--since", "10m")
    assert (code, out) == (1, ""), err
    [line] = err.splitlines()
    assert line.startswith("error: not_stored: ")
    assert "does not keep topic 'order.x'" in line


async def test_a_stream_that_already_captures_the_topics_is_named_with_the_fix(settings):
    prefix = settings.subject_prefix
    audit = f"{prefix.upper()}_AUDIT"
    await add_stream_by_hand(settings, audit, [f"{prefix}.topic.>"])  # an audit stream
    agent = sensor_alarm(settings, [])
    with pytest.raises(NotStored, match=f"stream {audit} already captures") as caught:
        await agent.start()
    assert (caught.value.reason, caught.value.retryable) == ("overlap", False)
    assert "REACH_SUBJECT_PREFIX" in caught.value.message  # the fix
    async with Client(settings=settings) as client:
        with pytest.raises(NotStored, match=f"stream {audit} already captures") as caught:
            await client.publish("sensor.hall", {"n": 1}, durable=True)
        assert caught.value.reason == "overlap"
    code, out, err = await reach_cli(settings, "topics", "init")
    assert (code, out) == (1, ""), err
    [line] = err.splitlines()
    assert line.startswith(f"error: not_stored: stream {prefix.upper()}_TOPICS cannot be made")
    assert audit in line


async def test_next_keeps_its_timeout_while_skipped_messages_keep_coming(settings):
    """A ``since`` subscription skips what came before its start: a stream of skipped
    messages does not stretch ``next(timeout)``, each arriving before the timeout."""
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    async with Client(settings=settings) as client:
        await client.publish("feed.a", {"n": 0}, durable=True)  # the stream exists
        sub = await client.subscribe("feed.a", since=later)  # every message now is skipped
        arrived = asyncio.Event()

        async def skipped_forever() -> None:
            while True:
                await client.publish("feed.a", {"n": 1}, durable=True)
                arrived.set()

        publisher = asyncio.ensure_future(skipped_forever())
        try:
            await arrived.wait()
            async with sub, asyncio.timeout(20):  # a guard: fails the test, not RequestTimeout
                with pytest.raises(RequestTimeout, match=r"no message within 0\.5s"):
                    await sub.next(timeout=0.5)
        finally:
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher


async def test_next_without_a_timeout_waits_for_a_message(settings):
    async with Client(settings=settings) as client:
        await client.publish("feed.a", {"n": 0}, durable=True)
        async with await client.subscribe("feed.a", since=2) as sub:  # nothing there yet
            waiting = asyncio.ensure_future(sub.next())
            done, _ = await asyncio.wait({waiting}, timeout=0.3)  # not a sync: nothing comes
            assert not done, waiting.exception() if waiting.done() else None
            await client.publish("feed.a", {"n": 1}, durable=True)
            async with asyncio.timeout(20):
                assert (await waiting).json() == {"n": 1}


async def test_a_message_past_max_deliver_is_dead_lettered_by_the_next_instance(settings):
    """sdk/PROTOCOL.md (durable topics, step 1): the server never gives up on a message
    (the consumer's ``max_deliver`` is -1), the agents count: a message delivered
    ``topic_max_deliver`` times to instances that never settled it (here taken and
    put back by hand, as instances that died holding it) is delivered again, and the next
    instance dead-letters it (reason ``max_deliveries``) without running its handler."""
    from reach._topics.store import stream_name, topic_consumer_name

    seen: list[int] = []
    async with Client(settings=settings) as client:
        async with sensor_alarm(settings, seen):
            pass  # its consumer is made: it keeps what is published from now on
        await publish_all(client, [9], topic="sensor.gone")
        js = client.nc.jetstream()
        stream, name = stream_name(client.subjects), topic_consumer_name("alarm", "sensor.>")
        assert (await js.consumer_info(stream, name)).config.max_deliver == -1
        held = await js.pull_subscribe_bind(durable=name, stream=stream)
        for n in range(1, settings.topic_max_deliver + 1):
            (msg,) = await held.fetch(1, timeout=10)
            assert (msg.metadata.num_delivered, msg.data) == (n, b'{"n":9}')
            await msg.nak()  # not settled: delivered again
        await held.unsubscribe()
        async with sensor_alarm(settings, seen) as again:
            cells = again.topic_cells()["sensor.>"]
            await eventually(lambda: cells.dead_lettered == 1, timeout=20)
        assert seen == [], "a message past topic_max_deliver was run"
        [letter] = await client.dead_letters(topic="sensor.>")
        assert (letter.kind, letter.topic) == ("topic", "sensor.gone")
        assert letter.reason == "max_deliveries"
