"""What the durable-task API raises: only ``ReachError`` subclasses, whatever nats-py does
underneath (a server gone, a client closed, a request cut short)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import nats.errors
import pytest
from nats.aio.msg import Msg

import reach
from reach import Client, ConnectionFailed, NotStarted, ReachError, ReachSettings
from reach._jsapi import JsApi
from reach._nats import connect_nats
from reach.testing import NatsServer, eventually, unique_prefix

CAP = "err.op"


async def test_closing_the_api_fails_a_request_in_flight_cleanly(reach_settings: ReachSettings):
    """A request waiting for its answer when ``close()`` runs fails with the connection
    error, not a KeyError from the bookkeeping."""
    nc = await connect_nats(reach_settings, reach_settings.nats_url, "jsapi-test")
    arrived = asyncio.Event()

    async def silent(msg: Msg) -> None:
        arrived.set()  # never answers

    subject = f"{reach_settings.subject_prefix}.silent"
    await nc.subscribe(subject, cb=silent)
    await nc.flush()
    api = JsApi(nc, timeout=30.0)
    await api.open()
    try:
        pending = asyncio.ensure_future(api.request(subject, b""))
        async with asyncio.timeout(10):
            await arrived.wait()
        await api.close()
        with pytest.raises(nats.errors.ConnectionClosedError):
            await pending
    finally:
        await nc.close()


async def test_a_task_handle_used_after_its_client_closed_says_so(reach_settings: ReachSettings):
    async with Client(settings=reach_settings) as client:
        ref = await client.submit(CAP, {"n": 1})
        batch = await client.submit_batch(CAP, [{"n": 2}])
    for call in (ref.status(), ref.wait(timeout=5), ref.result(timeout=5), ref.cancel()):
        with pytest.raises(NotStarted, match="client closed"):
            await call
    with pytest.raises(NotStarted, match="client closed"):
        async for _ in ref.watch():
            pass
    [out] = await batch.results(timeout=5)
    assert isinstance(out, NotStarted)
    assert "client closed" in str(out)


async def test_a_waiter_following_a_watch_wakes_when_the_client_closes(
    reach_settings: ReachSettings,
):
    """``client.task(id).wait()`` follows the record's KV watch; closing the client ends it
    with NotStarted instead of leaving it on a watch that will never speak again."""
    async with Client(settings=reach_settings) as submitter:
        ref = await submitter.submit(CAP, {"n": 1})
    other = Client(settings=reach_settings)
    await other.connect()
    theirs = await other.task(ref.task_id)
    waiting = asyncio.ensure_future(theirs.wait())
    kv_stream = f"KV_{reach_settings.subject_prefix}_tasks"

    async def watching() -> bool:
        info = await other.nc.jetstream().stream_info(kv_stream)
        return info.state.consumer_count > 0

    await eventually(watching)
    assert not waiting.done()
    await other.close()
    with pytest.raises(NotStarted, match="client closed"):
        async with asyncio.timeout(30):  # a watch being set up may wait out its 5 s request
            await waiting


async def test_every_task_method_raises_connection_failed_while_the_server_is_away():
    async with NatsServer() as server:
        # a submit waits task_patience for the server to come back before it says so
        settings = ReachSettings(
            nats_url=server.url, subject_prefix=unique_prefix(), task_patience=1.0
        )
        async with Client(settings=settings) as client:
            ref = await client.submit(CAP, {"n": 1})
            await server.akill()

            async def watch_one() -> Any:
                async for rec in ref.watch():
                    return rec
                return None

            calls: dict[str, Awaitable[Any]] = {
                "status": ref.status(),
                "cancel": ref.cancel(),
                "watch": watch_one(),
                "task": client.task(ref.task_id),
                "task_record": client.task_record(ref.task_id),
                "list_tasks": client.list_tasks(),
                "list_tasks_running": client.list_tasks(state="running"),
                "dead_letters": client.dead_letters(),
                "dead_letter": client.dead_letter(1),
                "replay": client.replay(1),
                "replay_capability": client.replay_capability(CAP),
                "submit": client.submit(CAP, {"n": 2}),
            }
            outs = await asyncio.gather(*calls.values(), return_exceptions=True)
    wrong = {
        name: f"{type(out).__name__}: {out}"
        for name, out in zip(calls, outs, strict=True)
        if not isinstance(out, ConnectionFailed)
    }
    assert wrong == {}


async def test_dead_letter_errors_are_public(reach_client: Client):
    with pytest.raises(reach.DeadLetterNotFound) as info:
        await reach_client.dead_letter(12345)
    assert isinstance(info.value, LookupError)
    assert info.value.seq == 12345
    assert issubclass(reach.NotReplayable, reach.ConfigurationError)
    assert issubclass(reach.DeadLetterNotFound, ReachError)


async def test_a_client_closes_quietly_with_sends_buffered_while_the_server_is_away():
    async with NatsServer() as server:
        settings = ReachSettings(
            nats_url=server.url, subject_prefix=unique_prefix(), task_patience=1.0
        )
        client = Client(settings=settings)
        await client.connect()
        await client.submit(CAP, {"n": 1})
        await server.akill()
        await eventually(lambda: not client.connected)
        batch = await client.submit_batch(CAP, [{"n": 2}])  # buffered, then timed out
        assert isinstance(batch.items[0], ConnectionFailed)
        await client.close()
        with pytest.raises(NotStarted):
            client.nc  # noqa: B018
