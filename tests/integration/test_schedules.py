"""Periodic schedules on the server's own scheduler (sdk/PROTOCOL.md 8.9): every period
is one task with its own id and record, across a server restart; cron lines with a time
zone; overlap "skip"; pause, resume, replace and remove."""

from __future__ import annotations

import asyncio
import datetime
import zoneinfo
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import reach
from reach import Agent, Client, ReachSettings, Registry, TaskState, Telemetry
from reach.testing import NatsServer, eventually, unique_prefix

S = TaskState


class Runs:
    """Every run of a scheduled task: (task id, schedule, due ms), in order."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str, int]] = []

    def agent(self, settings: ReachSettings, cap: str) -> Agent:
        agent = Agent("scheduled", settings=settings)

        @agent.task(cap)
        async def op(payload: Any, ctx: reach.TaskContext) -> Any:
            rec = await ctx.client.task_record(ctx.task_id)
            self.runs.append((ctx.task_id, rec.schedule, rec.due_ms))
            return payload

        return agent

    def of(self, name: str) -> list[tuple[str, int]]:
        return [(t, due) for t, s, due in self.runs if s == name]


@pytest.fixture
async def own_server() -> AsyncIterator[NatsServer]:
    async with NatsServer() as server:
        yield server


async def test_every_second_across_a_server_restart(own_server: NatsServer) -> None:
    """PROTOCOL 8.8 promise 9 (one task per period, a missed period made up): an every=1s
    schedule over 10 s gives its 10 periods, each run once, across a server restart in
    the middle: the periods the server missed while it was away are
    made up from the next firing, and no period runs twice."""
    settings = ReachSettings(nats_url=own_server.url, subject_prefix=unique_prefix())
    runs = Runs()
    async with runs.agent(settings, "sched.tick"), Client(settings=settings) as client:
        info = await client.schedule("tick", "sched.tick", {"n": 1}, every=1)
        first = info.next_ms
        assert first is not None
        end = first + 9000  # ten periods: first .. first + 9 s

        def covered(until: int) -> bool:
            return any(due >= until for _, due in runs.of("tick"))

        await eventually(lambda: covered(first + 3000), timeout=10)
        await own_server.akill()
        await asyncio.sleep(2.5)  # the outage itself (periods are due meanwhile)
        await own_server.astart()
        await eventually(lambda: covered(end), timeout=30)
        assert await client.unschedule("tick")
        ids = [t for t, _ in runs.of("tick")]
        assert len(ids) == len(set(ids)), f"a period ran twice: {Counter(ids).most_common(3)}"
        dues = sorted(due for _, due in runs.of("tick") if due <= end)
        assert dues == list(range(first, end + 1, 1000)), "a period was missed"
        assert all(t == f"tick_{due // 1000}" for t, due in runs.of("tick"))
        rec = await client.task_record(ids[0])
        assert (rec.schedule, rec.state) == ("tick", S.SUCCEEDED)
        assert await client.schedules() == []


async def test_cron_with_a_time_zone_is_listed_with_its_next_firing(
    reach_settings: ReachSettings,
) -> None:
    """A cron line with a time zone is accepted and listed, with its next firing (02:00 in
    Berlin, whatever the offset that day); a bad line or zone is refused saying why."""
    async with Client(settings=reach_settings) as client:
        info = await client.schedule(
            "nightly", "sched.report", {"kind": "daily"}, cron="0 0 2 * * *", tz="Europe/Berlin"
        )
        assert info.next_due is not None
        local = info.next_due.astimezone(zoneinfo.ZoneInfo("Europe/Berlin"))
        assert (local.hour, local.minute, local.second) == (2, 0, 0)
        now = datetime.datetime.now(datetime.UTC)
        assert now < info.next_due <= now + datetime.timedelta(days=1, hours=1)
        (listed,) = await client.schedules()
        assert (listed.name, listed.capability, listed.when) == (
            "nightly",
            "sched.report",
            "cron 0 0 2 * * * (Europe/Berlin)",
        )
        assert listed.next_ms == info.next_ms
        with pytest.raises(reach.ConfigurationError, match="time zone"):
            await client.schedule("bad", "sched.report", cron="0 0 2 * * *", tz="Mars/Olympus")
        with pytest.raises(reach.ConfigurationError, match="six"):
            await client.schedule("bad", "sched.report", cron="0 2 * * *")
        with pytest.raises(reach.ConfigurationError, match="whole seconds"):
            await client.schedule("bad", "sched.report", every=0.5)
        assert await client.unschedule("nightly")
        assert not await client.unschedule("nightly")


async def test_overlap_skip_starts_no_period_while_one_runs(
    reach_settings: ReachSettings,
) -> None:
    """With overlap="skip" a period due while the previous one runs is recorded CANCELLED
    (``skipped``) and never runs; once the run ends, the next period runs."""
    gate = asyncio.Event()
    started: list[str] = []
    agent = Agent("skipper", settings=reach_settings)

    @agent.task("sched.slow")
    async def slow(payload: Any, ctx: reach.TaskContext) -> Any:
        started.append(ctx.task_id)
        await gate.wait()
        return None

    async with agent, Client(settings=reach_settings) as client:
        await client.schedule("slow", "sched.slow", None, every=1, overlap="skip")
        await eventually(lambda: len(started) == 1, timeout=10)

        async def skipped() -> list[reach.TaskRecord]:
            recs = await client.list_tasks(state="cancelled")
            return [r for r in recs if r.schedule == "slow"]

        async def two_skipped() -> bool:
            return len(await skipped()) >= 2

        await eventually(two_skipped, timeout=10)
        assert len(started) == 1
        for rec in await skipped():
            assert rec.error is not None
            assert rec.error.code == "skipped"
            assert not rec.attempts
        gate.set()
        await eventually(lambda: len(started) >= 2, timeout=10)
        await client.unschedule("slow")
        ran = set(started)
        assert ran.isdisjoint({r.task_id for r in await skipped()})


async def test_pause_resume_and_replace(reach_settings: ReachSettings) -> None:
    """A paused schedule fires nothing (a second schedule, every second too, shows the
    time passing) and is listed as paused; resumed, it fires again; scheduling the same
    name again replaces it (its payload)."""
    runs = Runs()
    witness: list[str] = []
    agent = runs.agent(reach_settings, "sched.p")

    @agent.task("sched.witness")
    async def seen(payload: Any, ctx: reach.TaskContext) -> None:
        witness.append(ctx.task_id)

    async with agent, Client(settings=reach_settings) as client:
        await client.schedule("p", "sched.p", {"v": 1}, every=1)
        await client.schedule("w", "sched.witness", None, every=1)
        await eventually(lambda: len(runs.of("p")) >= 1, timeout=10)
        paused = await client.pause_schedule("p")
        assert paused.paused
        assert paused.next_ms is None
        before = len(runs.of("p"))
        mark = len(witness)
        await eventually(lambda: len(witness) >= mark + 3, timeout=10)
        assert len(runs.of("p")) <= before + 1  # at most one firing already on its way
        (listed,) = [s for s in await client.schedules() if s.name == "p"]
        assert listed.paused
        at_pause = len(runs.of("p"))
        resumed = await client.resume_schedule("p")
        assert not resumed.paused
        assert resumed.next_ms is not None
        await eventually(lambda: len(runs.of("p")) >= at_pause + 2, timeout=10)
        await client.schedule("p", "sched.p", {"v": 2}, every=1)
        count = len(runs.of("p"))
        await eventually(lambda: len(runs.of("p")) >= count + 2, timeout=10)
        last = runs.of("p")[-1][0]
        assert (await client.task_record(last)).payload == b'{"v":2}'
        assert {s.name for s in await client.schedules()} == {"p", "w"}
        for name in ("p", "w"):
            assert await client.unschedule(name)


async def test_schedule_telemetry(reach_settings: ReachSettings) -> None:
    """The registry's sweep counts schedules (active, paused) and SCHEDULED tasks; an
    agent counts the periods it made into tasks."""
    settings = reach_settings.model_copy(update={"task_sweep_interval": 0.2})
    metrics, agent_metrics = CollectorRegistry(), CollectorRegistry()
    runs = Runs()
    agent = Agent("counted", settings=settings, telemetry=Telemetry(agent_metrics))

    @agent.task("sched.counted")
    async def op(payload: Any) -> None:
        runs.runs.append(("", "", 0))

    async with (
        agent,
        Registry(settings=settings, telemetry=Telemetry(metrics)),
        Client(settings=settings) as client,
    ):
        await client.submit("sched.later", None, delay=3600)
        await client.submit("sched.later", None, delay=3600)
        await client.schedule("on", "sched.counted", None, every=1)
        await client.schedule("off", "sched.counted", None, cron="@daily")
        await client.pause_schedule("off")

        def gauge(name: str, **labels: str) -> float | None:
            return metrics.get_sample_value(name, labels)

        await eventually(lambda: gauge("reach_tasks", state="SCHEDULED") == 2, timeout=10)
        await eventually(lambda: gauge("reach_schedules", state="active") == 1, timeout=10)
        assert gauge("reach_schedules", state="paused") == 1
        await eventually(lambda: len(runs.runs) >= 1, timeout=10)
        made = agent_metrics.get_sample_value(
            "reach_agent_schedule_firings_total", {"agent": "counted", "outcome": "made"}
        )
        assert made is not None
        assert made >= 1
        for name in ("on", "off"):
            await client.unschedule(name)


class _Firing:
    """A firing of schedule ``name`` stored at ``at`` (what ``fire`` reads of one, and
    how it settles it: acked, or naked to be tried again)."""

    def __init__(self, name: str, at_ms: int, subject: str = "") -> None:
        from types import SimpleNamespace

        self.subject = subject or f"firing.{name}"
        self.headers = {"Reach-Schedule": name}
        stamp = datetime.datetime.fromtimestamp(at_ms / 1000, datetime.UTC)
        self.metadata = SimpleNamespace(
            timestamp=stamp, num_delivered=1, sequence=SimpleNamespace(stream=1)
        )
        self.acked = 0
        self.naked = 0

    async def ack(self) -> None:
        self.acked += 1

    async def nak(self, delay: float | None = None) -> None:
        self.naked += 1


async def test_unschedule_while_a_firing_is_handled(reach_settings: ReachSettings) -> None:
    """An unschedule that lands between a firing's read of what was covered and its
    compare-and-set: the firing loses the write, sees the schedule gone and stops; it
    never makes the schedule's periods again from its start. Forced in order: a firing
    covering three periods, a second one whose write the removal beats."""
    from reach._tasks import schedules as sch
    from reach._tasks.execute import Executor
    from reach._tasks.model import TaskStats

    async with Client(settings=reach_settings) as client:
        info = await client.schedule("rm-race", "rm.cap", None, every=1)
        store = await client._tasks.ready(client.nc)
        ex = Executor("rm-agent", client.nc, store, TaskStats())
        first = info.next_ms
        await sch._fire(ex, _Firing("rm-race", first + 2000))  # type: ignore[arg-type]
        assert ex.stats.fired == 3
        real = store.idem_renew

        async def removed_first(*args: Any, **kwargs: Any) -> int:
            store.idem_renew = real  # type: ignore[method-assign]
            assert await sch.remove(store, "rm-race")
            return await real(*args, **kwargs)

        store.idem_renew = removed_first  # type: ignore[method-assign]
        await sch._fire(ex, _Firing("rm-race", first + 3000))  # type: ignore[arg-type]
        assert ex.stats.fired == 4, "periods made again after the schedule was removed"
        await sch._fire(ex, _Firing("rm-race", first + 5000))  # type: ignore[arg-type]
        assert ex.stats.fired == 4  # a late firing of a removed schedule is dropped


async def test_a_request_the_server_refuses_is_a_configuration_error(
    reach_settings: ReachSettings,
) -> None:
    """A request JetStream answers with a refusal (400: here a schedule pattern it does
    not take) is ConfigurationError with the server's reason, never connection_failed;
    a cron line that is never due is refused before anything is sent; a dead-letter
    count or purge takes an exact capability name, never a wildcard."""
    from reach._tasks.faults import task_errors

    async with Client(settings=reach_settings) as client:
        store = await client._tasks.ready(client.nc)
        await store.ensure_schedules()
        target = store.subjects.schedule_fire("refused", "x.y", "normal")
        headers = {"Nats-Schedule": "@every 0s", "Nats-Schedule-Target": target}
        with (
            pytest.raises(reach.ConfigurationError, match=r"the server refused it: .*invalid"),
            task_errors("schedule refused"),
        ):
            await store.publish(store.subjects.schedule("refused"), b"{}", headers)
        with pytest.raises(reach.ConfigurationError, match="never due"):
            await client.schedule("feb30", "x.y", None, cron="0 0 2 30 2 *")
        for bad in ("a b", "x.*", ">"):
            with pytest.raises(reach.ConfigurationError, match="dead letters of"):
                await client.count_dead_letters(bad)
            with pytest.raises(reach.ConfigurationError, match="dead letters of"):
                await client.purge_dead_letters(bad)


async def test_a_firing_put_back_and_one_of_a_broken_definition(
    reach_settings: ReachSettings,
) -> None:
    """A firing put back as a new message (its ``Nats-*`` headers gone) is still known as
    a firing, by its subject and ``Reach-Schedule``; a firing whose stored definition no
    firing can use (a cron line never due, stored by hand) is logged and dropped (acked),
    never tried again forever."""
    from reach._tasks import schedules as sch
    from reach._tasks.execute import Executor
    from reach._tasks.model import TaskStats
    from reach.wire.tasks import ScheduleSpec

    async with Client(settings=reach_settings) as client:
        store = await client._tasks.ready(client.nc)
        subject = store.subjects.schedule_fire("feb31", "x.y", "normal")
        requeued = _Firing("feb31", 0, subject)  # Reach-Schedule only, no Nats-Scheduler
        assert sch.is_firing(requeued)  # type: ignore[arg-type]
        assert not sch.is_firing(_Firing("feb31", 0))  # type: ignore[arg-type]
        # the server refuses such a line: the body says it, the headers fire every 60 s
        spec = ScheduleSpec(name="feb31", capability="x.y", cron="0 0 0 31 2 *", created_ms=1)
        fires = ScheduleSpec(name="feb31", capability="x.y", every=60, created_ms=1)
        await store.ensure_schedules()
        await store.publish(
            store.subjects.schedule("feb31"), sch._encode(spec), sch._headers(store, fires)
        )
        ex = Executor("broken-agent", client.nc, store, TaskStats())
        await sch.fire(ex, requeued)  # type: ignore[arg-type]
        assert requeued.acked == 1
        assert ex.stats.fired == 0


async def test_a_firing_whose_task_is_refused_for_good_is_dropped_not_retried(
    reach_settings: ReachSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A firing whose task JetStream refuses for good (400, here: the task message is over
    the stream's max_msg_size, lowered after the schedule was stored) is dropped: acked,
    logged once, counted (``outcome="dropped"``), never put back to be refused again
    every second forever."""
    from reach._tasks import schedules as sch
    from reach._tasks.execute import Executor
    from reach._tasks.model import TaskStats

    async with Client(settings=reach_settings) as client:
        info = await client.schedule("refused", "refused.cap", "x" * 4000, every=3600)
        assert info.next_ms is not None
        store = await client._tasks.ready(client.nc)
        js = client.nc.jetstream()
        config = (await js.stream_info(store.stream)).config
        config.max_msg_size = 2048
        await js.update_stream(config)
        ex = Executor("refused-agent", client.nc, store, TaskStats())
        firing = _Firing("refused", info.next_ms)
        with caplog.at_level("WARNING", logger="reach.tasks"):
            await sch.fire(ex, firing)  # type: ignore[arg-type]
        assert (firing.acked, firing.naked) == (1, 0), "a refusal for good was put back"
        assert (ex.stats.fired, ex.stats.firings_dropped, ex.stats.handed_back) == (0, 1, 0)
        said = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 1, said
        assert said[0].levelname == "ERROR"
        config.max_msg_size = -1
        await js.update_stream(config)
        assert await client.unschedule("refused")


async def test_counting_schedules_and_delayed_tasks_costs_a_few_requests(
    reach_settings: ReachSettings,
) -> None:
    """What each sweep exports (``reach_tasks{state="SCHEDULED"}``, ``reach_schedules``)
    and ``reach status`` shows is counted by the server: not from a subject map with one
    entry per waiting task (STREAM.INFO's, which the server cuts at 100,000 subjects, so
    the count was short beyond), nor with one direct get per schedule definition. Measured
    on a connection of its own: a few requests and a few KB, however many there are; the
    counts are exact (a paused definition counted once, as paused)."""
    import nats

    from reach._tasks.counts import census
    from reach._tasks.schedules import count_scheduled, count_schedules
    from reach._tasks.store import TaskStore
    from reach._tasks.submit import publish_task

    waiting, active, paused = 2000, 40, 20
    async with Client(settings=reach_settings) as client:
        store = await client._tasks.ready(client.nc)
        await store.ensure_schedules()
        due = int(datetime.datetime.now(datetime.UTC).timestamp() * 1000) + 3_600_000
        spec = {
            "priority": "normal",
            "timeout": None,
            "max_attempts": None,
            "idempotency_key": None,
            "callback": None,
            "required_tags": (),
            "version": None,
            "due_ms": due,
        }
        subs = [client._tasks.spec("count.later", {"n": n}, **spec) for n in range(waiting)]
        for i in range(0, waiting, 200):
            await asyncio.gather(*(publish_task(store, s) for s in subs[i : i + 200]))
        for n in range(active + paused):
            await client.schedule(f"s{n}", "count.cap", None, every=3600)
        for n in range(paused):
            await client.pause_schedule(f"s{n}")
        nc = await nats.connect(reach_settings.nats_url)
        try:
            counting = TaskStore(nc.jetstream(), client.subjects, reach_settings, nc=nc)
            before = dict(nc.stats)
            assert await count_scheduled(counting) == waiting
            got = nc.stats["in_bytes"] - before["in_bytes"]
            assert got < 8_000, f"{got} bytes read to count {waiting} delayed tasks"
            before = dict(nc.stats)
            assert await count_schedules(counting) == {"active": active, "paused": paused}
            asked = nc.stats["out_msgs"] - before["out_msgs"]
            assert asked <= 3, f"{asked} requests to count {active + paused} schedules"
            taken = await census(counting)
            assert taken is not None
            assert (taken.scheduled, taken.schedules) == (waiting, active + paused)
        finally:
            await nc.close()
        for n in range(active + paused):
            assert await client.unschedule(f"s{n}")


async def test_two_agents_serving_a_schedule_make_one_task_per_period(
    reach_settings: ReachSettings,
) -> None:
    """docs/schedules.md "Exactly once per period": with two agents serving the schedule
    at once, each period is one task, run once. First forced: once three periods are
    due, two agents handle the same firing at the same time (both read what was covered
    before either writes, and both publish each period's task): each of the three
    periods has one task message (its id is the message id). Then live: two agents take an every=1s
    schedule's firings for four periods; each period runs once, none is missed."""
    from reach._tasks import schedules as sch
    from reach._tasks.execute import Executor
    from reach._tasks.model import TaskStats

    async with Client(settings=reach_settings) as client:
        info = await client.schedule("pair", "pair.idle", None, every=1)  # nobody serves it
        assert info.next_ms is not None
        store = await client._tasks.ready(client.nc)
        fired = store.subjects.schedule_fire("pair", "pair.idle", "normal")

        async def three_due() -> bool:  # the server fired them: their tasks go out at once
            return await store.count(fired) >= 3

        await eventually(three_due, timeout=30)
        a = Executor("agent-a", client.nc, store, TaskStats())
        b = Executor("agent-b", client.nc, store, TaskStats())
        firing = _Firing("pair", info.next_ms + 2000)
        await asyncio.gather(sch._fire(a, firing), sch._fire(b, firing))  # type: ignore[arg-type]
        assert await client.unschedule("pair")
        for due in range(info.next_ms, info.next_ms + 2001, 1000):
            task_id = sch.firing_id("pair", due)
            assert await store.count(store.subjects.task_lookup(task_id)) == 1, task_id
        assert a.stats.fired + b.stats.fired >= 3

    runs = Runs()
    async with (
        runs.agent(reach_settings, "pair.cap"),
        runs.agent(reach_settings, "pair.cap"),
        Client(settings=reach_settings) as client,
    ):
        info = await client.schedule("live", "pair.cap", None, every=1)
        first = info.next_ms
        assert first is not None
        end = first + 3000
        await eventually(lambda: any(due >= end for _, due in runs.of("live")), timeout=30)
        assert await client.unschedule("live")
        ids = [t for t, _ in runs.of("live")]
        assert len(ids) == len(set(ids)), f"a period ran twice: {Counter(ids).most_common(3)}"
        dues = sorted(due for _, due in runs.of("live") if due <= end)
        assert dues == list(range(first, end + 1, 1000)), "a period was missed"
