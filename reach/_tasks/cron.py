"""When a periodic schedule is due: the server's own rules (nats-server's ``cron.go`` and
``@every``, ADR-51), pure and synchronous, so a client can check a schedule before it is
sent, show its next firing, and an agent can tell which periods a firing covers.

A cron line has six fields, seconds first (``0 30 2 * * *``: 02:30:00 every day): each a
``*``, a number, a range ``a-b``, a list ``a,b`` and a step ``*/n`` or ``a-b/n`` (``a/n``:
from a to the end); months and weekdays also by name (``jan``, ``mon``), Sunday is 0.
When both day fields are restricted, a day matching either is due (as ``crontab(5)``).
``@yearly`` (``@annually``), ``@monthly``, ``@weekly``, ``@daily`` (``@midnight``) and
``@hourly`` stand for their lines. Times are in ``tz`` (an IANA zone; UTC by default).
``every`` is whole seconds, at least one: the server's first firing is the schedule's
stored time rounded to the second, plus the interval, and so on from there.

Times are unix milliseconds; every firing time is on a whole second.
"""

from __future__ import annotations

import datetime
import zoneinfo
from dataclasses import dataclass

from ..errors import ConfigurationError

__all__ = ["Cron", "Every", "Timing", "catch_up", "parse_cron", "slots", "timing"]

_PREDEFINED = {
    "@yearly": "0 0 0 1 1 *",
    "@annually": "0 0 0 1 1 *",
    "@monthly": "0 0 0 1 * *",
    "@weekly": "0 0 0 * * 0",
    "@daily": "0 0 0 * * *",
    "@midnight": "0 0 0 * * *",
    "@hourly": "0 0 * * * *",
}
_MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_MONTHS = {m: i + 1 for i, m in enumerate(_MONTH_NAMES)}
_DAYS = {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
#: (name, lowest, highest, names) of the six fields
_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("seconds", 0, 59, {}),
    ("minutes", 0, 59, {}),
    ("hours", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 6, _DAYS),
)
_YEARS = 5  # the server gives up on a line with no time within five years


@dataclass(frozen=True, slots=True)
class Cron:
    """A parsed cron line in a time zone."""

    line: str
    tz: str
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    #: a day field given as ``*`` (or ``?``): then both day fields must match, else either
    any_day: bool

    def header(self) -> str:
        return self.line

    def _day(self, d: datetime.date) -> bool:
        dom = d.day in self.days
        dow = (d.isoweekday() % 7) in self.weekdays
        return (dom and dow) if self.any_day else (dom or dow)

    def next_after(self, ms: int, anchor: int = 0) -> int:
        """The first due time after ``ms`` (from the next whole second on)."""
        del anchor  # a cron line's times do not depend on when it was defined
        zone = zoneinfo.ZoneInfo(self.tz)
        start = datetime.datetime.fromtimestamp(ms // 1000 + 1, zone).replace(tzinfo=None)
        day = start.date()
        for _ in range(366 * _YEARS):
            if day.month in self.months and self._day(day):
                t = self._first_on(day, start, zone)
                if t is not None:
                    return int(t.replace(tzinfo=zone).timestamp()) * 1000
            day += datetime.timedelta(days=1)
        raise ConfigurationError(f"cron {self.line!r} is never due within {_YEARS} years")

    def _first_on(
        self, day: datetime.date, start: datetime.datetime, zone: zoneinfo.ZoneInfo
    ) -> datetime.datetime | None:
        """The first due time on ``day`` at or after ``start`` (local, naive), or None.
        A local time that does not exist (skipped when the clocks go forward) is not due,
        as with the server; one that happens twice (when they go back) is due once, the
        first time."""
        today = day == start.date()
        for h in sorted(self.hours):
            if today and h < start.hour:
                continue
            for m in sorted(self.minutes):
                if today and (h, m) < (start.hour, start.minute):
                    continue
                for s in sorted(self.seconds):
                    t = datetime.datetime(day.year, day.month, day.day, h, m, s)
                    if t >= start and _exists(t, zone):
                        return t
        return None


def _exists(t: datetime.datetime, zone: zoneinfo.ZoneInfo) -> bool:
    """Whether the naive local time ``t`` happens in ``zone`` (it survives a round trip)."""
    at = t.replace(tzinfo=zone).timestamp()
    return datetime.datetime.fromtimestamp(at, zone).replace(tzinfo=None) == t


@dataclass(frozen=True, slots=True)
class Every:
    """A fixed interval of whole seconds."""

    seconds: int

    def header(self) -> str:
        return f"@every {self.seconds}s"

    def next_after(self, ms: int, anchor: int) -> int:
        """The first due time after ``ms`` of a schedule stored at ``anchor`` (unix ms):
        the server's first firing is ``anchor`` rounded to the second plus the interval,
        then one interval after another."""
        step = self.seconds * 1000
        first = (anchor + 500) // 1000 * 1000 + step
        if ms < first:
            return first
        return first + ((ms - first) // step + 1) * step


Timing = Cron | Every


def slots(t: Timing, after: int, until: int, anchor: int, limit: int) -> list[int]:
    """The due times in (``after``, ``until``], at most ``limit`` + 1 of them (the caller
    tells a catch-up beyond its cap by the extra one), oldest first."""
    out: list[int] = []
    at = t.next_after(after, anchor)
    while at <= until and len(out) <= limit:
        out.append(at)
        at = t.next_after(at, anchor)
    return out


#: periods of a cron line counted one by one at most, to tell how many were missed
_COUNT_CAP = 100_000


def catch_up(t: Timing, after: int, until: int, anchor: int, limit: int) -> tuple[list[int], int]:
    """The periods in (``after``, ``until``] to make up: the newest ``limit`` of them,
    oldest first, and how many older ones are missed (for ``every``, counted
    arithmetically; for a cron line, one by one up to ``_COUNT_CAP``)."""
    head = slots(t, after, until, anchor, limit)
    if len(head) <= limit:
        return head, 0
    if isinstance(t, Every):
        step = t.seconds * 1000
        count = (until - head[0]) // step + 1
        first = head[0] + (count - limit) * step
        return [first + i * step for i in range(limit)], count - limit
    # a cron line: look back from ``until`` far enough to hold ``limit`` periods
    window = max(1000, head[-1] - head[0])
    while True:
        low = max(after, until - window)
        tail = slots(t, low, until, anchor, 4 * limit)
        if len(tail) > 4 * limit:
            window = max(1000, window // 2)  # too many to list: look back less far
        elif len(tail) >= limit or low == after:
            break
        else:
            window *= 4
    kept = tail[-limit:]
    missed = 0
    at = head[0]
    while at < kept[0] and missed < _COUNT_CAP:
        missed += 1
        at = t.next_after(at, anchor)
    return kept, missed


def _field(
    text: str, name: str, low: int, high: int, names: dict[str, int]
) -> tuple[set[int], bool]:
    """The values of one field, and whether it holds a plain ``*`` (or ``?``): with a day
    field so, both day fields must match (the server's rule)."""

    def number(word: str) -> int:
        if word.lower() in names:
            return names[word.lower()]
        if not word.isdigit():
            raise ConfigurationError(f"cron {name} field: {word!r} is not a number")
        return int(word)

    values: set[int] = set()
    star = False
    for part in text.split(","):
        span, _, step_text = part.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) == 0:
                raise ConfigurationError(f"cron {name} field: step {step_text!r} must be >= 1")
            step = int(step_text)
        if span in ("*", "?"):
            start, end = low, high
            star = star or step == 1
        else:
            first, dash, second = span.partition("-")
            start = number(first)
            end = number(second) if dash else (high if step_text else start)
        if start < low or end > high or start > end:
            raise ConfigurationError(
                f"cron {name} field: {part!r} is outside {low}-{high} (or its range is reversed)"
            )
        values.update(range(start, end + 1, step))
    return values, star


def parse_cron(line: str, tz: str = "") -> Cron:
    """A cron line (six fields, or ``@daily`` and the like) in zone ``tz`` ("" is UTC);
    ``ConfigurationError`` saying what is wrong."""
    zone = tz or "UTC"
    try:
        zoneinfo.ZoneInfo(zone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigurationError(
            f"tz {tz!r} is not a known time zone (an IANA name, e.g. Europe/Berlin)"
        ) from None
    text = _PREDEFINED.get(line.strip().lower(), line.strip())
    fields = text.split()
    if len(fields) != 6:
        raise ConfigurationError(
            f"cron {line!r} has {len(fields)} fields; give six, seconds first"
            " (second minute hour day-of-month month day-of-week, e.g. '0 0 2 * * *')"
        )
    parsed = [_field(f, *spec) for f, spec in zip(fields, _FIELDS, strict=True)]
    sets = [values for values, _ in parsed]
    return Cron(
        line=line.strip(),
        tz=zone,
        seconds=frozenset(sets[0]),
        minutes=frozenset(sets[1]),
        hours=frozenset(sets[2]),
        days=frozenset(sets[3]),
        months=frozenset(sets[4]),
        weekdays=frozenset(sets[5]),
        any_day=parsed[3][1] or parsed[5][1],
    )


def timing(every: int = 0, cron: str = "", tz: str = "") -> Timing:
    """A schedule's timing from its definition (one of ``every`` and ``cron``)."""
    if every and cron:
        raise ConfigurationError("give every or cron, not both")
    if cron:
        return parse_cron(cron, tz)
    if tz:
        raise ConfigurationError("tz goes with cron only (every counts plain seconds)")
    if every < 1:
        raise ConfigurationError("give every (whole seconds, at least 1) or cron")
    return Every(every)
