"""Submitting: what is refused before anything is sent (a payload too big for its record,
attempts JetStream would cut short), batches published in a bounded window, and what a
failed submit tells the caller to do."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from reach import Client, ConfigurationError, ConnectionFailed, ReachSettings, TaskRef
from reach._nats import connect_nats
from reach._subjects import Subjects
from reach._tasks import Tasks
from reach._tasks.store import Conflict, TaskStore
from reach.testing import NatsServer, unique_prefix

CAP = "size.op"
BATCH_WINDOW = 256  # publishes of one submit_batch in flight at once, at most
RECORD_OVERHEAD = 4096


async def stream_messages(client: Client, settings: ReachSettings) -> int:
    stream = settings.subject_prefix.upper() + "_TASKS"
    return (await client.nc.jetstream().stream_info(stream)).state.messages


async def test_a_payload_too_big_for_its_record_is_refused_with_the_limit(
    reach_client: Client, reach_settings: ReachSettings
):
    max_payload = reach_client.nc.max_payload
    limit = (max_payload // 2 - RECORD_OVERHEAD) // 4 * 3  # raw bytes whose base64 fits
    await reach_client.submit(CAP, b"x" * limit)  # the largest that fits is taken
    with pytest.raises(ConfigurationError, match=f"at most {limit} bytes") as info:
        await reach_client.submit(CAP, b"x" * (limit + 3))
    assert str(max_payload) in str(info.value)
    assert await stream_messages(reach_client, reach_settings) == 1  # only the first

    batch = await reach_client.submit_batch(CAP, [b"small", b"x" * 900_000])
    assert isinstance(batch.items[0], TaskRef)
    assert isinstance(batch.items[1], ConfigurationError)


async def test_more_attempts_than_jetstream_delivers_are_refused(reach_client: Client):
    deliver = reach_client.settings.task_max_deliver
    with pytest.raises(ConfigurationError, match="task_max_deliver") as info:
        await reach_client.submit(CAP, {"n": 1}, max_attempts=deliver)
    assert "max_attempts" in str(info.value)
    await reach_client.submit(CAP, {"n": 1}, max_attempts=deliver - 1)


async def test_a_batch_is_published_in_a_bounded_window(
    reach_client: Client, reach_settings: ReachSettings
):
    """A listener on every subject sees each task message before its ack (the server sends
    the ack after it routed the message): the messages it has seen without an ack bound
    what the client had in flight."""
    watcher = await connect_nats(reach_settings, reach_settings.nats_url, "batch-watch")
    task_prefix = f"{reach_settings.subject_prefix}.task."
    unacked: set[str] = set()
    most = 0

    async def seen(msg: Msg) -> None:
        nonlocal most
        if msg.subject.startswith(task_prefix) and msg.reply:
            unacked.add(msg.reply)
            most = max(most, len(unacked))
        else:
            unacked.discard(msg.subject)

    try:
        await watcher.subscribe(">", cb=seen)
        await watcher.flush()
        await reach_client.submit(CAP, {"n": -1})  # the task side is set up
        batch = await reach_client.submit_batch(CAP, [{"n": i} for i in range(1500)])
        assert all(isinstance(item, TaskRef) for item in batch.items)
        await watcher.flush()
    finally:
        await watcher.close()
    assert 1 <= most <= BATCH_WINDOW


async def test_batch_idempotency_keys_and_what_a_failed_item_says():
    async with NatsServer() as server:
        # a batch waits task_patience for the server to come back before it says so
        settings = ReachSettings(
            nats_url=server.url, subject_prefix=unique_prefix(), task_patience=1.0
        )
        async with Client(settings=settings) as client:
            with pytest.raises(ConfigurationError, match="idempotency_keys"):
                await client.submit_batch(CAP, [1, 2], idempotency_keys=["a"])
            first = await client.submit_batch(CAP, [1, 2], idempotency_keys=["a", "b"])
            again = await client.submit_batch(CAP, [1, 2], idempotency_keys=["a", "b"])
            assert [r.task_id for r in again.refs] == [r.task_id for r in first.refs]

            await server.akill()
            plain = await client.submit_batch(CAP, [3])
            keyed = await client.submit_batch(CAP, [4], idempotency_keys=["c"])
    [no_key], [with_key] = plain.items, keyed.items
    assert isinstance(no_key, ConnectionFailed)
    assert "idempotency_key is safe" not in str(no_key)
    assert "may or may not" in str(no_key)
    assert isinstance(with_key, ConnectionFailed)
    assert "same idempotency_key is safe" in str(with_key)


class KeyThatKeepsExpiring(TaskStore):
    """A store whose idempotency key is always taken when claimed and gone when read: the
    race of a key expiring between the two, every time."""

    async def idem_claim(self, key: str, value: bytes, ttl: float) -> int:
        raise Conflict(key)

    async def idem_get(self, key: str) -> tuple[bytes, int] | None:
        return None


async def test_a_submit_that_never_holds_its_key_does_not_publish(reach_settings: ReachSettings):
    nc = await connect_nats(reach_settings, reach_settings.nats_url, "idem-test")
    try:
        subjects = Subjects(reach_settings.subject_prefix)
        store = KeyThatKeepsExpiring(nc.jetstream(), subjects, reach_settings)
        await store.ensure()
        tasks = Tasks(reach_settings, subjects, "idem-test")
        sub = tasks.spec(
            CAP,
            {"n": 1},
            priority="normal",
            timeout=None,
            max_attempts=None,
            idempotency_key="k-1",
            callback=None,
            required_tags=(),
            version=None,
        )
        with pytest.raises(ConnectionFailed, match="idempotency key"):
            await tasks.claim_and_publish(store, sub)
        info = await nc.jetstream().stream_info(store.stream)
        assert info.state.messages == 0
    finally:
        await nc.close()
