"""Streaming replies (``Client.stream``, an async-generator capability): order, flow
control with a reader that stops, cancellation reaching the handler (a cancel message, a
caller gone silent), errors mid-stream, failover before the first chunk and none after,
and a plain nats-py caller that follows PROTOCOL.md 3.3 alone."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats
import pytest

from chaos.proxy import Proxy
from reach import (
    Agent,
    AgentUnavailable,
    BadRequest,
    Cancelled,
    Client,
    ConfigurationError,
    Context,
    HandlerFailed,
    NotStarted,
    Registry,
    RemoteError,
    RequestTimeout,
    ResourceExhausted,
    Status,
    StreamBroken,
    Telemetry,
)
from reach.testing import eventually
from tests.integration.registry_wire import fast_settings
from tests.integration.test_cli_tasks import reach_cli
from tests.integration.test_registry import wait_status
from tests.integration.test_telemetry import tracing

CAP = "chat.complete"


class Prompt(msgspec.Struct):
    n: int = 3
    size: int = 0  # bytes of padding per chunk


class Token(msgspec.Struct):
    i: int
    text: str = ""


@dataclass
class Seen:
    """What the handler did, for the tests to look at."""

    produced: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    how: str = ""  # how the handler ended: "done", "cancelled", "closed" (at yield)
    ended_at: float = 0.0
    remaining: list[float | None] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # chat.gated waits on it


def llm(settings, agent_id: str = "llm-1", seen: Seen | None = None, **kw: Any) -> Agent:
    """``chat.complete`` yields ``n`` tokens; ``chat.slow`` one token, then waits forever;
    ``chat.hung`` waits forever before its first token; ``chat.gated`` ``n`` tokens once
    ``seen.gate`` is set;
    ``chat.broken`` two tokens, then fails; ``chat.refusing`` refuses before any token
    (retryable); ``chat.plain`` is not a stream at all."""
    seen = seen if seen is not None else Seen()
    agent = Agent("llm", agent_id, settings=settings, drain_timeout=0.5, **kw)

    @agent.capability(CAP)
    async def complete(req: Prompt, ctx: Context) -> AsyncIterator[Token]:
        seen.started.set()
        how = "done"
        try:
            for i in range(req.n):
                seen.produced += 1
                seen.remaining.append(ctx.remaining())
                yield Token(i=i, text="x" * req.size)
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except GeneratorExit:
            how = "closed"
            raise
        finally:
            seen.how, seen.ended_at = how, time.monotonic()
            seen.ended.set()

    @agent.capability("chat.slow")
    async def slow(req: Prompt) -> AsyncIterator[Token]:
        seen.started.set()
        try:
            yield Token(i=0)
            await asyncio.Event().wait()
            yield Token(i=1)
        except asyncio.CancelledError:
            seen.how = "cancelled"
            seen.ended_at = time.monotonic()
            seen.ended.set()
            raise

    @agent.capability("chat.hung")
    async def hung(req: Prompt) -> AsyncIterator[Token]:
        seen.started.set()
        try:
            await asyncio.Event().wait()  # an upstream that never answers
            yield Token(i=0)
        except asyncio.CancelledError:
            seen.how = "cancelled"
            seen.ended.set()
            raise

    @agent.capability("chat.gated")
    async def gated(req: Prompt) -> AsyncIterator[Token]:
        seen.started.set()
        await seen.gate.wait()
        for i in range(req.n):
            yield Token(i=i)

    @agent.capability("chat.broken")
    async def broken(req: Prompt) -> AsyncIterator[Token]:
        yield Token(i=0)
        yield Token(i=1)
        raise RuntimeError("the model fell over")

    @agent.capability("chat.refusing")
    async def refusing(req: Prompt) -> AsyncIterator[Token]:
        seen.produced += 1
        raise ResourceExhausted("no GPU free here")
        yield Token(i=0)  # pragma: no cover - a generator all the same

    @agent.capability("chat.plain")
    async def plain(req: Prompt) -> dict[str, int]:
        return {"n": req.n}

    return agent


@pytest.fixture
def settings(nats_server):
    return fast_settings(nats_server.url)


async def test_chunks_arrive_in_order_then_the_end(settings):
    async with llm(settings) as agent, Client(settings=settings) as client:
        stream = client.stream(CAP, Prompt(n=500), response_type=Token, window=8)
        tokens = [t.i async for t in stream]
        assert tokens == list(range(500))
        assert (stream.chunks, stream.agent_id) == (500, "llm-1")
        assert stream.request_id
        # a capability that does not stream gives its answer as the one chunk
        assert [c async for c in client.stream("chat.plain", {"n": 4})] == [{"n": 4}]
        plain = client.stream("chat.plain", {"n": 5})
        assert await anext(plain) == {"n": 5}
        await plain.aclose()  # nothing to cancel: nothing goes to its direct subject
        await client.request("chat.plain", {"n": 6})  # after anything sent before it
        assert agent.stats.invalid == 0
        # an empty stream ends at once
        assert [c async for c in client.stream(CAP, Prompt(n=0))] == []
        # a direct call: that instance only, never substituted
        direct = client.stream(CAP, Prompt(n=2), agent_id="llm-1", response_type=Token)
        assert [t.i async for t in direct] == [0, 1]
        with pytest.raises(AgentUnavailable):
            await anext(client.stream(CAP, Prompt(n=2), agent_id="llm-9"))
        sizes = client.footprint()
        assert (sizes["pending"], sizes["streams"]) == (0, 0)
        assert not client._streams.open


async def test_the_handler_sees_the_total_deadline_in_ctx_remaining(settings):
    seen = Seen()
    async with llm(settings, seen=seen), Client(settings=settings) as client:
        async for _ in client.stream(CAP, Prompt(n=3), total_timeout=30.0):
            pass
        async for _ in client.stream(CAP, Prompt(n=1)):
            pass
    first, *_, last = seen.remaining
    assert first is not None
    assert 25.0 < first <= 30.0
    assert last is None  # no total timeout: no deadline


async def test_a_plain_request_to_a_streaming_capability_is_refused(settings):
    async with llm(settings), Client(settings=settings) as client:
        with pytest.raises(BadRequest, match=r"call it with client\.stream.*reach call --stream"):
            await client.request(CAP, Prompt(n=1))


async def test_a_reader_that_stops_keeps_the_agent_within_the_window(settings):
    """The handler's ``yield`` waits while the caller has ``window`` chunks unread: with a
    reader that stopped after 5 chunks, the handler produced 5 + window and no more, even
    while the caller's keepalives go on, and the caller holds at most ``window`` frames."""
    seen = Seen()
    window = 8
    async with llm(settings, seen=seen) as agent, Client(settings=settings) as client:
        stream = client.stream(CAP, Prompt(n=10_000, size=4096), response_type=Token, window=window)
        read = [(await anext(stream)).i for _ in range(5)]
        assert read == [0, 1, 2, 3, 4]
        # what was read is granted back (at once, or by the next keepalive)
        await eventually(lambda: seen.produced == 5 + window and agent.stats.stream_waits >= 1)
        heard = agent.stats.stream_credits
        await eventually(lambda: agent.stats.stream_credits >= heard + 5)  # ~1 s of keepalives
        assert seen.produced == 5 + window  # nothing more while nobody reads
        assert stream._flow is not None
        assert len(stream._flow.frames) <= window
        assert not seen.ended.is_set()
        # reading on, the stream goes on where it stopped
        assert (await anext(stream)).i == 5
        await stream.aclose()
        await eventually(seen.ended.is_set)
    assert seen.how == "closed"  # it waited at its yield


@pytest.mark.parametrize("how", ["break", "cancel", "aclose"])
async def test_a_caller_that_leaves_has_the_handler_cancelled_by_its_cancel(settings, how):
    seen = Seen()
    first = asyncio.Event()
    async with llm(settings, seen=seen) as agent, Client(settings=settings) as client:

        async def read() -> None:
            async for _ in client.stream("chat.slow", Prompt()):
                if how == "break":
                    break
                first.set()
                await asyncio.Event().wait()  # read one chunk, then dwell on it

        if how == "aclose":
            stream = client.stream("chat.slow", Prompt())
            assert (await anext(stream)) == {"i": 0, "text": ""}
            await stream.aclose()
        else:
            reader = asyncio.create_task(read())
            if how == "cancel":
                await first.wait()
                reader.cancel()
            if how == "cancel":
                with pytest.raises(asyncio.CancelledError):
                    await reader
            else:
                await reader
        await eventually(seen.ended.is_set)
        # by its cancel, not by its silence (patience: 5 s, keepalives go on meanwhile)
        assert (agent.stats.streams_cancelled, agent.stats.streams_silent) == (1, 0)
    assert seen.how == "cancelled"


async def test_a_caller_gone_silent_has_the_handler_cancelled(settings):
    """A caller cut off from NATS (a partition: no cancel can leave it) stops sending
    keepalives; the agent cancels the handler after the caller's patience, and says so
    on the stream: the caller, heard again, gets StreamBroken(silent)."""
    seen = Seen()
    proxy = await Proxy(settings.nats_url).start()
    try:
        async with (
            llm(settings, seen=seen) as agent,
            Client(proxy.url, settings=settings) as client,
        ):
            stream = client.stream("chat.slow", Prompt(), timeout=30, patience=0.5)
            assert (await anext(stream))["i"] == 0
            heard = agent.stats.stream_credits
            await eventually(lambda: agent.stats.stream_credits >= heard + 3)  # alive
            assert not seen.ended.is_set()
            proxy.pause()
            await eventually(seen.ended.is_set)
            assert (agent.stats.streams_silent, agent.stats.streams_cancelled) == (1, 0)
            proxy.resume()
            with pytest.raises(StreamBroken) as info:
                await anext(stream)
    finally:
        await proxy.close()
    assert seen.how == "cancelled"
    assert (type(info.value), info.value.reason, info.value.chunks) == (StreamBroken, "silent", 1)
    assert isinstance(info.value.__cause__, Cancelled)


async def test_a_handler_hung_before_its_first_chunk_is_stopped_when_the_caller_gives_up(
    settings,
):
    """The agent's opened frame (chunk 0) names the stream's subject before the handler
    runs: a caller that gives up waiting for the first chunk tells the agent to stop it."""
    seen = Seen()
    async with llm(settings, seen=seen) as agent, Client(settings=settings) as client:
        with pytest.raises(RequestTimeout):
            await anext(client.stream("chat.hung", Prompt(), timeout=0.5))
        await eventually(seen.ended.is_set)
        assert (agent.stats.streams_cancelled, agent.stats.streams_silent) == (1, 0)
        assert not client._streams.open
        assert client.footprint()["streams"] == 0
    assert seen.how == "cancelled"


async def test_a_caller_gone_silent_before_the_first_chunk_has_the_handler_cancelled(settings):
    """Keepalives start at the opened frame: a caller cut off while the handler has not
    yielded yet is heard no more, and the agent stops the handler."""
    seen = Seen()
    proxy = await Proxy(settings.nats_url).start()
    try:
        async with (
            llm(settings, seen=seen) as agent,
            Client(proxy.url, settings=settings) as client,
        ):
            hung = client.stream("chat.hung", Prompt(), timeout=60, patience=1.0)
            reader = asyncio.create_task(anext(hung))
            await seen.started.wait()
            await eventually(lambda: agent.stats.stream_credits >= 2)  # keepalives come
            proxy.pause()
            await eventually(seen.ended.is_set)
            assert (agent.stats.streams_silent, agent.stats.streams_cancelled) == (1, 0)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
    finally:
        await proxy.close()
    assert seen.how == "cancelled"


async def test_an_error_mid_stream_comes_after_the_chunks_before_it(settings):
    async with llm(settings), Client(settings=settings) as client:
        stream = client.stream("chat.broken", Prompt())
        got = [(await anext(stream))["i"] for _ in range(2)]
        with pytest.raises(HandlerFailed, match=r"handler failed \(request id .*\) \(after 2"):
            await anext(stream)
        assert got == [0, 1]
        # an error before any chunk is an error of the request itself
        with pytest.raises(BadRequest, match="invalid payload"):
            await anext(client.stream(CAP, {"n": "three"}))


async def test_an_application_error_mid_stream_keeps_its_code(settings):
    class OutOfTokens(RemoteError):
        code = "out_of_tokens"
        status = 429

    agent = Agent("quota", settings=settings)

    @agent.capability("chat.quota")
    async def quota(req: Any) -> AsyncIterator[str]:
        yield "a"
        raise OutOfTokens("the tenant's budget is spent")

    async with agent, Client(settings=settings) as client:
        stream = client.stream("chat.quota")
        got = await anext(stream)
        with pytest.raises(HandlerFailed) as info:
            await anext(stream)
    assert got == "a"
    assert info.value.code == "out_of_tokens"
    assert "the tenant's budget is spent" in info.value.message


async def test_the_total_timeout_ends_a_stream_with_a_timeout(settings):
    async with llm(settings), Client(settings=settings) as client:
        stream = client.stream("chat.slow", Prompt(), timeout=30, total_timeout=0.5)
        assert (await anext(stream))["i"] == 0
        with pytest.raises(RequestTimeout, match="1 chunk received"):
            await anext(stream)


async def test_failover_before_the_first_chunk(settings):
    """An instance that refuses before its first chunk (resource_exhausted) is failed over
    to another, as a request would be; the caller sees only the other's chunks."""
    refused, served = Seen(), Seen()
    telemetry = Telemetry()
    busy = llm(settings, "busy-1", seen=refused)
    free = Agent("llm", "free-1", settings=settings)

    @free.capability("chat.refusing")
    async def fine(req: Prompt) -> AsyncIterator[str]:
        served.produced += 1
        yield "from free-1"

    async with (
        Registry(settings=settings),
        busy,
        free,
        Client(settings=settings, telemetry=telemetry) as client,
    ):
        await wait_status(client, "busy-1", Status.UP)
        await wait_status(client, "free-1", Status.UP)
        for _ in range(50):  # until the router has tried busy-1 first once
            stream = client.stream("chat.refusing", Prompt())
            assert [c async for c in stream] == ["from free-1"]
            assert stream.agent_id == "free-1"
            if refused.produced:
                break
        failovers = telemetry.registry.get_sample_value(
            "reach_client_failovers_total", {"capability": "chat.refusing"}
        )
    assert refused.produced >= 1
    assert failovers is not None
    assert failovers >= 1


@pytest.mark.parametrize("how", ["silence", "agent_stops"])
async def test_no_failover_after_the_first_chunk(settings, how):
    """A started stream that breaks raises StreamBroken naming the chunks received; the
    other instance is never asked."""
    seen = {"a-1": Seen(), "b-1": Seen()}
    agents = {agent_id: llm(settings, agent_id, seen=s) for agent_id, s in seen.items()}
    async with Registry(settings=settings), Client(settings=settings) as client:
        async with agents["a-1"], agents["b-1"]:
            for agent_id in agents:
                await wait_status(client, agent_id, Status.UP)
            stream = client.stream("chat.slow", Prompt(), timeout=0.5 if how == "silence" else 30)
            assert (await anext(stream))["i"] == 0
            owner = stream.agent_id
            other = "b-1" if owner == "a-1" else "a-1"
            stopping = asyncio.create_task(agents[owner].stop()) if how == "agent_stops" else None
            with pytest.raises(StreamBroken) as info:
                await anext(stream)
            if stopping is not None:
                await stopping
            assert not seen[other].started.is_set()
            await eventually(seen[owner].ended.is_set)  # the handler did not run on
    broken = info.value
    assert broken.chunks == 1
    assert broken.reason == ("timeout" if how == "silence" else "agent_unavailable")
    assert "after 1 chunk received" in broken.message
    assert broken.agent_id == owner


async def test_a_plain_nats_caller_follows_the_protocol(settings):
    """PROTOCOL.md 3.3 with nats-py alone: a request with Reach-Stream-Window, the opened
    frame (Reach-Chunk 0), chunks numbered in Reach-Chunk, credit to the frames' reply-to,
    the end in Reach-End."""
    async with llm(settings):
        nc = await nats.connect(settings.nats_url)
        try:
            inbox = nc.new_inbox()
            frames: asyncio.Queue[Any] = asyncio.Queue()
            sub = await nc.subscribe(inbox, cb=frames.put)
            await nc.flush()
            await nc.publish(
                f"{settings.subject_prefix}.cap.{CAP}",
                json.dumps({"n": 10}).encode(),
                reply=inbox,
                headers={"Reach-Stream-Window": "2"},
            )
            # the opened frame first: chunk 0, no body, the stream's subject as reply-to
            opened = await asyncio.wait_for(frames.get(), 10)
            assert (opened.headers["Reach-Chunk"], opened.data) == ("0", b"")
            assert opened.reply.startswith(f"{settings.subject_prefix}.agent.llm-1.$stream.")
            chunks = []
            while True:
                msg = await asyncio.wait_for(frames.get(), 10)
                assert msg.reply == opened.reply
                if "Reach-Chunk" in msg.headers:
                    assert msg.headers["Reach-Chunk"] == str(len(chunks) + 1)
                    chunks.append(json.loads(msg.data)["i"])
                    credit = {"type": "reach.stream.credit", "credit": 1}
                    await nc.publish(msg.reply, json.dumps(credit).encode())
                    continue
                assert "Nats-Service-Error-Code" not in msg.headers
                assert msg.headers["Reach-End"] == "10"
                break
            assert chunks == list(range(10))
            await sub.unsubscribe()
        finally:
            await nc.close()


async def test_reach_call_stream_prints_each_chunk_as_it_arrives(settings):
    gate = asyncio.Event()
    agent = Agent("teller", settings=settings)

    @agent.capability("story.tell")
    async def tell(req: Any) -> AsyncIterator[str]:
        yield "once"
        await gate.wait()
        yield "upon"
        yield "a time"

    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env |= {"REACH_NATS_URL": settings.nats_url, "REACH_SUBJECT_PREFIX": settings.subject_prefix}
    async with agent, llm(settings):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "reach.cli",
            "call",
            "--stream",
            "-v",
            "story.tell",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            first = await proc.stdout.readline()  # printed while the handler waits
            gate.set()
            rest, err = await proc.communicate()
        code, out, err_b = await reach_cli(settings, "call", "--stream", "chat.broken", "{}")
    assert first == b'"once"\n'
    assert rest.decode().splitlines() == ['"upon"', '"a time"']
    assert proc.returncode == 0, err
    assert "3 chunk(s)" in err.decode()
    # a stream that fails after some chunks: them, then the error, and exit status 1
    assert [json.loads(line)["i"] for line in out.splitlines()] == [0, 1]
    assert (code, err_b.splitlines()[-1].split(":")[:2]) == (1, ["error", " failed"])


async def test_a_traced_stream_is_one_send_span_and_one_process_span(settings):
    provider, exporter, _ = tracing()
    telemetry = Telemetry(tracer_provider=provider)
    async with (
        llm(settings, telemetry=telemetry),
        Client(settings=settings, telemetry=telemetry) as client,
    ):
        assert [t.i async for t in client.stream(CAP, Prompt(n=3), response_type=Token)] == [
            0,
            1,
            2,
        ]
        await eventually(lambda: len(exporter.get_finished_spans()) >= 2)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    send, process = spans[f"send {CAP}"], spans[f"process {CAP}"]
    assert process.parent is not None
    assert process.parent.span_id == send.context.span_id  # the handler's run, in the trace
    assert process.attributes["reach.outcome"] == "ok"


async def test_bad_arguments_are_refused_before_anything_is_sent(settings):
    async with Client(settings=settings) as client:
        for bad in (
            {"window": 0},
            {"window": 1025},
            {"timeout": 0},
            {"total_timeout": -1},
            {"patience": 0.1},
            {"patience": 601},
        ):
            with pytest.raises(ConfigurationError):
                client.stream(CAP, **bad)
        with pytest.raises(ValueError, match="capability"):  # as a request says
            await anext(client.stream("Not A Capability"))


async def test_a_lost_connection_breaks_a_started_stream(settings):
    """Frames sent while the caller reconnects are lost: its started streams end at once
    with StreamBroken (connection_lost), and the handler is stopped."""
    seen = Seen()
    proxy = await Proxy(settings.nats_url).start()
    try:
        async with (
            llm(settings, seen=seen),
            Client(proxy.url, settings=settings) as client,
        ):
            stream = client.stream("chat.slow", Prompt(), timeout=30)
            assert (await anext(stream))["i"] == 0
            proxy.cut()
            with pytest.raises(StreamBroken) as info:
                await anext(stream)
            await eventually(seen.ended.is_set, timeout=10)
    finally:
        await proxy.close()
    assert (info.value.reason, info.value.chunks) == ("connection_lost", 1)
    assert seen.how == "cancelled"


async def test_closing_the_client_ends_a_stream_being_read_at_once(settings):
    """The reader waiting for its next chunk learns the client closed (not the idle
    timeout, later, as a ``timeout``)."""
    seen = Seen()
    async with llm(settings, seen=seen):
        client = await Client(settings=settings).connect()
        stream = client.stream("chat.slow", Prompt(), timeout=30)
        assert (await anext(stream))["i"] == 0
        reader = asyncio.create_task(anext(stream))
        await client.close()
        with pytest.raises(StreamBroken) as info:
            await reader
        await eventually(seen.ended.is_set)
    assert (type(info.value), info.value.reason, info.value.chunks) == (
        StreamBroken,
        "connection_lost",
        1,
    )
    assert "client closed" in info.value.message
    assert seen.how == "cancelled"


async def test_a_reconnect_before_the_first_chunk_breaks_nothing(settings):
    """A stream still waiting for its first chunk has lost nothing in a reconnect: its
    chunks come after it, every one, and the end."""
    seen = Seen()
    proxy = await Proxy(settings.nats_url).start()
    try:
        async with (
            llm(settings, seen=seen) as agent,
            Client(proxy.url, settings=settings) as client,
        ):
            stream = client.stream("chat.gated", Prompt(n=4), timeout=30, window=1)
            reader = asyncio.create_task(anext(stream))
            await seen.started.wait()
            # (the caller speaks once it has the opened frame: a reconnect that lost that
            # frame would leave the agent to stop the handler after its patience)
            await eventually(lambda: agent.stats.stream_credits >= 1)
            reconnects = client._nc.stats["reconnects"]
            proxy.cut()
            await eventually(lambda: client._nc.stats["reconnects"] > reconnects)
            await eventually(lambda: client._nc.is_connected)
            await client._nc.flush()  # its inbox subscription is the server's again
            seen.gate.set()
            first = await reader
            rest = [t async for t in stream]
    finally:
        await proxy.close()
    assert [first["i"], *(t["i"] for t in rest)] == [0, 1, 2, 3]
    assert stream.chunks == 4


async def test_a_reader_whose_loop_blocks_for_a_second_per_chunk_keeps_its_stream(settings):
    """Keepalives come from the client's own task: a reader that dwells (here its loop
    blocked by a synchronous 1 s step per chunk) keeps the stream within the default
    patience, and reads it to the end."""
    seen = Seen()
    agent = llm(settings, seen=seen)
    ready = threading.Event()
    held: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def serve() -> None:  # the agent in a loop of its own, which the reader does not block
        async def main() -> None:
            stop = asyncio.Event()
            held.append((asyncio.get_running_loop(), stop))
            async with agent:
                ready.set()
                await stop.wait()

        asyncio.run(main())

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        await asyncio.to_thread(ready.wait)
        async with Client(settings=settings) as client:
            got = []
            async for token in client.stream(CAP, Prompt(n=3), response_type=Token, window=1):
                time.sleep(1.0)  # noqa: ASYNC251 - the blocking step is what is tested
                got.append(token.i)
    finally:
        for loop, stop in held:
            loop.call_soon_threadsafe(stop.set)
        await asyncio.to_thread(thread.join)
    assert got == [0, 1, 2]
    assert (agent.stats.streams_silent, agent.stats.streams_cancelled) == (0, 0)
    assert seen.how == "done"


async def test_a_stream_opens_once_and_has_one_reader(settings):
    """``async with`` and an ``anext()`` from another task while the request is on its way
    share it (the handler runs once); a second ``anext()`` while one waits is refused."""
    seen = Seen()
    async with llm(settings, seen=seen) as agent, Client(settings=settings) as client:
        stream = client.stream("chat.gated", Prompt(n=2), response_type=Token, timeout=10)
        opening = asyncio.ensure_future(stream.__aenter__())
        await seen.started.wait()  # the request is on its way, held before its first chunk
        reading = asyncio.ensure_future(anext(stream))  # waits for the same first frame
        rival = asyncio.ensure_future(anext(stream))  # runs after ``reading`` began (FIFO)
        with pytest.raises(RuntimeError, match="one reader"):
            await rival
        assert not reading.done()
        seen.gate.set()
        assert await opening is stream
        assert (await reading).i == 0
        assert (await anext(stream)).i == 1
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert (stream.chunks, agent.stats.streams) == (2, 1)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("Reach-Stream-Window", "0"),
        ("Reach-Stream-Window", "abc"),
        ("Reach-Stream-Window", "2000"),
        ("Reach-Stream-Patience", "abc"),
        ("Reach-Stream-Patience", "499"),
        ("Reach-Stream-Patience", "600001"),
    ],
)
async def test_a_bad_stream_header_is_bad_request(settings, header, value):
    """PROTOCOL.md 3.3: a window not in 1..1024 chunks, or a patience not in 500..600000
    ms, is answered ``bad_request`` and the handler never runs."""
    seen = Seen()
    async with llm(settings, seen=seen) as agent:
        nc = await nats.connect(settings.nats_url)
        try:
            headers = {"Reach-Stream-Window": "4", header: value}
            reply = await nc.request(
                f"{settings.subject_prefix}.cap.{CAP}",
                json.dumps({"n": 1}).encode(),
                timeout=10,
                headers=headers,
            )
        finally:
            await nc.close()
        assert reply.headers is not None
        assert reply.headers["Nats-Service-Error-Code"] == "400"
        assert json.loads(reply.data)["code"] == "bad_request"
        assert value in json.loads(reply.data)["message"]
        assert (agent.stats.invalid, agent.stats.streams, seen.produced) == (1, 0, 0)


def rogue(nc: Any, frames: list[tuple[int | None, str | None]]) -> Any:
    """A responder that answers a stream request with ``frames`` at once, whatever its
    credit: (chunk number, None) is a chunk, (None, count) the end."""

    async def answer(msg: Any) -> None:
        control = f"rogue.{msg.reply.rpartition('.')[2]}"
        await nc.publish(msg.reply, b"", reply=control, headers={"Reach-Chunk": "0"})
        for number, end in frames:
            if number is not None:
                body = json.dumps({"i": number}).encode()
                await nc.publish(
                    msg.reply, body, reply=control, headers={"Reach-Chunk": str(number)}
                )
            else:
                await nc.publish(msg.reply, b"", reply=control, headers={"Reach-End": str(end)})
        await nc.flush()

    return answer


@pytest.mark.parametrize(
    ("frames", "reason", "read"),
    [
        ([(1, None), (3, None)], "lost", 1),  # chunk 2 never came
        ([(1, None), (None, "2")], "lost", 1),  # the end counts a chunk that never came
        ([(i, None) for i in range(1, 12)], "overrun", 0),  # 11 chunks, 2 granted
    ],
)
async def test_an_agent_that_breaks_the_protocol_breaks_the_stream(settings, frames, reason, read):
    """StreamBroken ``lost`` for a missing chunk, ``overrun`` for chunks past the window."""
    nc = await nats.connect(settings.nats_url)
    try:
        await nc.subscribe(f"{settings.subject_prefix}.cap.chat.rogue", cb=rogue(nc, frames))
        await nc.flush()
        async with Client(settings=settings) as client:
            stream = client.stream("chat.rogue", window=2, timeout=10)
            async with stream:
                flow = stream._flow
                assert flow is not None
                if reason == "overrun":  # every frame delivered before the reader reads
                    await eventually(lambda: flow.error is not None)
                got = [(await anext(stream))["i"] for _ in range(read)]
                with pytest.raises(StreamBroken) as info:
                    await anext(stream)
            assert got == list(range(1, read + 1))
            assert (info.value.reason, info.value.chunks) == (reason, read)
    finally:
        await nc.close()


async def test_a_chunk_larger_than_max_payload_fails_the_stream(settings):
    """The agent checks a chunk against the server's max_payload before it sends it: the
    stream ends with ``failed`` after the chunks before it (none lost, none hanging)."""
    agent = Agent("big", settings=settings)

    @agent.capability("chat.big")
    async def big(req: dict[str, int]) -> AsyncIterator[str]:
        yield "small"
        yield "x" * req["size"]
        yield "never"

    async with agent, Client(settings=settings) as client:
        size = client.nc.max_payload + 1
        async with client.stream("chat.big", {"size": size}, timeout=10) as stream:
            assert await anext(stream) == "small"
            with pytest.raises(HandlerFailed, match="after 1 chunk received") as info:
                await anext(stream)
        assert info.value.code == "failed"
        assert agent.stats.failed == 1


@pytest.mark.parametrize("after", ["swallows", "yields"])
async def test_a_handler_that_ignores_its_callers_cancel_keeps_no_worker(settings, caplog, after):
    """Nothing a handler does takes a worker away (ARCHITECTURE), a stream's no more than a
    request's. One that swallows the cancel its caller's leaving brought is abandoned after
    the grace a handler past its deadline gets: counted stuck, logged, its worker replaced,
    so an agent of one worker serves on. One that yields again after it is stopped at that
    yield (the agent does not wait for credit a cancelled stream never gets)."""
    ignored, release = asyncio.Event(), asyncio.Event()
    how: list[str] = []
    agent = Agent("llm", "llm-1", settings=settings, max_concurrency=1, drain_timeout=0.5)

    @agent.capability("chat.stubborn")
    async def stubborn(req: Prompt) -> AsyncIterator[Token]:
        yield Token(i=0)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ignored.set()
        if after == "swallows":
            await release.wait()
            return
        try:
            for i in range(1, 10_000):
                yield Token(i=i)
        except GeneratorExit:
            how.append("closed")
            raise

    @agent.capability("chat.echo")
    async def echo(req: Prompt) -> dict[str, int]:
        return {"n": req.n}

    try:
        async with agent, Client(settings=settings) as client:
            async with client.stream("chat.stubborn", Prompt(), timeout=30) as stream:
                async for _ in stream:
                    break
            await ignored.wait()
            # its one worker held by the stubborn handler, the agent answers only once the
            # handler is abandoned (or stopped at its yield)
            answer = await client.request("chat.echo", Prompt(n=7), agent_id="llm-1", timeout=10)
            assert answer == {"n": 7}
            assert agent.stats.streams_cancelled == 1
            if after == "swallows":
                assert (agent.stats.abandoned, agent.stats.stuck) == (1, 1)
                assert any("ignores" in r.getMessage() for r in caplog.records)
                release.set()
                await eventually(lambda: agent.stats.stuck == 0)
            else:
                assert (agent.stats.abandoned, agent.stats.stuck) == (0, 0)
                assert how == ["closed"]
            assert agent.stats.failed == 0  # a stream its caller stopped is no failure
            assert await client.request("chat.echo", Prompt(n=8), timeout=10) == {"n": 8}
    finally:
        release.set()


async def test_a_stream_from_a_client_not_connected_is_not_started(settings):
    """As a request: ``NotStarted``, and nothing left behind (no open stream, no loop)."""
    for closed in (False, True):
        client = Client(settings=settings)
        if closed:
            await client.connect()
            await client.close()
        with pytest.raises(NotStarted, match="not connected"):
            await anext(client.stream(CAP, Prompt()))
        with pytest.raises(NotStarted, match="not connected"):
            async with client.stream(CAP, Prompt(), agent_id="llm-1"):
                pass  # pragma: no cover - never entered
        assert not client._streams.open
        assert not len(client._streams._owner)


async def test_a_stream_dropped_in_another_thread_is_cancelled_on_its_loop(settings):
    """The garbage collector may drop a stream in any thread: its cancel is handed to its
    own loop (asyncio is not thread-safe: in debug mode a cross-thread wake-up raised and
    the keepalive loop hung, so the agent took the caller for silent). The client runs on
    a loop of its own, in debug mode, so a hung loop cannot hang the test."""
    seen = Seen()

    async def read_then_drop() -> list[Any]:
        async with Client(settings=settings) as client:
            stream = client.stream("chat.slow", Prompt(), timeout=30)
            assert (await anext(stream))["i"] == 0
            box = [stream]
            del stream
            thread = threading.Thread(target=box.clear)  # the last reference goes there
            thread.start()
            await asyncio.to_thread(thread.join)
            await eventually(lambda: not client._streams.open)
            keeper = client._streams._keeper
            assert keeper is not None
            assert not keeper.done()  # the keepalive loop goes on
            return [c async for c in client.stream("chat.plain", Prompt(n=2))]

    def on_its_own_loop() -> list[Any]:
        loop = asyncio.new_event_loop()
        loop.set_debug(True)
        try:
            return loop.run_until_complete(read_then_drop())
        finally:
            loop.close()

    async with llm(settings, seen=seen) as agent:
        assert await asyncio.to_thread(on_its_own_loop) == [{"n": 2}]
        await eventually(seen.ended.is_set)
        assert (agent.stats.streams_cancelled, agent.stats.streams_silent) == (1, 0)
    assert seen.how == "cancelled"
