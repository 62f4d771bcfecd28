"""Load that accounts for every item: requests timed against their own deadlines, durable
tasks followed to their end, and one ``Result`` from both ledgers (p99 of the requests)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from pathlib import Path
from typing import Any

import reach

from ..harness import Ledger, Result

__all__ = ["HANG", "RequestLoad", "TaskLoad", "account", "examples", "executions"]

#: a request or submit still running this long past its own deadline is "hung": counted,
#: and given up on so that the scenario ends
HANG = 30.0
#: seconds a load's ``stop`` (or ``settle``) waits beyond the guards of its calls: a guard
#: works by cancelling, and a cancel nats-py swallowed must not hold the scenario forever
SLACK = 10.0


async def ended(task: asyncio.Future[Any], within: float) -> bool:
    """Wait at most ``within`` seconds for ``task``; if it runs on (a guard's cancel was
    lost), cancel it and wait as long again. True if it ended by itself (its error, if any,
    is raised)."""
    done, _ = await asyncio.wait({task}, timeout=within)
    if done:
        task.result()
        return True
    task.cancel()
    await asyncio.wait({task}, timeout=within)
    return False


class RequestLoad:
    """``concurrency`` callers of ``capability``, one request after another, until
    ``stop()``. Each request is timed against its ``timeout``: ``worst_overrun`` is the
    most any took past it, ``overdue`` how many took more than ``slack`` past it. An error
    that is not a ``ReachError`` is ``unclear`` (counted by type, and failed)."""

    def __init__(
        self,
        client: reach.Client,
        capability: str,
        ledger: Ledger,
        *,
        concurrency: int = 8,
        timeout: float = 3.0,
        pause: float = 0.005,
        slack: float = 1.0,
    ) -> None:
        self.client = client
        self.capability = capability
        self.ledger = ledger
        self.concurrency = concurrency
        self.timeout = timeout
        self.pause = pause
        self.slack = slack
        self.overdue = 0
        self.worst_overrun = 0.0
        self.unclear: Counter[str] = Counter()
        #: the first message of each error code, for the notes
        self.examples: dict[str, str] = {}
        #: (monotonic end, seconds taken) of every answer; monotonic times of every failure
        self.answers: list[tuple[float, float]] = []
        self.failed_at: list[float] = []
        #: answers by the agent that gave them (the ``by`` of ``chaos.echo``)
        self.by: Counter[str] = Counter()
        self._stop = asyncio.Event()
        self._task: asyncio.Future[Any] | None = None

    def start(self) -> RequestLoad:
        self._task = asyncio.ensure_future(
            asyncio.gather(*(self._caller(n) for n in range(self.concurrency)))
        )
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None and not await ended(
            self._task, self.timeout + HANG + self.pause + SLACK
        ):
            self.unclear["caller hung past its guard"] += 1

    def failed_between(self, start: float, end: float = float("inf")) -> int:
        return sum(start <= t < end for t in self.failed_at)

    def answered_since(self, start: float) -> int:
        return sum(t >= start for t, _ in self.answers)

    def slowest_between(self, start: float, end: float = float("inf")) -> float:
        """The longest time an answer took, of those that came between ``start`` and
        ``end`` (seconds; 0 if none)."""
        return max((took for t, took in self.answers if start <= t < end), default=0.0)

    async def _caller(self, n: int) -> None:
        ledger, i = self.ledger, 0
        while not self._stop.is_set():
            i += 1
            ledger.sent += 1
            started = time.perf_counter()
            try:
                async with asyncio.timeout(self.timeout + HANG):
                    # the echo may run twice: a timed-out attempt may go to another instance
                    value = await self.client.request(
                        self.capability,
                        {"caller": n, "i": i},
                        timeout=self.timeout,
                        idempotent=True,
                    )
            except reach.ReachError as exc:
                ledger.refused(exc.code)
                self.examples.setdefault(exc.code, str(exc)[:160])
                self.failed_at.append(time.monotonic())
            except TimeoutError:  # our guard, not the request's deadline: it hung
                ledger.refused("hung")
                self.unclear["hung"] += 1
                self.failed_at.append(time.monotonic())
            except Exception as exc:  # counted and reported: the goal is clear errors only
                ledger.refused(f"unclear {type(exc).__name__}")
                self.unclear[type(exc).__name__] += 1
                self.failed_at.append(time.monotonic())
            else:
                took = time.perf_counter() - started
                ledger.answered(took)
                self.answers.append((time.monotonic(), took))
                self.by[value.get("by", "?") if isinstance(value, dict) else "?"] += 1
            took = time.perf_counter() - started
            self.worst_overrun = max(self.worst_overrun, took - self.timeout)
            if took > self.timeout + self.slack:
                self.overdue += 1
            await asyncio.sleep(self.pause)

    def per_phase(self, marks: list[tuple[str, float]]) -> str:
        """Failed requests in each phase; ``marks`` are (name, monotonic start), in order."""
        ends = [t for _, t in marks[1:]] + [float("inf")]
        return "failed requests by phase: " + ", ".join(
            f"{name} {self.failed_between(t, end)}"
            for (name, t), end in zip(marks, ends, strict=True)
        )

    def notes(self) -> str:
        return (
            f"worst request {self.worst_overrun * 1000:+.0f} ms past its {self.timeout:.1f} s"
            f" deadline, {self.overdue} more than {self.slack:.1f} s past"
        )


class TaskLoad:
    """Durable tasks of ``capability`` submitted one after another until ``stop()``; then
    ``settle()`` follows each to its end. In the ledger: SUCCEEDED is ok; a submit that
    raised a ``ReachError`` is failed with its code (it said so); a task that ended
    otherwise is failed as ``task <STATE>``; one with no end within ``settle``'s timeout
    is neither: lost. ``accepted_at`` (monotonic) gives the write gaps."""

    def __init__(
        self,
        client: reach.Client,
        capability: str,
        ledger: Ledger,
        *,
        job_ms: int = 20,
        pause: float = 0.02,
    ) -> None:
        self.client = client
        self.capability = capability
        self.ledger = ledger
        self.job_ms = job_ms
        self.pause = pause
        self.refs: list[reach.TaskRef] = []
        self.accepted_at: list[float] = []
        self.unclear: Counter[str] = Counter()
        #: the first message of each error code, for the notes
        self.examples: dict[str, str] = {}
        self.ended: Counter[str] = Counter()
        #: the final record of every task that ended (after ``settle``)
        self.records: list[reach.TaskRecord] = []
        self.started_at = 0.0
        self.stopped_at = 0.0
        self._stop = asyncio.Event()
        self._task: asyncio.Future[None] | None = None

    def start(self) -> TaskLoad:
        self.started_at = time.monotonic()
        self._task = asyncio.ensure_future(self._submitter())
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None and not await ended(self._task, HANG + self.pause + SLACK):
            self.unclear["submitter hung past its guard"] += 1
        self.stopped_at = time.monotonic()

    async def _submitter(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.ledger.sent += 1
            try:
                async with asyncio.timeout(HANG):
                    ref = await self.client.submit(self.capability, {"n": n, "ms": self.job_ms})
            except reach.ReachError as exc:
                self.ledger.refused(f"submit {exc.code}")
                self.examples.setdefault(exc.code, str(exc)[:160])
            except TimeoutError:
                self.ledger.refused("submit hung")
                self.unclear["submit hung"] += 1
            except Exception as exc:  # counted and reported: the goal is clear errors only
                self.ledger.refused(f"submit unclear {type(exc).__name__}")
                self.unclear[type(exc).__name__] += 1
            else:
                self.refs.append(ref)
                self.accepted_at.append(time.monotonic())
            await asyncio.sleep(self.pause)

    def longest_gap(self, start: float | None = None, end: float | None = None) -> float:
        """The longest time without an accepted submit between ``start`` and ``end``
        (default: while the load ran)."""
        lo = self.started_at if start is None else start
        hi = self.stopped_at if end is None else end
        marks = [lo, *(t for t in self.accepted_at if lo < t < hi), hi]
        return max(b - a for a, b in itertools.pairwise(marks))

    def accepted_since(self, start: float) -> int:
        return sum(t >= start for t in self.accepted_at)

    async def settle(self, timeout: float = 120.0, concurrency: int = 32) -> None:
        """Wait for every accepted task's end (all within ``timeout`` in all; a wait that
        runs on past it, and past the at least 1 s each later one gets, is given up on:
        counted as ``wait hung``, with no end)."""
        gate = asyncio.Semaphore(concurrency)
        deadline = time.monotonic() + timeout

        async def one(ref: reach.TaskRef) -> None:
            async with gate:
                try:
                    rec = await ref.wait(timeout=max(1.0, deadline - time.monotonic()))
                except reach.RequestTimeout:
                    self.ended["no end"] += 1
                    return  # lost: neither ok nor failed
                except reach.ReachError as exc:
                    self.ended[f"unreadable {exc.code}"] += 1
                    return
            self.ended[str(rec.state)] += 1
            self.records.append(rec)
            if rec.state is reach.TaskState.SUCCEEDED:
                self.ledger.answered(max(0, rec.updated_ms - rec.submitted_ms) / 1000)
            else:
                self.ledger.refused(f"task {rec.state}")

        if not self.refs:
            return
        waits = asyncio.gather(*(one(ref) for ref in self.refs))
        if not await ended(waits, timeout + len(self.refs) / concurrency + SLACK):
            self.ended["wait hung"] += len(self.refs) - sum(self.ended.values())


def examples(*loads: RequestLoad | TaskLoad) -> list[str]:
    """One note per error code seen: what the first error of that code said."""
    out = []
    for load in loads:
        kind = "request" if isinstance(load, RequestLoad) else "submit"
        out += [f"first {kind} {code}: {text}" for code, text in load.examples.items()]
    return out


def executions(runs: Path) -> Counter[str]:
    """Executions per task id, from the files ``agent_proc.py`` creates."""
    return Counter(p.name.rsplit(".", 2)[0] for p in runs.glob("*.*.*"))


def account(result: Result, requests: Ledger, tasks: Ledger, runs: Path | None = None) -> Result:
    """Requests and tasks into one result; p99 of the requests; duplicates from ``runs``."""
    for kind, ledger in (("requests", requests), ("tasks", tasks)):
        failed = sum(ledger.failed.values())
        lost = ledger.sent - ledger.ok - failed
        result.sent += ledger.sent
        result.ok += ledger.ok
        result.failed += failed
        result.lost += lost
        codes = ", ".join(f"{k} {v}" for k, v in sorted(ledger.failed.items()))
        result.notes.append(
            f"{kind}: sent {ledger.sent}, ok {ledger.ok}, failed {failed}"
            f"{' (' + codes + ')' if codes else ''}, lost {lost}"
        )
    result.p99_ms = requests.quantile(0.99) * 1000
    if runs is not None:
        result.duplicated = sum(n - 1 for n in executions(runs).values())
    return result
