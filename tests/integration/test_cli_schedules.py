"""`reach schedules`, `reach submit --delay` and `reach dlq purge` through processes."""

import json

from reach import Agent, Client, ReachSettings, TaskState

from .test_cli_tasks import reach_cli


async def test_schedules_from_the_command_line(reach_settings: ReachSettings) -> None:
    """add (cron with a time zone), list with the next firing, pause, resume, rm."""
    s = reach_settings
    code, out, err = await reach_cli(
        s, "schedules", "add", "nightly", "report.build", '{"n": 1}', "--cron", "0 0 2 * * *",
        "--tz", "Europe/Berlin", "--json",
    )  # fmt: skip
    assert code == 0, err
    (added,) = json.loads(out)
    assert (added["name"], added["cron"], added["tz"]) == (
        "nightly",
        "0 0 2 * * *",
        "Europe/Berlin",
    )
    assert added["next_ms"] > 0
    code, out, err = await reach_cli(s, "schedules", "list")
    assert code == 0, err
    assert "nightly" in out
    assert "cron 0 0 2 * * * (Europe/Berlin)" in out
    code, out, err = await reach_cli(s, "schedules", "pause", "nightly", "--json")
    assert code == 0, err
    assert json.loads(out)[0]["paused"] is True
    code, out, err = await reach_cli(s, "schedules", "resume", "nightly")
    assert code == 0, err
    assert "paused" not in out
    code, out, err = await reach_cli(s, "schedules", "add", "bad", "x.y", "--cron", "0 2 * * *")
    assert code == 1
    assert "six" in err
    code, out, err = await reach_cli(s, "schedules", "rm", "nightly")
    assert (code, out.strip()) == (0, "schedule nightly removed"), err
    code, out, err = await reach_cli(s, "schedules", "rm", "nightly")
    assert code == 1
    assert "no schedule" in err


async def test_submit_delay_and_dlq_purge(reach_settings: ReachSettings) -> None:
    """`submit --delay` is SCHEDULED with its due time shown; `dlq purge` counts first and
    removes only with the count it showed."""
    s = reach_settings
    agent = Agent("purger", settings=s)

    @agent.task("purge.fail", max_attempts=1)
    async def fail(payload: dict) -> None:
        raise ValueError("no")

    async with agent, Client(settings=s) as client:
        code, out, err = await reach_cli(s, "submit", "purge.later", "1", "--delay", "1h")
        assert code == 0, err
        task_id = out.strip()
        assert (await client.task_record(task_id)).state is TaskState.SCHEDULED
        code, out, err = await reach_cli(s, "tasks", "--state", "scheduled")
        assert code == 0, err
        assert task_id in out
        assert "DUE" in out
        await (await client.task(task_id)).cancel()
        code, out, err = await reach_cli(
            s, "dlq", "purge", "--capability", "purge.fail", "--older-than", "7d"
        )
        assert (code, out.strip(), err) == (0, "no dead letters of purge.fail older than 7d", "")
        for n in range(3):
            await (await client.submit("purge.fail", {"n": n})).wait(timeout=10)
        # a count is what was asked for, not an error
        code, out, err = await reach_cli(s, "dlq", "purge", "--capability", "purge.fail")
        assert (code, out.strip(), err) == (
            0,
            "3 dead letters of purge.fail; to remove them: add --yes 3",
            "",
        )
        code, out, err = await reach_cli(s, "dlq", "purge", "--older-than", "1h", "--yes", "0")
        assert (code, out.strip()) == (
            0,
            "0 dead letters (tasks, callbacks and topics) older than 1h removed",
        ), err
        code, out, err = await reach_cli(
            s, "dlq", "purge", "--capability", "purge.fail", "--yes", "2"
        )
        assert code == 1
        assert "3 dead letters match now, not the 2 expected" in err
        assert await client.count_dead_letters("purge.fail") == 3
        code, out, err = await reach_cli(
            s, "dlq", "purge", "--capability", "purge.fail", "--yes", "3"
        )
        assert (code, out.strip()) == (0, "3 dead letters of purge.fail removed"), err
        assert await client.dead_letters("purge.fail") == []
