"""The pure parts of task administration and recovery: no server."""

import re

import msgspec
import pytest

from reach import DeadLetter, ReachError
from reach._subjects import Subjects
from reach._tasks.admin import NotReplayable, replay_id
from reach._tasks.recovery import submit_of
from reach._tasks.store import TaskStore, pending_record
from reach.settings import ReachSettings
from reach.wire import Priority
from reach.wire.tasks import TaskSubmit

SUBMIT = TaskSubmit(
    task_id="abc123",
    capability="report.build",
    priority=Priority.HIGH,
    payload=b'{"n": 1}',
    timeout=2.5,
    max_attempts=4,
    idempotency_key="key-1",
    callback="cb.here",
    notify="t.taskdone.x",
    version="2.1",
    required_tags=["gpu"],
    caller="me",
    submitted_ms=1234,
    replay_of="older",
)


def letter(kind: str, data: bytes) -> DeadLetter:
    return DeadLetter(
        seq=7,
        task_id="abc123",
        capability="report.build",
        kind=kind,
        reason="bad_request",
        error="",
        data=data,
    )


def test_a_task_dead_letter_gives_back_its_submit():
    assert letter("task", msgspec.json.encode(SUBMIT)).submit() == SUBMIT


def test_an_undecodable_dead_letter_is_not_replayable():
    with pytest.raises(NotReplayable, match="cannot be replayed") as info:
        letter("task", b"\x00garbage").submit()
    assert isinstance(info.value, ReachError)
    assert info.value.code == "bad_request"


def test_a_callback_dead_letter_is_not_replayable():
    with pytest.raises(NotReplayable, match="not a task"):
        letter("callback", msgspec.json.encode(SUBMIT)).submit()


def test_a_recovered_message_carries_every_field_of_the_submit():
    """The sweep rebuilds a lost message from the record: nothing may be dropped."""
    assert submit_of(pending_record(SUBMIT, 5, 9999)) == SUBMIT


def test_a_replay_id_is_new_valid_and_the_same_for_the_same_dead_letter():
    store = TaskStore(None, Subjects("t1"), ReachSettings())  # names only, no I/O
    first = replay_id(store, 7, "abc123")
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,128}", first)
    assert first != "abc123"
    assert replay_id(store, 7, "abc123") == first
    assert replay_id(store, 8, "abc123") != first
    assert replay_id(TaskStore(None, Subjects("t2"), ReachSettings()), 7, "abc123") != first
