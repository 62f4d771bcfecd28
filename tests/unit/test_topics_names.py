"""Durable topics without a server: consumer names, `--since`, and what an agent refuses."""

import argparse
import datetime
import re

import pytest

from reach import Agent, ConfigurationError, NotStored, ReachError
from reach._cli_topics import parse_since
from reach._subjects import Subjects
from reach._topics.store import covers, topic_consumer_name


def test_consumer_names_are_valid_readable_and_one_to_one():
    names = {
        topic_consumer_name(group, pattern)
        for group in ("alarm", "alarm-eu", "Alarm_2")
        for pattern in ("sensor.>", "sensor.*", "sensor_>", "sensor.all", "a.b.c", "a_b.c")
    }
    assert len(names) == 18
    for name in names:
        assert re.fullmatch(r"[A-Za-z0-9_-]+", name), name  # one subject token, no . * >
        assert len(name) <= 128
    assert topic_consumer_name("alarm", "sensor.>").startswith("alarm-sensor_all-")
    long = topic_consumer_name("a" * 128, "x." * 60 + ">")
    assert len(long) <= 64 + 1 + 48 + 1 + 12


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10m", datetime.timedelta(minutes=10)),
        ("90s", datetime.timedelta(seconds=90)),
        ("1h30m", datetime.timedelta(hours=1, minutes=30)),
        ("7d", datetime.timedelta(days=7)),
        ("0.5h", datetime.timedelta(minutes=30)),
        ("42", 42),
        ("2026-05-01T08:00", datetime.datetime(2026, 5, 1, 8, 0)),
        ("2026-05-01T08:00+02:00", datetime.datetime.fromisoformat("2026-05-01T08:00+02:00")),
    ],
)
def test_since_takes_a_duration_a_sequence_or_a_time(text, expected):
    assert parse_since(text) == expected


@pytest.mark.parametrize("text", ["0", "-5", "10x", "yesterday", "", "m10"])
def test_since_refuses_anything_else_saying_what_it_takes(text):
    with pytest.raises(argparse.ArgumentTypeError, match="duration before now"):
        parse_since(text)


def test_ordered_needs_durable_and_one_durable_handler_per_pattern():
    agent = Agent("alarm")
    with pytest.raises(ConfigurationError, match="needs durable=True"):
        agent.on_topic("sensor.>", ordered=True)

    @agent.on_topic("sensor.>", durable=True)
    async def first(report: dict) -> None:
        return None

    with pytest.raises(ConfigurationError, match="already has a durable handler"):
        agent.on_topic("sensor.>", durable=True)

    @agent.on_topic("sensor.>")  # a plain one beside it is another thing
    async def plain(report: dict) -> None:
        return None


def test_not_stored_is_a_reach_error_with_its_reason():
    exc = NotStored("x", topic="sensor.a", reason="timeout")
    assert isinstance(exc, ReachError)
    assert (exc.code, exc.topic, exc.reason, exc.retryable) == (
        "not_stored",
        "sensor.a",
        "timeout",
        True,
    )
    assert NotStored("x", reason="refused").retryable is False


def test_topic_dead_letters_and_replays_have_subjects_no_capability_can_take():
    s = Subjects("reach")
    assert s.topic_dlq("sensor.a") == "reach.dlq.$topic.sensor.a"
    assert s.topic_redo("alarm-sensor_all-0123456789ab", "sensor.a") == (
        "reach.topicredo.alarm-sensor_all-0123456789ab.sensor.a"
    )


@pytest.mark.parametrize(
    ("wide", "narrow", "expected"),
    [
        ("r.topic.>", "r.topic.sensor.>", True),
        ("r.topic.>", "r.topic.a", True),
        ("r.topic.>", "r.topic", False),
        ("r.topic.kept.>", "r.topic.sensor.>", False),
        ("r.topic.kept.>", "r.topic.kept.*", True),
        ("r.topic.kept.>", "r.topic.*.x", False),
        ("r.topic.*", "r.topic.a", True),
        ("r.topic.*", "r.topic.*", True),
        ("r.topic.*", "r.topic.>", False),
        ("r.topic.*", "r.topic.a.b", False),
        ("r.topic.a", "r.topic.a", True),
        ("r.topic.a", "r.topic.*", False),
    ],
)
def test_covers_says_whether_a_subject_filter_holds_another(wide, narrow, expected):
    assert covers(wide, narrow) is expected
