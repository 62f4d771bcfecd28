"""The agent's lifecycle: one small, pure state machine and the only place status changes.

::

    STOPPED --start--> STARTING --started--> UP <--degrade/recover--> DEGRADED
                                             |  ^                        |
                                       pause |  | resume (back to UP or DEGRADED)
                                             v  |                        |
                                            PAUSED <------pause----------+
    STARTING, UP, DEGRADED, PAUSED --drain--> DRAINING --stopped--> STOPPED

DEGRADED is UP with a non-empty set of reasons (queue overload, handler timeouts, a
failing outside health check). The reasons survive a pause, so ``resume`` returns to
DEGRADED while they last. PAUSED has reasons too (``Pause``: an operator, a failing health
check): it lasts while any is held, so neither undoes the other's pause. Nothing leaves
DRAINING but ``stopped``: ``resume`` is refused while the agent stops. The wire status is
derived: DRAINING and STARTING advertise PAUSED (nothing new is routed there), STOPPED
advertises DOWN; ``explain`` says why, for people (the heartbeat's ``reason``). The machine
does no I/O; the Agent owns it, performs the effects, and is told of every advertised
change through ``on_change`` (it then heartbeats at once).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping

from ..wire import Status

__all__ = ["TIMEOUT_WINDOW", "Lifecycle", "Pause", "Reason", "State", "TimeoutWatch"]

#: seconds within which ``TimeoutWatch.limit`` handler timeouts make an agent DEGRADED
TIMEOUT_WINDOW = 10.0


class State(enum.StrEnum):
    STARTING = "STARTING"
    UP = "UP"
    DEGRADED = "DEGRADED"
    PAUSED = "PAUSED"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"


class Reason(enum.StrEnum):
    """Why an agent is DEGRADED (several may hold at once)."""

    OVERLOAD = "queue overload"
    TIMEOUTS = "handler timeouts"
    STUCK = "handlers stuck past their deadline"
    HEALTH = "health check failing"  # an outside signal: Agent.report_health


class Pause(enum.StrEnum):
    """Who paused an agent (it stays PAUSED while any of them holds)."""

    OPERATOR = "operator"  # Agent.pause/resume, `reach pause`, $ctl
    HEALTH = "health check"  # Agent.report_health(False, pause=True)


_WIRE = {
    State.STARTING: Status.PAUSED,
    State.UP: Status.UP,
    State.DEGRADED: Status.DEGRADED,
    State.PAUSED: Status.PAUSED,
    State.DRAINING: Status.PAUSED,
    State.STOPPED: Status.DOWN,
}


class Lifecycle:
    """Where the agent is in its life. Every transition returns whether it was taken.

    ``state``, ``status``, ``refuse_high`` and ``refuse_direct`` are read-only attributes
    (plain attributes, not properties: the request path reads them per request).
    """

    __slots__ = (
        "_on_change",
        "_pauses",
        "_phase",
        "_reasons",
        "refuse_direct",
        "refuse_high",
        "state",
        "status",
    )

    def __init__(self, on_change: Callable[[Status], None] | None = None) -> None:
        self._on_change = on_change
        self._phase = State.STOPPED  # STARTING, UP, PAUSED, DRAINING or STOPPED
        self._reasons: set[Reason] = set()
        self._pauses: set[Pause] = set()
        self.state = State.STOPPED
        self.status = Status.DOWN
        self.refuse_high = False  # DEGRADED: high priority goes to an UP instance
        self.refuse_direct = False  # PAUSED or DRAINING: direct callers go elsewhere

    @property
    def reasons(self) -> frozenset[Reason]:
        return frozenset(self._reasons)

    @property
    def paused_by(self) -> frozenset[Pause]:
        return frozenset(self._pauses)

    @property
    def running(self) -> bool:
        """Started and not yet stopped (STARTING through DRAINING)."""
        return self._phase is not State.STOPPED

    @property
    def in_queue_groups(self) -> bool:
        """Should the agent be in its capabilities' queue groups?"""
        return self._phase is State.STARTING or self._phase is State.UP

    def start(self) -> bool:
        """STOPPED -> STARTING. A second start while running is refused."""
        if self._phase is not State.STOPPED:
            return False
        self._reasons.clear()
        self._pauses.clear()
        return self._go(State.STARTING)

    def started(self) -> bool:
        """STARTING -> UP (or DEGRADED): subscribed and flushed, ready to be announced."""
        return self._phase is State.STARTING and self._go(State.UP)

    def pause(self, by: Pause = Pause.OPERATOR) -> bool:
        """Hold ``by``'s pause while UP, DEGRADED or PAUSED; True when this one made the
        agent PAUSED (it was not already)."""
        if self._phase is not State.UP and self._phase is not State.PAUSED:
            return False
        self._pauses.add(by)
        return self._phase is State.UP and self._go(State.PAUSED)

    def resumes(self, by: Pause = Pause.OPERATOR) -> bool:
        """Would ``resume(by)`` make the agent UP (or DEGRADED)? No other pause holds."""
        return self._phase is State.PAUSED and self._pauses <= {by}

    def resume(self, by: Pause = Pause.OPERATOR) -> bool:
        """Drop ``by``'s pause; PAUSED -> UP (or DEGRADED while a reason holds) when no
        other pause is left. True when that happened; refused unless PAUSED."""
        if self._phase is not State.PAUSED:
            return False
        self._pauses.discard(by)
        return not self._pauses and self._go(State.UP)

    def drain(self) -> bool:
        """Anything running -> DRAINING (stop, ``$ctl drain`` or a signal asked)."""
        if self._phase is State.DRAINING or self._phase is State.STOPPED:
            return False
        return self._go(State.DRAINING)

    def stopped(self) -> bool:
        """-> STOPPED, from wherever (the connection is closed)."""
        if self._phase is State.STOPPED:
            return False
        return self._go(State.STOPPED)

    def degrade(self, reason: Reason) -> bool:
        """Record a reason; UP becomes DEGRADED. True if the reason is new."""
        if reason in self._reasons:
            return False
        self._reasons.add(reason)
        self._update()
        return True

    def recover(self, reason: Reason) -> bool:
        """Drop a reason; DEGRADED becomes UP when none is left. True if it was held."""
        if reason not in self._reasons:
            return False
        self._reasons.discard(reason)
        self._update()
        return True

    def explain(self, detail: Mapping[Reason, str] | None = None) -> str:
        """Why the agent advertises its status, in a few words for people: empty when UP;
        the reasons held (``detail`` may word them with numbers), who paused it, or the
        phase it is in."""
        phase = self._phase
        if phase is State.STARTING or phase is State.DRAINING or phase is State.STOPPED:
            return phase.value.lower()
        words = detail or {}
        parts = [words.get(r, r.value) for r in sorted(self._reasons)]
        if phase is State.PAUSED:
            parts.insert(0, "paused by " + ", ".join(sorted(self._pauses)))
        return "; ".join(parts)

    def _go(self, phase: State) -> bool:
        self._phase = phase
        self._update()
        return True

    def _update(self) -> None:
        state = self._phase
        if state is State.UP and self._reasons:
            state = State.DEGRADED
        self.state = state
        self.refuse_high = state is State.DEGRADED
        self.refuse_direct = state is State.PAUSED or state is State.DRAINING
        status = _WIRE[state]
        if status is not self.status:
            self.status = status
            if self._on_change is not None:
                self._on_change(status)


class TimeoutWatch:
    """Handler timeouts as a health signal: ``limit`` of them within ``window`` seconds trip
    it; ``recover_after`` successes in a row (with no timeout between), or ``quiet`` seconds
    with no timeout at all (``tick``: an agent nobody calls has no successes), reset it.
    Pure: time comes in as ``now`` (monotonic seconds)."""

    __slots__ = (
        "_last",
        "_successes",
        "_times",
        "limit",
        "quiet",
        "recover_after",
        "tripped",
        "window",
    )

    def __init__(
        self,
        limit: int = 3,
        window: float = TIMEOUT_WINDOW,
        recover_after: int = 10,
        quiet: float = TIMEOUT_WINDOW,
    ) -> None:
        self.limit = limit
        self.window = window
        self.recover_after = recover_after
        self.quiet = quiet
        self.tripped = False
        self._times: deque[float] = deque(maxlen=limit)
        self._successes = 0
        self._last = 0.0  # when the newest timeout came

    def describe(self) -> str:
        """What tripped the watch and what clears it, for people."""
        return (
            f"handler timeouts: {self.limit} within {self.window:g}s;"
            f" UP again after {self.quiet:g}s without one"
        )

    def timed_out(self, now: float) -> bool:
        """Count one timeout; True when this one trips the watch."""
        self._successes = 0
        self._last = now
        self._times.append(now)
        while self._times and self._times[0] < now - self.window:
            self._times.popleft()
        if self.tripped or len(self._times) < self.limit:
            return False
        self.tripped = True
        return True

    def succeeded(self) -> bool:
        """Count one success while tripped; True when the watch recovers."""
        self._successes += 1
        if self._successes < self.recover_after:
            return False
        self._reset()
        return True

    def tick(self, now: float) -> bool:
        """Time passes: True when the watch recovers because no timeout came for ``quiet``
        seconds (the agent calls it at every heartbeat)."""
        if not self.tripped or now - self._last < self.quiet:
            return False
        self._reset()
        return True

    def _reset(self) -> None:
        self.tripped = False
        self._successes = 0
        self._times.clear()
