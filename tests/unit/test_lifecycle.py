"""The agent's lifecycle machine, every transition and refusal, with no server."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reach._agent.lifecycle import Lifecycle, Pause, Reason, State, TimeoutWatch
from reach.wire import Status


def machine() -> tuple[Lifecycle, list[Status]]:
    told: list[Status] = []
    return Lifecycle(told.append), told


def up() -> tuple[Lifecycle, list[Status]]:
    life, told = machine()
    assert life.start()
    assert life.started()
    told.clear()
    return life, told


def test_a_new_agent_is_stopped_and_starts_via_starting():
    life, told = machine()
    assert (life.state, life.status, life.running) == (State.STOPPED, Status.DOWN, False)
    assert life.start()
    assert (life.state, life.status) == (State.STARTING, Status.PAUSED)
    assert life.in_queue_groups
    assert not life.start()  # already running
    assert life.started()
    assert (life.state, life.status) == (State.UP, Status.UP)
    assert not life.started()
    assert told == [Status.PAUSED, Status.UP]


def test_degrade_and_recover_keep_a_set_of_reasons():
    life, told = up()
    assert life.degrade(Reason.OVERLOAD)
    assert not life.degrade(Reason.OVERLOAD)
    assert life.degrade(Reason.TIMEOUTS)
    assert (life.state, life.refuse_high) == (State.DEGRADED, True)
    assert life.recover(Reason.OVERLOAD)
    assert life.state is State.DEGRADED  # timeouts still hold
    assert not life.recover(Reason.OVERLOAD)
    assert life.recover(Reason.TIMEOUTS)
    assert (life.state, life.refuse_high) == (State.UP, False)
    assert told == [Status.DEGRADED, Status.UP]


def test_pause_and_resume():
    life, told = up()
    assert life.pause()
    assert (life.state, life.status, life.refuse_direct) == (State.PAUSED, Status.PAUSED, True)
    assert not life.in_queue_groups
    assert not life.pause()
    assert life.resume()
    assert (life.state, life.refuse_direct) == (State.UP, False)
    assert not life.resume()
    assert told == [Status.PAUSED, Status.UP]


def test_resume_does_not_clear_degraded():
    life, _ = up()
    life.degrade(Reason.TIMEOUTS)
    assert life.pause()
    assert life.state is State.PAUSED  # paused wins while paused
    assert life.resume()
    assert life.state is State.DEGRADED
    assert life.reasons == {Reason.TIMEOUTS}


def test_a_reason_can_come_and_go_while_paused():
    life, told = up()
    life.pause()
    told.clear()
    life.degrade(Reason.OVERLOAD)
    life.recover(Reason.OVERLOAD)
    assert told == []  # still PAUSED on the wire
    life.degrade(Reason.OVERLOAD)
    life.resume()
    assert life.state is State.DEGRADED


def test_paused_while_any_pause_reason_holds():
    life, told = up()
    assert life.pause(Pause.HEALTH)
    assert not life.pause(Pause.OPERATOR)  # already PAUSED: the reason is kept
    assert life.paused_by == {Pause.HEALTH, Pause.OPERATOR}
    assert not life.resumes(Pause.HEALTH)
    assert not life.resume(Pause.HEALTH)  # the operator's pause stays
    assert (life.state, life.paused_by) == (State.PAUSED, {Pause.OPERATOR})
    assert life.resumes(Pause.OPERATOR)
    assert life.resume()  # the operator's, by default
    assert (life.state, life.paused_by) == (State.UP, frozenset())
    assert told == [Status.PAUSED, Status.UP]


def test_an_operator_resume_does_not_undo_a_health_pause():
    life, _ = up()
    life.pause(Pause.HEALTH)
    assert not life.resumes(Pause.OPERATOR)
    assert not life.resume(Pause.OPERATOR)
    assert life.state is State.PAUSED
    assert life.resume(Pause.HEALTH)
    assert life.state is State.UP


def test_pause_reasons_are_forgotten_at_start_and_refused_while_not_serving():
    life, _ = machine()
    life.start()
    assert not life.pause(Pause.HEALTH)  # STARTING
    assert life.paused_by == frozenset()
    life.started()
    life.pause(Pause.OPERATOR)
    life.drain()
    assert not life.pause(Pause.HEALTH)
    assert not life.resume(Pause.OPERATOR)
    life.stopped()
    life.start()
    life.started()
    assert (life.state, life.paused_by) == (State.UP, frozenset())


@pytest.mark.parametrize("before", ["starting", "up", "degraded", "paused"])
def test_drain_from_every_running_state(before):
    life, _ = machine()
    life.start()
    if before != "starting":
        life.started()
    if before == "degraded":
        life.degrade(Reason.OVERLOAD)
    if before == "paused":
        life.pause()
    assert life.drain()
    assert (life.state, life.status, life.refuse_direct) == (State.DRAINING, Status.PAUSED, True)
    assert not life.in_queue_groups
    assert not life.drain()
    assert life.stopped()
    assert (life.state, life.status, life.running) == (State.STOPPED, Status.DOWN, False)


def test_nothing_leaves_draining_but_stopped():
    life, told = up()
    life.degrade(Reason.TIMEOUTS)
    life.drain()
    assert not life.resume()
    assert not life.pause()
    assert not life.started()
    assert not life.start()
    life.recover(Reason.TIMEOUTS)
    assert life.state is State.DRAINING
    assert life.stopped()
    assert not life.stopped()
    assert told == [Status.DEGRADED, Status.PAUSED, Status.DOWN]


def test_start_again_after_stopped_forgets_old_reasons():
    life, _ = up()
    life.degrade(Reason.OVERLOAD)
    life.drain()
    life.stopped()
    assert life.start()
    assert life.started()
    assert life.state is State.UP


def test_stop_from_starting_without_drain():
    life, _ = machine()
    life.start()
    assert life.stopped()
    assert life.state is State.STOPPED


def test_machine_without_listener():
    life = Lifecycle()
    assert life.start()
    assert life.started()
    assert life.status is Status.UP


COMMANDS = [
    "start",
    "started",
    "pause",
    "resume",
    "pause_health",
    "resume_health",
    "drain",
    "stopped",
    "degrade",
    "recover",
]


@given(st.lists(st.sampled_from(COMMANDS), max_size=40))
def test_every_sequence_keeps_the_derived_fields_consistent(commands):
    life, told = machine()
    for command in commands:
        if command in ("degrade", "recover"):
            getattr(life, command)(Reason.OVERLOAD)
        elif command.endswith("_health"):
            getattr(life, command.removesuffix("_health"))(Pause.HEALTH)
        else:
            getattr(life, command)()
        assert life.refuse_high == (life.state is State.DEGRADED)
        assert life.refuse_direct == (life.state in (State.PAUSED, State.DRAINING))
        assert life.running == (life.state is not State.STOPPED)
        if life.state is State.DEGRADED:
            assert life.reasons
        if life.state is State.PAUSED:
            assert life.paused_by
        if life.state in (State.UP, State.DEGRADED):
            assert not life.paused_by
        # the listener heard every change of the advertised status, and only changes
        assert all(a != b for a, b in itertools.pairwise(told))
        assert (told[-1] if told else Status.DOWN) == life.status


def test_timeout_watch_trips_on_three_within_the_window():
    watch = TimeoutWatch(limit=3, window=10.0, recover_after=2)
    assert not watch.timed_out(0.0)
    assert not watch.timed_out(5.0)
    assert not watch.timed_out(11.0)  # the first one left the window
    assert watch.timed_out(12.0)
    assert watch.tripped
    assert not watch.timed_out(13.0)  # already tripped
    assert not watch.succeeded()
    assert watch.timed_out(14.0) is False  # a timeout resets the success run
    assert not watch.succeeded()
    assert watch.succeeded()
    assert not watch.tripped
    assert not watch.timed_out(15.0)


def test_timeout_watch_clears_after_a_quiet_spell_without_any_traffic():
    """Issue 19: DEGRADED set by timeouts stayed for 25 minutes on an agent nobody called:
    only successes cleared it. Time with no new timeout clears it too."""
    watch = TimeoutWatch(limit=3, window=10.0, recover_after=10, quiet=15.0)
    assert not watch.tick(100.0)  # not tripped: nothing to clear
    for t in (0.0, 1.0, 2.0):
        watch.timed_out(t)
    assert watch.tripped
    assert not watch.tick(16.9)  # 14.9 s since the last timeout
    assert watch.timed_out(16.95) is False  # a new one restarts the quiet spell
    assert not watch.tick(31.9)
    assert watch.tick(31.95)
    assert not watch.tripped
    assert not watch.tick(1000.0)  # once
    # it trips again only on `limit` new timeouts, not on the ones before it cleared
    assert not watch.timed_out(1001.0)
    assert not watch.timed_out(1002.0)
    assert watch.timed_out(1003.0)


def test_timeout_watch_says_what_trips_it():
    watch = TimeoutWatch(limit=3, window=10.0, quiet=15.0)
    assert watch.describe() == "handler timeouts: 3 within 10s; UP again after 15s without one"


def test_explain_says_why_the_status_is_what_it_is():
    life, _ = machine()
    assert life.explain() == "stopped"
    life.start()
    assert life.explain() == "starting"
    life.started()
    assert life.explain() == ""  # UP needs no reason
    life.degrade(Reason.TIMEOUTS)
    assert life.explain() == "handler timeouts"
    life.degrade(Reason.OVERLOAD)
    detail = {Reason.TIMEOUTS: "handler timeouts: 3 within 10s"}
    assert life.explain(detail) == "handler timeouts: 3 within 10s; queue overload"
    life.pause()
    life.pause(Pause.HEALTH)
    assert life.explain(detail) == (
        "paused by health check, operator; handler timeouts: 3 within 10s; queue overload"
    )
    life.recover(Reason.TIMEOUTS)
    life.recover(Reason.OVERLOAD)
    assert life.explain() == "paused by health check, operator"
    life.drain()
    assert life.explain() == "draining"


@pytest.mark.parametrize(("interval", "quiet"), [(5.0, 15.0), (0.2, 10.0)])
def test_an_agent_waits_out_the_window_and_three_heartbeats(interval: float, quiet: float):
    """DEGRADED by timeouts ends when neither the 10 s window nor three heartbeats hold a
    new timeout: the registry has seen the DEGRADED status before it clears."""
    from reach import Agent, ReachSettings

    agent = Agent("a", settings=ReachSettings(heartbeat_interval=interval))
    assert agent._workers.timeouts.quiet == quiet
    assert agent.heartbeat().reason == "stopped"
