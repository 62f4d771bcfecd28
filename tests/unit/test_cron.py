"""The server's schedule timing, pure (reach._tasks.cron): cron lines with seconds and a
time zone, ``every``, and the periods a firing covers."""

import argparse
import datetime
import math

import pytest

from reach import ConfigurationError, RetryLater
from reach._cli_common import format_duration, parse_duration
from reach._tasks.cron import Every, catch_up, parse_cron, slots, timing
from reach._tasks.delayed import due_of
from reach._tasks.schedules import spec_of

UTC = datetime.UTC


def ms(*args: int, tz: datetime.tzinfo = UTC) -> int:
    return int(datetime.datetime(*args, tzinfo=tz).timestamp() * 1000)


def test_daily_at_two_in_berlin_follows_its_offset():
    c = parse_cron("0 0 2 * * *", "Europe/Berlin")
    assert c.next_after(ms(2026, 1, 10, 12, 0, 0)) == ms(2026, 1, 11, 1, 0, 0)  # CET +1
    assert c.next_after(ms(2026, 7, 10, 12, 0, 0)) == ms(2026, 7, 11, 0, 0, 0)  # CEST +2


def test_seconds_steps_ranges_names_and_either_day():
    assert parse_cron("*/15 * * * * *").next_after(ms(2026, 1, 1, 0, 0, 1)) == ms(
        2026, 1, 1, 0, 0, 15
    )
    weekdays = parse_cron("0 30 9 * * mon-fri")
    assert weekdays.next_after(ms(2026, 1, 2, 10, 0, 0)) == ms(2026, 1, 5, 9, 30, 0)  # Fri -> Mon
    either = parse_cron("0 0 0 13 * fri")  # the 13th, or any Friday
    assert either.next_after(ms(2026, 2, 1, 0, 0, 0)) == ms(2026, 2, 6, 0, 0, 0)
    assert either.next_after(ms(2026, 2, 7, 0, 0, 0)) == ms(2026, 2, 13, 0, 0, 0)
    assert parse_cron("@hourly").next_after(ms(2026, 1, 1, 5, 0, 0)) == ms(2026, 1, 1, 6, 0, 0)
    assert parse_cron("0 0 0 1 jan *").next_after(ms(2026, 6, 1)) == ms(2027, 1, 1)


def test_from_the_next_whole_second():
    every_second = parse_cron("* * * * * *")
    assert every_second.next_after(ms(2026, 1, 1, 0, 0, 0) + 999) == ms(2026, 1, 1, 0, 0, 1)
    assert every_second.next_after(ms(2026, 1, 1, 0, 0, 0)) == ms(2026, 1, 1, 0, 0, 1)


@pytest.mark.parametrize(
    ("line", "tz", "why"),
    [
        ("0 2 * * *", "", "six"),
        ("0 0 25 * * *", "", "outside 0-23"),
        ("0 0 2 * * *", "Mars/Olympus", "time zone"),
        ("x 0 2 * * *", "", "not a number"),
        ("*/0 * * * * *", "", "step"),
        ("0 0 0 5-1 * *", "", "reversed"),
    ],
)
def test_bad_lines_say_why(line, tz, why):
    with pytest.raises(ConfigurationError, match=why):
        parse_cron(line, tz)


def test_a_line_never_due_is_refused():
    with pytest.raises(ConfigurationError, match="never due"):
        parse_cron("0 0 0 31 2 *").next_after(ms(2026, 1, 1))


def test_every_counts_from_the_stored_time_rounded_to_the_second():
    e = Every(10)
    stored = ms(2026, 1, 1, 0, 0, 0) + 600  # rounds up to :01
    assert e.next_after(0, stored) == ms(2026, 1, 1, 0, 0, 11)
    assert e.next_after(ms(2026, 1, 1, 0, 0, 11), stored) == ms(2026, 1, 1, 0, 0, 21)
    assert e.next_after(ms(2026, 1, 1, 0, 0, 15), stored) == ms(2026, 1, 1, 0, 0, 21)


def test_slots_a_firing_covers_and_the_catch_up_cap():
    e = Every(1)
    start = ms(2026, 1, 1)
    assert slots(e, start, start + 3000, start, 100) == [start + 1000, start + 2000, start + 3000]
    assert slots(e, start + 3000, start + 3000, start, 100) == []
    assert len(slots(e, start, start + 500_000, start, 100)) == 101  # the cap, plus one


def test_timing_takes_one_of_every_and_cron():
    assert timing(5) == Every(5)
    for bad, why in (
        ({"every": 5, "cron": "* * * * * *"}, "not both"),
        ({}, "give every"),
        ({"every": 5, "tz": "UTC"}, "cron only"),
    ):
        with pytest.raises(ConfigurationError, match=why):
            timing(**bad)


def test_catch_up_keeps_the_newest_periods_and_counts_the_rest():
    """A firing after a long outage makes up the newest ``limit`` periods (up to its own
    time), never the oldest, and counts the older ones as missed, exactly."""
    start = ms(2026, 1, 1)
    e = Every(1)
    due, missed = catch_up(e, start, start + 500_000, start, 100)
    assert due == [start + (401 + i) * 1000 for i in range(100)]
    assert due[-1] == start + 500_000
    assert missed == 400
    assert catch_up(e, start, start + 3000, start, 100) == (
        [start + 1000, start + 2000, start + 3000],
        0,
    )
    # a year of every second: still arithmetic
    due, missed = catch_up(e, start, start + 365 * 86_400_000, start, 100)
    assert (len(due), missed, due[-1]) == (100, 365 * 86_400 - 100, start + 365 * 86_400_000)
    # a cron line: every minute for two days
    c = parse_cron("0 * * * * *")
    due, missed = catch_up(c, start, start + 2 * 86_400_000, start, 100)
    assert due == [start + 2 * 86_400_000 - (99 - i) * 60_000 for i in range(100)]
    assert missed == 2 * 1440 - 100


@pytest.mark.parametrize("bad", [math.inf, math.nan, 1e12, -1.0])
def test_waits_must_be_finite_and_at_most_five_years(bad: float) -> None:
    """A delay, a retry later or an interval that is infinite, not a number or beyond
    five years is one clear ConfigurationError, never an OverflowError later."""
    with pytest.raises(ConfigurationError, match="delay must be 0 to"):
        due_of(None, bad, 0)
    with pytest.raises(ConfigurationError, match="after must be 0 to"):
        RetryLater(after=bad)
    with pytest.raises(ConfigurationError, match="every must be whole seconds"):
        spec_of(
            "n",
            "cap.x",
            None,
            every=bad,
            cron=None,
            tz=None,
            priority="normal",
            overlap="allow",
            timeout=None,
            max_attempts=None,
            required_tags=[],
            version=None,
            caller="",
        )


def test_at_more_than_five_years_ahead_is_refused() -> None:
    far = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)
    with pytest.raises(ConfigurationError, match="five years ahead"):
        due_of(far, None, ms(2026, 1, 1))


def test_a_duration_too_long_for_python_is_a_usage_error() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="too long"):
        parse_duration("99999999999d")


@pytest.mark.parametrize(
    ("text", "shown"),
    [("7d", "7d"), ("1h30m", "1h30m"), ("90s", "1m30s"), ("0.5s", "0.5s"), ("0s", "0s")],
)
def test_a_duration_is_shown_as_it_is_written(text: str, shown: str) -> None:
    """``reach dlq purge --older-than 7d`` says "older than 7d", not "7 days, 0:00:00"."""
    assert format_duration(parse_duration(text)) == shown
    assert parse_duration(shown) == parse_duration(text)


BERLIN = "Europe/Berlin"


def test_cron_across_the_spring_transition_skips_the_missing_hour() -> None:
    """2026-03-29 in Berlin: 02:00 CET jumps to 03:00 CEST. A daily 02:30 is not due
    that day (the time does not exist: the server skips it too); an every-15-minutes
    line goes from 01:45 CET straight to 03:00 CEST."""
    daily = parse_cron("0 30 2 * * *", BERLIN)
    before = ms(2026, 3, 28, 12, 0, 0)
    assert daily.next_after(before) == ms(2026, 3, 30, 0, 30, 0)  # 02:30 CEST on the 30th
    quarter = parse_cron("0 */15 * * * *", BERLIN)
    at_0145 = ms(2026, 3, 29, 0, 45, 0)  # 01:45 CET
    assert quarter.next_after(at_0145) == ms(2026, 3, 29, 1, 0, 0)  # 03:00 CEST
    assert slots(quarter, at_0145, ms(2026, 3, 29, 1, 30, 0), 0, 100) == [
        ms(2026, 3, 29, 1, 0, 0),
        ms(2026, 3, 29, 1, 15, 0),
        ms(2026, 3, 29, 1, 30, 0),
    ]


def test_cron_across_the_autumn_transition_fires_once_at_the_first_time() -> None:
    """2026-10-25 in Berlin: 03:00 CEST goes back to 02:00 CET, so 02:00-02:59 happens
    twice. A daily 02:30 is due once, the first time (00:30 UTC), then on the 26th."""
    daily = parse_cron("0 30 2 * * *", BERLIN)
    first = daily.next_after(ms(2026, 10, 24, 12, 0, 0))
    assert first == ms(2026, 10, 25, 0, 30, 0)  # 02:30 CEST
    assert daily.next_after(first) == ms(2026, 10, 26, 1, 30, 0)  # 02:30 CET, next day
