"""No handler can hurt its agent: every fault gets an error reply and the workers keep serving.

Each fault is sent more often than ``max_concurrency`` (so one lost worker per fault would
leave none), then good requests must still be served; under ``start()`` and under
``serve_forever()`` run as a task.
"""

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

import reach
from reach import Agent, Client
from reach.wire import ErrorBody, Header

WORKERS = 2
WAVES = 3
FAULTY = WORKERS * WAVES  # more than max_concurrency


class Busy(reach.RemoteError):
    """An application refusal with a code of its own (default status 500)."""

    code = "busy_now"
    retryable = True


class Conflict(reach.RemoteError):
    code = "version_conflict"
    status = 409


class NotSnake(reach.RemoteError):
    code = "Not Snake!"


class TooLong(reach.RemoteError):
    code = "x" * 65


class Weird(BaseException):
    """Not an Exception at all."""


class BrokenRefusal(reach.RemoteError):
    """A refusal whose status cannot even be read: it breaks our own reply path."""

    code = "broken_status"

    @property
    def status(self) -> int:
        raise RuntimeError("no status for you")


def fault_agent(
    settings: reach.ReachSettings, release: asyncio.Event, workers: int = WORKERS
) -> Agent:
    agent = Agent("faulty", settings=settings, max_concurrency=workers, max_queue=64)

    @agent.capability("fault.op")
    async def op(req: dict[str, Any]) -> Any:
        kind = req["kind"]
        if kind == "ok":
            return {"ok": req.get("n", 0)}
        if kind == "busy":
            raise Busy("busy now, come back later")
        if kind == "conflict":
            raise Conflict("version 3 is stale")
        if kind == "not_snake":
            raise NotSnake("bad code")
        if kind == "too_long":
            raise TooLong("bad code")
        if kind == "broken_refusal":
            raise BrokenRefusal("unreadable")
        if kind == "raise":
            raise RuntimeError("secret")
        if kind == "base":
            raise Weird("odd")
        if kind == "cancel":
            raise asyncio.CancelledError
        if kind == "unencodable":
            return object()
        if kind == "too_large":
            return b"x" * (2 * 1024 * 1024)  # over the server's max_payload
        if kind == "overrun":
            await asyncio.Event().wait()
        if kind == "convert":
            # Turns the deadline's cancellation into another exception.
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise RuntimeError("converted") from None
        if kind == "swallow":
            # Ignores the deadline's cancellation once, then answers late.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
            return {"late": True}
        if kind == "hang":
            # Ignores every cancellation until the test releases it.
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()
            return {"late": True}
        raise AssertionError(kind)

    return agent


async def serving_now(client: Client) -> bool:
    try:
        await client.request("fault.op", {"kind": "ok"}, max_attempts=1, timeout=2)
    except reach.CapabilityNotFound:
        return False
    return True


@contextlib.asynccontextmanager
async def serving(agent: Agent, mode: str, client: Client) -> AsyncIterator[None]:
    if mode == "start":
        await agent.start()
        try:
            yield
        finally:
            async with asyncio.timeout(30):
                await agent.stop()
        return
    task = asyncio.create_task(agent.serve_forever())
    await reach.testing.eventually(lambda: serving_now(client))
    try:
        yield
        assert not task.done(), "serve_forever ended by itself"
    finally:
        task.cancel()
        async with asyncio.timeout(30):
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def raw_error(client: Client, kind: str, *, deadline_in_ms: int | None = None) -> tuple:
    """Send one faulty request with plain nats-py; return (status header, error body)."""
    headers = {}
    if deadline_in_ms is not None:
        headers[Header.DEADLINE] = str(int(time.time() * 1000) + deadline_in_ms)
    msg = await client.nc.request(
        client.subjects.cap("fault.op"),
        msgspec.json.encode({"kind": kind}),
        headers=headers or None,
        timeout=10,
    )
    assert msg.headers is not None, f"{kind}: a success reply {msg.data[:80]!r}"
    return msg.headers[Header.SERVICE_ERROR_CODE], msgspec.json.decode(msg.data, type=ErrorBody)


async def good_requests_still_served(client: Client) -> None:
    replies = await asyncio.gather(
        *(
            client.request("fault.op", {"kind": "ok", "n": n}, timeout=10, max_attempts=1)
            for n in range(WORKERS * 3)
        )
    )
    assert replies == [{"ok": n} for n in range(WORKERS * 3)]


# kind -> (status header, wire code, retryable, deadline for the request in ms)
FAULTS = {
    "busy": ("500", "busy_now", True, None),
    "conflict": ("409", "version_conflict", False, None),
    "not_snake": ("500", "failed", False, None),
    "too_long": ("500", "failed", False, None),
    "raise": ("500", "failed", False, None),
    "base": ("500", "failed", False, None),
    "cancel": ("499", "cancelled", False, None),
    "unencodable": ("500", "failed", False, None),
    "too_large": ("500", "failed", False, None),
    "overrun": ("408", "timeout", True, 200),
    "swallow": ("408", "timeout", True, 200),
    "convert": ("408", "timeout", True, 200),
    "hang": ("408", "timeout", True, 200),
    "broken_refusal": ("500", "failed", False, None),
}
MODES = ["start", "serve_forever"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(FAULTS))
async def test_fault_gets_an_error_reply_and_workers_keep_serving(
    reach_settings, reach_client, kind, mode
):
    status, code, retryable, deadline = FAULTS[kind]
    release = asyncio.Event()
    agent = fault_agent(reach_settings, release)
    try:
        async with serving(agent, mode, reach_client):
            answers = []
            for _ in range(WAVES):
                # In waves of max_concurrency, so that none expires unrun in the queue
                # (an expired request is dropped unanswered, by the protocol).
                answers += await asyncio.gather(
                    *(
                        raw_error(reach_client, kind, deadline_in_ms=deadline)
                        for _ in range(WORKERS)
                    )
                )
                if kind == "hang":
                    # Let them end: past max_concurrency stuck ones are not replaced.
                    release.set()
                    await reach.testing.eventually(lambda: agent.stats.stuck == 0)
                    release.clear()
            # Then a handler cancelling itself on every worker: no fault may leave a
            # worker believing it is being stopped.
            answers_after = await asyncio.gather(
                *(raw_error(reach_client, "cancel") for _ in range(WORKERS))
            )
            assert [(s, b.code) for s, b in answers_after] == [("499", "cancelled")] * WORKERS
            for got_status, body in answers:
                assert (got_status, body.code, body.retryable) == (status, code, retryable)
            await good_requests_still_served(reach_client)
            release.set()
    finally:
        release.set()
    assert agent.stats.internal_errors == (FAULTY if kind == "broken_refusal" else 0)


async def test_application_code_reaches_the_caller_as_remote_error(reach_settings, reach_client):
    agent = fault_agent(reach_settings, asyncio.Event())
    async with agent:
        with pytest.raises(reach.RemoteError, match="busy now") as info:
            await reach_client.request("fault.op", {"kind": "busy"}, max_attempts=1)
        with pytest.raises(reach.RemoteError, match="stale") as conflict:
            await reach_client.request("fault.op", {"kind": "conflict"})
    assert info.value.code == "busy_now"
    assert info.value.outcome == "refused"  # never a client outcome name (PROTOCOL.md 3.2)
    assert info.value.retryable
    assert info.value.agent_id == agent.agent_id
    # An unknown code is not failed over: one attempt, on the instance that refused.
    assert conflict.value.code == "version_conflict"
    assert [a.outcome for a in conflict.value.attempts] == ["refused"]


async def test_invalid_application_code_is_logged_and_sent_as_failed(
    reach_settings, reach_client, caplog
):
    caplog.set_level(logging.ERROR, logger="reach.agent")
    agent = fault_agent(reach_settings, asyncio.Event())
    async with agent:
        with pytest.raises(reach.HandlerFailed) as info:
            await reach_client.request(
                "fault.op", {"kind": "not_snake"}, request_id="rid-code", max_attempts=1
            )
    assert info.value.code == "failed"
    assert "rid-code" in str(info.value)
    assert any(
        "rid-code" in r.getMessage() and "Not Snake!" in r.getMessage() for r in caplog.records
    )


async def test_a_broken_reply_path_is_logged_and_counted(reach_settings, reach_client, caplog):
    caplog.set_level(logging.ERROR, logger="reach.agent")
    agent = fault_agent(reach_settings, asyncio.Event())
    async with agent:
        with pytest.raises(reach.HandlerFailed):
            await reach_client.request("fault.op", {"kind": "broken_refusal"}, max_attempts=1)
        await good_requests_still_served(reach_client)
    assert agent.stats.internal_errors == 1
    assert any(r.exc_info and "no status for you" in str(r.exc_info[1]) for r in caplog.records)


async def test_stop_does_not_hang_on_a_handler_that_ignores_cancellation(
    reach_settings, reach_client
):
    release = asyncio.Event()
    agent = fault_agent(reach_settings, release)
    agent.drain_timeout = 0.1
    await agent.start()
    try:
        status, body = await raw_error(reach_client, "hang", deadline_in_ms=100)
        assert (status, body.code) == ("408", "timeout")
        async with asyncio.timeout(30):
            await agent.stop()
        assert agent.status == reach.Status.DOWN
    finally:
        release.set()


async def test_an_abandoned_request_is_answered_once(reach_settings, reach_client):
    agent = Agent("late", settings=reach_settings, max_concurrency=1, max_queue=8)
    raised = asyncio.Event()

    @agent.capability("late.op")
    async def op(req: dict[str, Any]) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        await reach.testing.eventually(lambda: agent.stats.abandoned == 1)
        raised.set()
        raise RuntimeError("late failure")

    @agent.capability("late.ok")
    async def ok(req: dict[str, Any]) -> dict[str, Any]:
        return req

    async with agent:
        nc = reach_client.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.flush()
        deadline = {Header.DEADLINE: str(int(time.time() * 1000) + 150)}
        await nc.publish(reach_client.subjects.cap("late.op"), b"{}", reply=inbox, headers=deadline)
        first = await sub.next_msg(timeout=10)
        assert first.headers is not None
        assert first.headers[Header.SERVICE_ERROR_CODE] == "408"
        await raised.wait()
        # A request served after the late failure: a second reply would have come before it.
        assert await reach_client.request("late.ok", {"n": 1}, timeout=10) == {"n": 1}
        assert sub.pending_msgs == 0
        assert agent.stats.failed == 1


async def test_a_topic_handler_cancelling_itself_keeps_its_topic(reach_settings, reach_client):
    agent = Agent("topical", settings=reach_settings)
    got: list[int] = []

    @agent.on_topic("fault.news")
    async def news(msg: dict[str, Any]) -> None:
        got.append(msg["n"])
        if msg["n"] == 1:
            raise asyncio.CancelledError

    async with agent:
        for n in range(1, 4):
            await reach_client.publish("fault.news", {"n": n})
        await reach_client.flush()
        await reach.testing.eventually(lambda: len(got) == 3, timeout=10)
    assert got == [1, 2, 3]
    assert agent.stats.topic_errors == 1


async def test_stuck_handlers_are_capped_at_max_concurrency(reach_settings, reach_client):
    """Past the cap an abandoned handler's worker is not replaced (the agent degrades);
    once the stuck handlers end, they serve again and the agent recovers."""
    release = asyncio.Event()
    agent = fault_agent(reach_settings, release, workers=1)
    try:
        async with agent:
            for stuck in (1, 2):
                status, body = await raw_error(reach_client, "hang", deadline_in_ms=100)
                assert (status, body.code) == ("408", "timeout")
                assert agent.stats.stuck == stuck
            assert agent.status is reach.Status.DEGRADED
            release.set()
            await reach.testing.eventually(lambda: agent.stats.stuck == 0)
            await good_requests_still_served(reach_client)
    finally:
        release.set()


EXITING_AGENT = """
import asyncio, sys
import reach

settings = reach.ReachSettings(nats_url=sys.argv[1], subject_prefix=sys.argv[2])
agent = reach.Agent("exiting", "exiting-1", settings=settings)

@agent.capability("exit.op")
async def op(req: dict) -> dict:
    raise SystemExit(3)

@agent.on_topic("exit.news")
async def news(msg: dict) -> None:
    raise SystemExit(3)

@agent.task("exit.job")
async def job(req: dict) -> dict:
    raise SystemExit(3)

asyncio.run(agent.serve_forever())
"""


@pytest.mark.parametrize("kind", ["capability", "topic", "task"])
async def test_a_handler_exiting_the_process_answers_first_and_leaves_cleanly(
    reach_settings, reach_client, tmp_path, kind
):
    """``SystemExit`` in a handler: the caller is answered, the agent stops in order (it
    deregisters, rather than being torn down by asyncio with its connection's tasks
    cancelled under it) and the process exits with the handler's code."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING_AGENT)
    async with reach.Registry(settings=reach_settings):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            reach_settings.nats_url,
            reach_settings.subject_prefix,
            stderr=asyncio.subprocess.PIPE,
        )
        try:

            async def registered() -> bool:
                return any(r.info.agent_id == "exiting-1" for r in await reach_client.agents())

            await reach.testing.eventually(registered, timeout=20)
            if kind == "capability":
                reply = await reach_client.nc.request(
                    reach_client.subjects.cap("exit.op"), b"{}", timeout=5
                )
                assert reply.headers[Header.SERVICE_ERROR_CODE] == "500"
            elif kind == "topic":
                await reach_client.publish("exit.news", {})
            else:
                ref = await reach_client.submit("exit.job", {}, max_attempts=1)
            async with asyncio.timeout(20):
                _, err = await proc.communicate()
            assert proc.returncode == 3
            # The exit went through the agent's own stop, not out of a crashed task.
            assert b" failed" not in err
            assert b"crashed" not in err
            if kind == "task":
                record = await ref.wait(timeout=20)
                assert record.state is reach.TaskState.FAILED
            # Deregistered on the way out: gone at once, not after the lease runs out.
            assert not await registered()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_result_over_max_payload_with_its_reply_headers_is_refused_not_sent(
    reach_settings, reach_client
):
    """A result within max_payload alone but over it with the reply headers
    (``reply_headers=True``): sent, the server closed the agent's connection and every
    reply in flight was lost. It is answered as failed instead, and the agent serves on."""
    agent = Agent("big", reply_headers=True, settings=reach_settings)
    near = reach_client.nc.max_payload - 20

    @agent.capability("big.result")
    async def result(payload: bytes) -> bytes:
        return b"x" * near if payload == b"big" else b"small"

    async with agent:
        with pytest.raises(reach.HandlerFailed, match="too large"):
            await reach_client.request("big.result", b"big", agent_id=agent.agent_id, timeout=5)
        reply = await reach_client.request(
            "big.result", b"ok", agent_id=agent.agent_id, timeout=5, response_type=bytes
        )
        assert reply == b"small"
        assert agent.client.nc.stats["reconnects"] == 0
