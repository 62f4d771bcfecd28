"""Dead letters and replay, and listing tasks, against a real nats-server."""

import asyncio

import pytest

from reach import Agent, Client, ConfigurationError, DeadLetter, ReachError, TaskState
from reach.testing import eventually

CAP = "report.build"


@pytest.fixture
def settings(reach_settings):
    return reach_settings.model_copy(
        update={"task_ack_wait": 2.0, "task_retry_base": 0.05, "task_retry_cap": 0.1}
    )


def flaky_agent(settings, gate, seen, cancelled=None):
    """Fails (raises, or hangs past its timeout for ``{"hang": true}``) until ``gate`` is
    set; records each run's headers, and in ``cancelled`` each run that was cancelled."""
    agent = Agent("builder", settings=settings)

    @agent.task(CAP)
    async def build(payload: dict, ctx) -> dict:
        seen.append({"task_id": ctx.task_id, "attempt": ctx.attempt, "headers": ctx.headers})
        if not gate.is_set():
            if payload.get("hang"):
                try:
                    await asyncio.Event().wait()  # cancelled by the task timeout
                except asyncio.CancelledError:
                    if cancelled is not None:
                        cancelled.append((ctx.task_id, ctx.attempt))
                    raise
            raise ValueError("not yet")
        return {"n": payload["n"] * 2}

    return agent


async def test_timeout_then_retries_then_dlq_then_replay_then_success(settings):
    gate, seen, cancelled = asyncio.Event(), [], []
    agent = flaky_agent(settings, gate, seen, cancelled)
    async with agent, Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 21, "hang": True}, timeout=0.3, max_attempts=2)
        failed = await ref.wait(timeout=30)
        assert failed.state is TaskState.FAILED
        assert failed.error is not None
        assert failed.error.code == "timeout"
        assert [a.outcome for a in failed.attempts] == ["timeout", "timeout"]
        # each overrun cancelled its handler (CancelledError inside it), and the record
        # went through TIMEOUT, then RETRYING, before the second run
        assert cancelled == [(ref.task_id, 1), (ref.task_id, 2)]
        S = TaskState
        assert [h.state for h in failed.history] == [
            S.PENDING,
            S.RUNNING,
            S.TIMEOUT,
            S.RETRYING,
            S.RUNNING,
            S.TIMEOUT,
            S.FAILED,
        ]

        [dl] = await client.dead_letters()
        assert isinstance(dl, DeadLetter)
        assert (dl.task_id, dl.capability, dl.kind, dl.reason) == (
            ref.task_id,
            CAP,
            "task",
            "timeout",
        )
        assert [a.outcome for a in dl.attempts] == ["timeout", "timeout"]
        assert dl.time is not None
        assert await client.dead_letter(dl.seq) == dl

        gate.set()
        replayed = await client.replay(dl.seq)
        assert replayed.task_id != ref.task_id
        assert await replayed.result(timeout=30) == {"n": 42}
        rec = await replayed.status()
        assert rec.replay_of == ref.task_id
        assert [a.outcome for a in rec.attempts] == ["succeeded"]
        assert await client.dead_letters() == []  # replayed: gone from the DLQ
        assert (await ref.status()).state is TaskState.FAILED  # the old task stays as it was
        with pytest.raises(ReachError, match="no dead letter") as info:
            await client.replay(dl.seq)
        assert info.value.code == "not_found"


async def test_replay_keeps_the_idempotency_key(settings):
    gate, seen = asyncio.Event(), []
    agent = flaky_agent(settings, gate, seen)
    async with agent, Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 1}, idempotency_key="order-17", max_attempts=1)
        assert (await ref.wait(timeout=30)).state is TaskState.FAILED
        [dl] = await client.dead_letters(CAP)
        assert dl.reason == "failed"
        assert "ValueError: not yet" in dl.error
        gate.set()
        replayed = await client.replay(dl.seq)
        assert await replayed.result(timeout=30) == {"n": 2}
        last = seen[-1]
        assert last["task_id"] == replayed.task_id
        assert last["headers"]["Reach-Idempotency-Key"] == "order-17"
        assert (await replayed.status()).idempotency_key == "order-17"
        # The key now names the replayed task: a submit with it gets that task back.
        again = await client.submit(CAP, {"n": 1}, idempotency_key="order-17")
        assert again.task_id == replayed.task_id
        assert len(seen) == 2  # one failed run, one replayed run; the resubmit ran nothing


async def test_replay_by_capability_replays_every_task_and_leaves_the_rest(settings):
    gate, seen = asyncio.Event(), []
    agent = flaky_agent(settings, gate, seen)
    async with agent, Client(settings=settings) as client:
        refs = []
        for i in range(3):  # one after the other, so they reach the DLQ in this order
            refs.append(await client.submit(CAP, {"n": i}, max_attempts=1))
            assert (await refs[-1].wait(timeout=30)).state is TaskState.FAILED
        letters = await client.dead_letters(CAP)
        assert [d.task_id for d in letters] == [r.task_id for r in reversed(refs)]  # newest first
        assert len(await client.dead_letters(CAP, limit=2)) == 2
        assert await client.dead_letters("other.cap") == []
        gate.set()
        replayed = await client.replay_capability(CAP)
        assert [await r.result(timeout=30) for r in replayed] == [{"n": 0}, {"n": 2}, {"n": 4}]
        assert [(await r.status()).replay_of for r in replayed] == [r.task_id for r in refs]
        assert await client.dead_letters() == []
        assert await client.replay_capability(CAP) == []


async def test_undecodable_task_goes_to_the_dlq_and_the_agent_keeps_serving(settings):
    gate, seen = asyncio.Event(), []
    gate.set()
    agent = flaky_agent(settings, gate, seen)
    async with agent, Client(settings=settings) as client:
        subject = f"{settings.subject_prefix}.task.junk1.{CAP}.normal"
        garbage = b"\x00\xffnot a task"
        await client.nc.jetstream().publish(subject, garbage, headers={"Reach-Task-Id": "junk1"})
        ref = await client.submit(CAP, {"n": 5})
        assert await ref.result(timeout=30) == {"n": 10}

        async def dead_lettered() -> bool:
            return len(await client.dead_letters()) == 1

        await eventually(dead_lettered, timeout=30)
        [dl] = await client.dead_letters()
        assert (dl.reason, dl.kind, dl.task_id) == ("bad_request", "task", "junk1")
        assert dl.data == garbage
        assert agent.task_stats.invalid == 1
        with pytest.raises(ReachError, match="cannot be replayed") as info:
            await client.replay(dl.seq)
        assert info.value.code == "bad_request"
        assert [d.seq for d in await client.dead_letters()] == [dl.seq]  # still there
        ref = await client.submit(CAP, {"n": 6})
        assert await ref.result(timeout=30) == {"n": 12}


async def test_an_undelivered_callback_is_a_dead_letter_that_is_not_replayed(settings):
    settings = settings.model_copy(update={"callback_attempts": 1})
    gate, seen = asyncio.Event(), []
    gate.set()
    agent = flaky_agent(settings, gate, seen)
    async with agent, Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 3}, callback="nobody.listens.here")
        assert await ref.result(timeout=30) == {"n": 6}

        async def callback_dead() -> bool:
            return (await ref.status()).callback_state == "dead"

        await eventually(callback_dead, timeout=30)
        [dl] = await client.dead_letters()
        assert (dl.kind, dl.reason, dl.task_id) == ("callback", "callback_undelivered", ref.task_id)
        with pytest.raises(ReachError, match="not a task"):
            await client.replay(dl.seq)
        assert len(await client.dead_letters()) == 1


async def test_list_tasks_by_state_and_capability_newest_first(settings):
    gate, seen = asyncio.Event(), []
    gate.set()
    agent = flaky_agent(settings, gate, seen)
    hold = asyncio.Event()
    started = asyncio.Event()

    @agent.task("report.slow")
    async def slow(payload: dict) -> dict:
        started.set()
        await hold.wait()
        return payload

    async with agent, Client(settings=settings) as client:
        assert await client.list_tasks() == []
        done = []
        for i in range(3):  # one after the other, so they end in this order
            done.append(await client.submit(CAP, {"n": i}))
            await done[-1].result(timeout=30)
        queued = await client.submit("report.nobody", {"y": 1})
        pending = await client.list_tasks(state="pending")
        assert [r.task_id for r in pending] == [queued.task_id]  # a message, not yet a record
        running = await client.submit("report.slow", {"x": 1})
        await asyncio.wait_for(started.wait(), 30)

        async def recorded_running() -> bool:
            return (await running.status()).state is TaskState.RUNNING

        await eventually(recorded_running, timeout=30)
        await queued.cancel()
        listed = await client.list_tasks()
        assert [r.task_id for r in listed] == [queued.task_id, running.task_id] + [
            r.task_id for r in done[::-1]
        ]
        assert [r.task_id for r in await client.list_tasks(state="running")] == [running.task_id]
        assert [r.task_id for r in await client.list_tasks(TaskState.RUNNING)] == [running.task_id]
        succeeded = await client.list_tasks(state=TaskState.SUCCEEDED, capability=CAP)
        assert [r.task_id for r in succeeded] == [r.task_id for r in done[::-1]]
        assert len(await client.list_tasks(capability=CAP, limit=2)) == 2
        assert await client.list_tasks(capability="report.none") == []
        assert await client.list_tasks(state="failed") == []
        with pytest.raises(ConfigurationError, match="not one of scheduled, pending, running"):
            await client.list_tasks(state="lost")
        hold.set()
        await running.result(timeout=30)
        assert await client.list_tasks(state="running") == []


async def test_a_dead_letter_whose_publish_failed_is_published_on_redelivery(settings):
    """The DLQ is unavailable when the last attempt fails: the message is neither
    dead-lettered nor terminated. Its redelivery finds the task FAILED and must store the
    dead letter before removing the message, or the task would vanish without a trace."""
    gate, seen = asyncio.Event(), []
    agent = flaky_agent(settings, gate, seen)
    dlq_stream = f"{settings.subject_prefix.upper()}_DLQ"
    async with agent, Client(settings=settings) as client:
        js = client.nc.jetstream()
        assert await client.list_tasks() == []  # the client's task streams are open now
        config = (await js.stream_info(dlq_stream)).config
        await js.delete_stream(dlq_stream)
        ref = await client.submit(CAP, {"n": 1}, max_attempts=1)
        assert (await ref.wait(timeout=30)).state is TaskState.FAILED
        stats = agent.task_stats
        await eventually(lambda: stats.failed == 1 and stats.running == 0, timeout=30)
        assert stats.dead_lettered == 0  # its publish failed: no stream
        await js.add_stream(config)  # the DLQ is back before the redelivery (task_ack_wait)

        async def dead_lettered() -> bool:
            return [d.task_id for d in await client.dead_letters()] == [ref.task_id]

        await eventually(dead_lettered, timeout=30)
        assert len(seen) == 1  # the handler ran once; the redelivery only finished the job


async def test_a_dead_letter_of_many_attempts_keeps_the_newest_attempts(settings):
    """The attempt history rides in one bounded header: with many attempts it keeps the
    newest ones whole, rather than a cut, undecodable list."""
    gate, seen = asyncio.Event(), []
    agent = flaky_agent(settings, gate, seen)
    async with agent, Client(settings=settings) as client:
        ref = await client.submit(CAP, {"n": 1, "hang": True}, timeout=0.05, max_attempts=16)
        rec = await ref.wait(timeout=60)
        assert [a.outcome for a in rec.attempts] == ["timeout"] * 16
        [dl] = await client.dead_letters()
        assert 0 < len(dl.attempts) < 16
        assert dl.attempts == rec.attempts[-len(dl.attempts) :]


async def test_a_purge_removes_what_was_counted_never_a_letter_stored_after(settings, monkeypatch):
    """``purge_dead_letters(expect=n)``, and so ``reach dlq purge --yes n``, removes the
    letters it counted and none stored after the count: a letter that arrives between the
    count and the purge (here: right after the purge's own scan) stays, with and without
    ``older_than``. A count that differs from ``expect`` removes nothing."""
    from reach._tasks import admin

    async with Client(settings=settings) as client:
        store = await client._tasks.ready(client.nc)
        js = client.nc.jetstream()
        letter = store.subjects.dlq("bill.pay")

        async def store_letter() -> int:
            return (await js.publish(letter, b"{}", headers={"Reach-Dlq-Kind": "task"})).seq

        for _ in range(3):
            await store_letter()
        shown = await client.count_dead_letters("bill.pay")
        assert shown == 3
        real_scan = admin.scan
        late: list[int] = []
        scans = 0

        async def then_one_more(*args, **kwargs):
            nonlocal scans
            scans += 1
            seen = await real_scan(*args, **kwargs)
            late.append(await store_letter())  # a task gave up right after the scan
            return seen

        async def purge(*args, **kwargs) -> int:
            """A purge during which a letter is stored after each of its scans."""
            nonlocal scans
            scans = 0
            monkeypatch.setattr(admin, "scan", then_one_more)
            try:
                return await client.purge_dead_letters("bill.pay", *args, **kwargs)
            finally:
                monkeypatch.setattr(admin, "scan", real_scan)

        async def left() -> list[int]:
            return sorted(dl.seq for dl in await client.dead_letters("bill.pay"))

        assert await purge(expect=shown) == 3
        assert scans == 1, "the purge counted twice: a letter between the counts goes unseen"
        assert await left() == late
        assert await purge(0.0, expect=1) == 1  # with older_than: the same bound
        assert await left() == late[1:]
        with pytest.raises(ConfigurationError, match="1 dead letters match now, not the 2"):
            await purge(expect=2)
        assert await left() == late[1:]
