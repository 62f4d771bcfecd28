"""The A2A endpoint with the official a2a-sdk client, over HTTP on loopback: cards from the
routing table, request/reply calls, durable tasks followed by GetTask and by streaming,
cancel, unknown tasks, errors, and a v0.3 client on the same endpoint."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import httpx
import pytest
from a2a.client import (
    A2ACardResolver,
    A2AClientError,
    AgentCardResolutionError,
    Client,
    ClientConfig,
    ClientFactory,
)
from a2a.helpers import get_data_parts, get_message_text, new_data_part, new_text_part
from a2a.types import (
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import (
    InternalError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from starlette.exceptions import HTTPException

from reach import ReachSettings
from reach.testing import eventually

from .a2a_fleet import Fleet, a2a_fleet

T = TaskState
#: the most chunks SendMessage gathers into one message (the gateway's MAX_CALL_CHUNKS)
MAX_CHUNKS = 1000


@pytest.fixture
async def fleet(reach_settings: ReachSettings) -> AsyncIterator[Fleet]:
    async with a2a_fleet(reach_settings) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


async def a2a(fleet: Fleet, http: httpx.AsyncClient, name: str, *, streaming: bool) -> Client:
    """The SDK's client for agent ``name``, from its card."""
    card = await A2ACardResolver(http, f"{fleet.url}/a2a/{name}").get_agent_card()
    return ClientFactory(ClientConfig(httpx_client=http, streaming=streaming)).create(card)


def send(parts: list[Part], *, return_immediately: bool = False, **meta: Any) -> SendMessageRequest:
    return SendMessageRequest(
        message=Message(
            role=Role.ROLE_USER, message_id=str(uuid.uuid4()), parts=parts, metadata=meta
        ),
        configuration=SendMessageConfiguration(return_immediately=return_immediately),
    )


async def collect(stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
    async with asyncio.timeout(60):  # a stream that never ends fails the test
        return [item async for item in stream]


def states(events: list[StreamResponse]) -> list[int]:
    out = []
    for ev in events:
        if ev.HasField("task"):
            out.append(ev.task.status.state)
        elif ev.HasField("status_update"):
            out.append(ev.status_update.status.state)
    return out


async def test_cards_list_the_capabilities_as_skills(fleet, http):
    card = await A2ACardResolver(http, f"{fleet.url}/a2a/helper").get_agent_card()
    assert card.name == "helper"
    assert card.version == "2.1.0"
    assert card.description == "Text helpers for the A2A tests"
    assert card.capabilities.streaming
    assert not card.capabilities.push_notifications
    assert {(i.url, i.protocol_version) for i in card.supported_interfaces} == {
        (f"{fleet.url}/a2a/helper", "1.0"),
        (f"{fleet.url}/a2a/helper", "0.3"),
    }
    skills = {s.id: s for s in card.skills}
    assert sorted(skills) == [
        "text.broken",
        "text.count",
        "text.echo",
        "text.hold",
        "text.refuse",
        "text.story",
    ]
    assert "streaming" in skills["text.story"].tags
    assert "streaming" not in skills["text.echo"].tags
    echo = skills["text.echo"]
    assert echo.description == "Repeat the text n times"
    assert list(echo.tags) == ["demo", "text", "mode:call", "version:1.2"]
    assert skills["text.count"].description == "Count the words, as a durable task"
    assert "mode:task" in skills["text.count"].tags

    index = (await http.get(f"{fleet.url}/a2a/")).json()
    assert [c["name"] for c in index["agents"]] == ["helper", "solo"]
    assert [s["id"] for s in index["agents"][1]["skills"]] == ["solo.upper"]

    with pytest.raises(AgentCardResolutionError) as info:
        await A2ACardResolver(http, f"{fleet.url}/a2a/nobody").get_agent_card()
    assert info.value.status_code == 404


@pytest.mark.parametrize("streaming", [False, True])
async def test_a_message_to_a_capability_is_a_call(fleet, http, streaming):
    client = await a2a(fleet, http, "helper", streaming=streaming)
    # a data part is the payload; its 3 crosses A2A as 3.0 and reaches the handler as an int
    events = await collect(
        client.send_message(send([new_data_part({"text": "ab", "n": 3})], capability="text.echo"))
    )
    assert len(events) == 1
    assert events[0].HasField("message")
    reply = events[0].message
    assert reply.role == Role.ROLE_AGENT
    assert get_data_parts(reply.parts) == [{"echo": "ababab"}]
    assert reply.metadata["reach"]["capability"] == "text.echo"
    assert reply.metadata["reach"]["agent_id"].startswith("helper-")

    # one skill: no need to name it; text parts are {"text": ...}; a string result is text
    solo = await a2a(fleet, http, "solo", streaming=streaming)
    events = await collect(solo.send_message(send([new_text_part("hello")])))
    assert get_message_text(events[0].message) == "HELLO"


async def test_a_durable_task_runs_to_completion_and_get_task_reads_it(fleet, http):
    client = await a2a(fleet, http, "helper", streaming=False)
    [event] = await collect(
        client.send_message(send([new_text_part("one two three")], capability="text.count"))
    )
    task = event.task
    assert task.status.state == T.TASK_STATE_COMPLETED  # a blocking send waits for the end
    assert get_data_parts(task.artifacts[0].parts) == [{"words": 3}]
    assert task.context_id == task.id
    assert task.metadata["reach"]["state"] == "SUCCEEDED"
    # the A2A task id is the Reach task id
    assert (await fleet.client.task_record(task.id)).capability == "text.count"

    got = await client.get_task(GetTaskRequest(id=task.id))
    assert got.status.state == T.TASK_STATE_COMPLETED
    assert get_data_parts(got.history[0].parts) == [{"text": "one two three"}]
    assert get_data_parts(got.artifacts[0].parts) == [{"words": 3}]

    # return_immediately: the task as it is now (held before it ends), then GetTask
    fleet.hold.counting.clear()
    [event] = await collect(
        client.send_message(
            send([new_text_part("a b")], capability="text.count", return_immediately=True)
        )
    )
    assert event.task.status.state in (T.TASK_STATE_SUBMITTED, T.TASK_STATE_WORKING)
    fleet.hold.counting.set()
    await (await fleet.client.task(event.task.id)).wait(30)  # its end, as Reach sees it
    got = await client.get_task(GetTaskRequest(id=event.task.id))
    assert got.status.state == T.TASK_STATE_COMPLETED
    assert get_data_parts(got.artifacts[0].parts) == [{"words": 2}]

    # ListTasks: this agent name's tasks, newest first
    listed = await client.list_tasks(ListTasksRequest())
    assert [t.id for t in listed.tasks] == [event.task.id, task.id]
    done = await client.list_tasks(
        ListTasksRequest(status=T.TASK_STATE_COMPLETED, page_size=1, include_artifacts=True)
    )
    assert [t.id for t in done.tasks] == [event.task.id]
    assert get_data_parts(done.tasks[0].artifacts[0].parts) == [{"words": 2}]
    assert not (await client.list_tasks(ListTasksRequest(status=T.TASK_STATE_FAILED))).tasks


async def test_a_streaming_capability_sends_its_chunks_as_artifact_updates_as_they_come(
    fleet, http
):
    """SendStreamingMessage on a streaming skill: the task (working), an artifact update
    per chunk while the handler still runs, then completed."""
    client = await a2a(fleet, http, "helper", streaming=True)
    fleet.hold.telling.clear()  # the handler waits after its first word
    request = send([new_text_part("once upon a time")], capability="text.story")
    async with aclosing(client.send_message(request)) as stream:
        async with asyncio.timeout(60):
            first = await anext(stream)
            update = await anext(stream)
        # the first word came while the handler was still waiting for the rest
        assert not fleet.hold.telling.is_set()
        fleet.hold.telling.set()
        rest = await collect(stream)
    assert first.HasField("task")
    assert first.task.status.state == T.TASK_STATE_WORKING
    assert first.task.metadata["reach"]["agent_id"].startswith("helper-")
    updates = [update, *rest[:-1]]
    assert all(u.HasField("artifact_update") for u in updates)
    words = [get_message_text(u.artifact_update.artifact) for u in updates]
    assert words == ["once", "upon", "a", "time"]
    assert [u.artifact_update.append for u in updates] == [False, True, True, True]
    assert {u.artifact_update.task_id for u in updates} == {first.task.id}
    assert {u.artifact_update.artifact.artifact_id for u in updates} == {"result"}
    last = rest[-1]
    assert last.HasField("status_update")
    assert last.status_update.status.state == T.TASK_STATE_COMPLETED
    assert last.status_update.metadata["reach"]["chunks"] == 4


async def test_a_streaming_capability_that_fails_mid_way_ends_the_task_failed(fleet, http):
    client = await a2a(fleet, http, "helper", streaming=True)
    request = send([new_text_part("it went boom")], capability="text.story")
    events = await collect(client.send_message(request))
    words = [get_message_text(e.artifact_update.artifact) for e in events[1:-1]]
    assert words == ["it", "went"]
    end = events[-1].status_update.status
    assert end.state == T.TASK_STATE_FAILED
    assert get_message_text(end.message).startswith("failed: text.story: handler failed")
    assert "fell silent" not in get_message_text(end.message)


async def test_a_streaming_capability_without_streaming_is_one_message(fleet, http):
    client = await a2a(fleet, http, "helper", streaming=False)
    request = send([new_text_part("three little words")], capability="text.story")
    [event] = await collect(client.send_message(request))
    assert event.HasField("message")
    assert [p.text for p in event.message.parts] == ["three", "little", "words"]


@pytest.mark.parametrize(
    ("text", "times"),
    [
        # more than the window (16) past the limit: the handler is still at it when the
        # gateway gives up
        ("w", MAX_CHUNKS + 100),  # too many chunks
        ("x" * 60_000, 60),  # the 18th chunk (1.08 MB) is past 1 MiB
    ],
)
async def test_a_streaming_answer_too_long_for_one_message_is_refused(fleet, http, text, times):
    """SendMessage gathers a streaming skill's chunks into one message, up to 1,000 chunks
    or 1 MiB: past that the stream is cancelled at its agent and the client is told to use
    SendStreamingMessage."""
    client = await a2a(fleet, http, "helper", streaming=False)
    request = send([new_data_part({"text": text, "times": times})], capability="text.story")
    with pytest.raises(UnsupportedOperationError, match="SendStreamingMessage"):
        await collect(client.send_message(request))
    await eventually(lambda: fleet.hold.stories_cut == 1, timeout=30)  # the handler stopped
    # up to the limits, it is one message
    request = send([new_data_part({"text": "w", "times": MAX_CHUNKS})], capability="text.story")
    [event] = await collect(client.send_message(request))
    assert len(event.message.parts) == MAX_CHUNKS
    assert fleet.hold.stories_cut == 1


async def test_a_durable_task_streams_its_states_from_the_record(fleet, http):
    client = await a2a(fleet, http, "helper", streaming=True)
    # The task waits until the stream has begun: on a busy machine it could otherwise end
    # before the stream reads it, and the stream would be the finished task alone.
    fleet.hold.counting.clear()
    request = send([new_text_part("x y z w")], capability="text.count")
    async with aclosing(client.send_message(request)) as stream:
        async with asyncio.timeout(60):
            first = await anext(stream)
        fleet.hold.counting.set()
        rest = await collect(stream)
    assert first.HasField("task")  # first the task, then its changes
    assert first.task.status.state in (T.TASK_STATE_SUBMITTED, T.TASK_STATE_WORKING)
    assert not first.task.artifacts
    task_id = first.task.id
    seen = states([first, *rest])
    assert seen[-1] == T.TASK_STATE_COMPLETED
    order = [T.TASK_STATE_SUBMITTED, T.TASK_STATE_WORKING, T.TASK_STATE_COMPLETED]
    assert seen == sorted(seen, key=order.index)
    updates = [e.status_update for e in rest if e.HasField("status_update")]
    assert updates
    assert {u.task_id for u in updates} == {task_id}
    # the result: an artifact update before the final status
    artifacts = [e.artifact_update.artifact for e in rest if e.HasField("artifact_update")]
    assert [get_data_parts(a.parts) for a in artifacts] == [[{"words": 4}]]
    assert rest[-1].HasField("status_update")

    # a finished task has nothing more to stream
    with pytest.raises(UnsupportedOperationError):
        await collect(client.subscribe(SubscribeToTaskRequest(id=task_id)))


async def test_a_running_task_is_cancelled_and_its_subscribers_see_it(fleet, http):
    client = await a2a(fleet, http, "helper", streaming=True)
    plain = await a2a(fleet, http, "helper", streaming=False)  # return_immediately: no stream
    [event] = await collect(
        plain.send_message(
            send([new_data_part({})], capability="text.hold", return_immediately=True)
        )
    )
    task_id = event.task.id
    async with asyncio.timeout(30):
        await fleet.hold.entered.wait()
    # a subscriber follows the running task while another call cancels it
    async with aclosing(client.subscribe(SubscribeToTaskRequest(id=task_id))) as stream:
        first = await anext(stream)
        assert first.task.id == task_id
        # running, though its record may not say so yet: the first write can wait 50 ms
        assert first.task.status.state in (T.TASK_STATE_SUBMITTED, T.TASK_STATE_WORKING)
        cancelled = await client.cancel_task(CancelTaskRequest(id=task_id))
        assert cancelled.status.state == T.TASK_STATE_CANCELED
        assert fleet.hold.cancelled == [task_id]
        async with asyncio.timeout(30):
            rest = await collect(stream)
    assert states(rest)[-1] == T.TASK_STATE_CANCELED
    got = await client.get_task(GetTaskRequest(id=task_id))
    assert got.status.state == T.TASK_STATE_CANCELED
    # cancelling again is harmless; a completed task cannot be cancelled
    assert (await client.cancel_task(CancelTaskRequest(id=task_id))).status.state == (
        T.TASK_STATE_CANCELED
    )
    [done] = await collect(plain.send_message(send([new_text_part("a")], capability="text.count")))
    with pytest.raises(TaskNotCancelableError):
        await client.cancel_task(CancelTaskRequest(id=done.task.id))


async def test_a_stream_the_client_leaves_stops_its_watch(fleet, http):
    client = await a2a(fleet, http, "helper", streaming=True)
    plain = await a2a(fleet, http, "helper", streaming=False)
    request = send([new_data_part({})], capability="text.hold", return_immediately=True)
    [event] = await collect(plain.send_message(request))
    async with asyncio.timeout(30):
        await fleet.hold.entered.wait()
    nc = fleet.client.nc
    before = len(nc._subs)  # the gateway connection's subscriptions (nats-py keeps them here)
    async with aclosing(client.subscribe(SubscribeToTaskRequest(id=event.task.id))) as stream:
        await anext(stream)
        await eventually(lambda: len(nc._subs) > before, timeout=30)  # following the record
    # the client went away: the gateway stops its KV watch
    await eventually(lambda: len(nc._subs) == before, timeout=30)
    await plain.cancel_task(CancelTaskRequest(id=event.task.id))


async def test_an_unknown_task_is_the_sdks_not_found_error(fleet, http):
    client = await a2a(fleet, http, "helper", streaming=True)
    for task_id in ("nope", "not a task id", "x" * 200):
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id=task_id))
    with pytest.raises(TaskNotFoundError):
        await client.cancel_task(CancelTaskRequest(id="nope"))
    with pytest.raises(TaskNotFoundError):
        await collect(client.subscribe(SubscribeToTaskRequest(id="nope")))
    msg = send([new_text_part("more")], capability="text.count")
    msg.message.task_id = "nope"
    with pytest.raises(TaskNotFoundError):
        await collect(client.send_message(msg))


async def test_errors_map_to_a2a_errors(fleet, http):
    client = await a2a(fleet, http, "helper", streaming=False)
    with pytest.raises(InvalidParamsError, match="has 6 skills"):
        await collect(client.send_message(send([new_text_part("x")])))
    with pytest.raises(InvalidParamsError, match=r"no skill 'text\.nope'"):
        await collect(client.send_message(send([new_text_part("x")], capability="text.nope")))
    with pytest.raises(InvalidParamsError, match="runs as call, not 'task'"):
        await collect(
            client.send_message(send([new_text_part("x")], capability="text.echo", mode="task"))
        )
    with pytest.raises(InvalidParamsError, match="priority"):
        await collect(
            client.send_message(send([new_text_part("x")], capability="text.echo", priority="top"))
        )
    # the handler refuses the payload: bad_request is InvalidParams, with the Reach code
    with pytest.raises(InvalidParamsError, match="'text' is required"):
        await collect(client.send_message(send([new_text_part("x")], capability="text.refuse")))
    with pytest.raises(InvalidParamsError, match="text"):  # EchoIn needs 'text'
        await collect(client.send_message(send([new_data_part({"n": 1})], capability="text.echo")))
    # a task that fails is a failed A2A task, with the Reach error in its status message
    [event] = await collect(
        client.send_message(send([new_data_part({})], capability="text.broken"))
    )
    assert event.task.status.state == T.TASK_STATE_FAILED
    assert get_message_text(event.task.status.message).startswith("failed:")
    # a message sent again (same message id) is the same task
    again = send([new_text_part("a b")], capability="text.count")
    [first] = await collect(client.send_message(again))
    [second] = await collect(client.send_message(again))
    assert first.task.id == second.task.id
    # the gateway's own failures are InternalError
    await fleet.client.close()
    with pytest.raises(InternalError):
        await client.get_task(GetTaskRequest(id=first.task.id))


async def test_a_v03_client_uses_the_same_endpoint(fleet, http):
    card = await A2ACardResolver(http, f"{fleet.url}/a2a/helper").get_agent_card()
    legacy = AgentCard()
    legacy.CopyFrom(card)
    del legacy.supported_interfaces[:]
    old = [i for i in card.supported_interfaces if i.protocol_version == "0.3"]
    legacy.supported_interfaces.extend(old)
    client = ClientFactory(ClientConfig(httpx_client=http, streaming=False)).create(legacy)
    events = await collect(
        client.send_message(send([new_data_part({"text": "z", "n": 2})], capability="text.echo"))
    )
    assert get_data_parts(events[0].message.parts) == [{"echo": "zz"}]
    request = send([new_text_part("p q")], capability="text.count")
    [event] = await collect(client.send_message(request))
    got = await client.get_task(GetTaskRequest(id=event.task.id))
    assert got.status.state == T.TASK_STATE_COMPLETED


TOKENS = {"call-token-0123456789": {"call"}, "task-token-0123456789": {"submit"}}


def scopes_of(authorization: str | None) -> set[str]:
    """The gateway's part (its own auth in production): 401 without a known token."""
    token = (authorization or "").removeprefix("Bearer ")
    if token not in TOKENS:
        raise HTTPException(401, "a bearer token is required")
    return TOKENS[token]


async def test_tokens_and_scopes(reach_settings):
    async with a2a_fleet(reach_settings, scopes_of) as fleet:
        url = f"{fleet.url}/a2a/helper"
        as_caller = {"Authorization": "Bearer call-token-0123456789"}
        as_submitter = {"Authorization": "Bearer task-token-0123456789"}
        async with (
            httpx.AsyncClient(timeout=60) as anon,
            httpx.AsyncClient(timeout=60, headers=as_caller) as caller,
            httpx.AsyncClient(timeout=60, headers=as_submitter) as submitter,
        ):
            with pytest.raises(AgentCardResolutionError) as info:
                await A2ACardResolver(anon, url).get_agent_card()
            assert info.value.status_code == 401
            assert (await anon.get(f"{fleet.url}/a2a/")).status_code == 401
            card = await A2ACardResolver(caller, url).get_agent_card()
            assert "bearer" in card.security_schemes
            assert list(card.security_requirements[0].schemes) == ["bearer"]

            def client(http: httpx.AsyncClient) -> Client:
                return ClientFactory(ClientConfig(httpx_client=http, streaming=False)).create(card)

            echo = send([new_data_part({"text": "a"})], capability="text.echo")
            count = send([new_text_part("a b")], capability="text.count")
            with pytest.raises(A2AClientError, match="401"):
                await collect(client(anon).send_message(echo))
            [reply] = await collect(client(caller).send_message(echo))
            assert get_data_parts(reply.message.parts) == [{"echo": "a"}]
            with pytest.raises(A2AClientError, match="403"):
                await collect(client(caller).send_message(count))
            [done] = await collect(client(submitter).send_message(count))
            assert done.task.status.state == T.TASK_STATE_COMPLETED
            with pytest.raises(A2AClientError, match="403"):
                await client(caller).get_task(GetTaskRequest(id=done.task.id))
            with pytest.raises(A2AClientError, match="403"):
                await collect(client(submitter).send_message(echo))


@pytest.mark.parametrize("capability", ["text.echo", "text.count"])
@pytest.mark.parametrize("timeout", [1e12, 0, -1, "soon", True])
async def test_a_timeout_in_the_metadata_is_finite_and_bounded(fleet, http, capability, timeout):
    client = await a2a(fleet, http, "helper", streaming=False)
    message = send([new_data_part({"text": "a"})], capability=capability, timeout=timeout)
    with pytest.raises(InvalidParamsError, match="metadata 'timeout'"):
        await collect(client.send_message(message))


async def test_an_infinite_timeout_in_raw_json_is_invalid_params(fleet, http):
    """The SDK's client cannot send it; raw JSON can (1e999 reads as infinity)."""
    body = (
        b'{"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message":'
        b' {"role": "ROLE_USER", "messageId": "m-1", "parts": [{"text": "a"}],'
        b' "metadata": {"capability": "text.echo", "timeout": 1e999}}}}'
    )
    headers = {"content-type": "application/json", "A2A-Version": "1.0"}
    r = await http.post(f"{fleet.url}/a2a/helper", content=body, headers=headers)
    error = r.json()["error"]
    assert (error["code"], "metadata 'timeout'" in error["message"]) == (-32602, True), error
