"""The task commands through processes: `reach submit`, `reach tasks`, `reach dlq`."""

import asyncio
import json
import os
import sys

import pytest

from reach import Agent, Client, TaskState
from reach.testing import eventually

CAP = "report.build"


@pytest.fixture
def settings(reach_settings):
    return reach_settings.model_copy(update={"task_ack_wait": 2.0})


async def reach_cli(settings, *args, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env |= {"REACH_NATS_URL": settings.nats_url, "REACH_SUBJECT_PREFIX": settings.subject_prefix}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()  # a hung command fails its test without outliving it
        await proc.wait()
        raise
    return proc.returncode, out.decode(), err.decode()


def task_agent(settings, gate, hold):
    agent = Agent("builder", settings=settings)

    @agent.task(CAP)
    async def build(payload: dict) -> dict:
        if payload.get("fail") and not gate.is_set():
            raise ValueError("the printer is on fire")
        if payload.get("hold"):
            await hold.wait()
        return {"n": payload["n"] * 2}

    return agent


async def test_submit_and_follow_tasks_from_the_command_line(settings):
    gate, hold = asyncio.Event(), asyncio.Event()
    async with task_agent(settings, gate, hold), Client(settings=settings) as client:
        code, out, err = await reach_cli(settings, "submit", CAP, '{"n": 21}', "--wait")
        assert (code, json.loads(out)) == (0, {"n": 42}), err
        assert "# task " in err

        code, out, err = await reach_cli(
            settings, "submit", CAP, '{"n": 2}', "--priority", "high", "--idempotency-key", "k9"
        )
        assert code == 0, err
        task_id = out.strip()
        ref = await client.task(task_id)
        assert await ref.result(timeout=30) == {"n": 4}
        rec = await ref.status()
        assert (rec.priority, rec.idempotency_key) == ("high", "k9")

        code, out, err = await reach_cli(settings, "tasks", task_id)
        assert code == 0, err
        assert "SUCCEEDED" in out
        assert rec.agent_id in out
        assert '{"n": 4}' in out
        assert "history:" in out
        assert "#1" in out
        code, out, _ = await reach_cli(settings, "tasks", task_id, "--json")
        shown = json.loads(out)
        assert (shown["task_id"], shown["state"], shown["result"]) == (
            task_id,
            "SUCCEEDED",
            {"n": 4},
        )

        code, out, err = await reach_cli(settings, "tasks", "--state", "succeeded", "--json")
        assert code == 0, err
        listed = [r["task_id"] for r in json.loads(out)]
        assert (len(listed), listed[0]) == (2, task_id)  # newest first
        code, out, _ = await reach_cli(settings, "tasks", "--capability", CAP)
        assert code == 0
        assert out.splitlines()[0].split()[:3] == ["TASK", "CAPABILITY", "STATE"]
        assert task_id in out

        code, _, err = await reach_cli(settings, "tasks", "noSuchTask")
        assert code == 1
        assert "no task 'noSuchTask'" in err

        # cancel a running task
        running = await client.submit(CAP, {"n": 1, "hold": True})

        async def started() -> bool:
            return (await running.status()).state is TaskState.RUNNING

        await eventually(started, timeout=30)
        code, out, err = await reach_cli(settings, "tasks", "cancel", running.task_id)
        assert code == 0, err
        assert "cancel requested" in out
        assert (await running.wait(timeout=30)).state is TaskState.CANCELLED
        code, out, _ = await reach_cli(settings, "tasks", "cancel", running.task_id)
        assert (code, out.strip()) == (0, f"task {running.task_id}: CANCELLED")
        code, _, err = await reach_cli(settings, "tasks", "cancel", "noSuchTask")
        assert code == 1
        assert "no task" in err
        code, _, err = await reach_cli(settings, "tasks", "a", "b")
        assert code == 2
        assert "reach tasks cancel ID" in err

        code, _, err = await reach_cli(settings, "submit", CAP, "{not json")
        assert code == 1
        assert "bad_request" in err
        code, _, err = await reach_cli(settings, "submit", CAP, '{"n": 1, "fail": true}', "--wait")
        assert code == 1
        assert "the printer is on fire" in err


async def test_dead_letters_from_the_command_line(settings):
    gate, hold = asyncio.Event(), asyncio.Event()
    async with task_agent(settings, gate, hold), Client(settings=settings) as client:
        code, out, err = await reach_cli(settings, "dlq", "list")
        assert (code, out) == (0, "")
        assert "no dead letters" in err
        failed = []
        for i in range(2):
            failed.append(await client.submit(CAP, {"n": i, "fail": True}, max_attempts=1))
            assert (await failed[-1].wait(timeout=30)).state is TaskState.FAILED

        code, out, err = await reach_cli(settings, "dlq", "list", "--json")
        assert code == 0, err
        letters = json.loads(out)
        assert [d["task_id"] for d in letters] == [r.task_id for r in reversed(failed)]
        assert letters[0]["reason"] == "failed"
        assert "the printer is on fire" in letters[0]["error"]
        first_seq = letters[1]["seq"]
        code, out, _ = await reach_cli(settings, "dlq", "list", "--capability", CAP)
        assert failed[0].task_id in out
        assert "REASON" in out
        code, out, _ = await reach_cli(settings, "dlq", "list", "--capability", "other.cap")
        assert (code, out) == (0, "")

        code, out, err = await reach_cli(settings, "dlq", "show", str(first_seq))
        assert code == 0, err
        assert failed[0].task_id in out
        assert "the printer is on fire" in out
        assert '"fail": true' in out
        code, _, err = await reach_cli(settings, "dlq", "show", "99999")
        assert code == 1
        assert "no dead letter 99999" in err

        gate.set()
        code, out, err = await reach_cli(settings, "dlq", "replay", str(first_seq))
        assert code == 0, err
        new = await client.task(out.strip())
        assert await new.result(timeout=30) == {"n": 0}
        assert (await new.status()).replay_of == failed[0].task_id

        code, out, err = await reach_cli(settings, "dlq", "replay", "--capability", CAP)
        assert code == 0, err
        [new_id] = out.split()
        assert await (await client.task(new_id)).result(timeout=30) == {"n": 2}
        assert await client.dead_letters() == []

        code, _, err = await reach_cli(settings, "dlq", "replay")
        assert code == 2
        assert "SEQ or --capability" in err
        code, _, err = await reach_cli(settings, "dlq", "replay", str(first_seq))
        assert code == 1
        assert "not_found" in err


async def test_a_task_record_that_does_not_decode_is_shown_as_corrupt_record(settings):
    """`reach tasks ID` names what is wrong (not the base error), and `reach tasks` lists
    the other tasks past it."""
    async with Client(settings=settings) as client:
        ref = await client.submit("report.nobody", {"n": 1})
        bucket = f"{settings.subject_prefix}_tasks"
        await client.nc.jetstream().publish(f"$KV.{bucket}.{ref.task_id}", b"\x00junk")
        other = await client.submit("report.nobody", {"n": 2})
        code, out, err = await reach_cli(settings, "tasks", ref.task_id)
        assert code == 1, (out, err)
        assert err.startswith(f"error: corrupt_record: the record of task {ref.task_id}"), err
        code, out, err = await reach_cli(settings, "tasks", "--json")
        assert code == 0, err
        assert [r["task_id"] for r in json.loads(out)] == [other.task_id]


async def test_submit_wait_gives_up_after_wait_timeout_and_the_task_goes_on(settings):
    """docs/cli.md: `--wait` waits at most `--wait-timeout` seconds (60 by default), then
    says so (timeout, exit 1) while the task itself goes on. Nobody serves the task, so
    only the option can end the wait: the process must end within 30 s (the hang guard,
    half the default), and not before the second it was given."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    code, out, err = await reach_cli(
        settings, "submit", "cli.unserved", "{}", "--wait", "--wait-timeout", "1", timeout=30
    )
    took = loop.time() - began
    assert code == 1, (out, err)
    assert "timeout" in err
    assert "did not finish within 1.0s (it goes on)" in err
    assert took >= 1.0
    task_id = err.split("# task ", 1)[1].split()[0]
    async with Client(settings=settings) as client:
        assert (await client.task_record(task_id)).state is TaskState.PENDING
        await (await client.task(task_id)).cancel()
