"""The pure half of the A2A endpoint: payloads from parts, task records as A2A tasks (every
state), cards from routing-table records, and Reach errors as A2A errors."""

from __future__ import annotations

import pytest
from a2a.helpers import get_data_parts, get_message_text, new_data_part, new_text_part
from a2a.types import Message, Part, Role, TaskState
from a2a.utils.errors import (
    ContentTypeNotSupportedError,
    InternalError,
    InvalidParamsError,
    TaskNotFoundError,
)
from a2a.utils.proto_utils import validate_proto_required_fields

import reach
from reach._gateway.a2a_cards import card_of, fleet
from reach._gateway.a2a_convert import (
    STATES,
    a2a_errors,
    events_of,
    payload_of,
    result_part,
    task_of,
)
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo, ErrorBody, Status
from reach.wire.tasks import TaskAttempt, TaskRecord
from reach.wire.tasks import TaskState as S

T = TaskState


def message(*parts: Part) -> Message:
    return Message(role=Role.ROLE_USER, message_id="m1", parts=list(parts))


def test_every_reach_state_has_the_a2a_state_of_protocol_md():
    assert STATES == {
        S.SCHEDULED: T.TASK_STATE_SUBMITTED,
        S.PENDING: T.TASK_STATE_SUBMITTED,
        S.RUNNING: T.TASK_STATE_WORKING,
        S.RETRYING: T.TASK_STATE_WORKING,
        S.TIMEOUT: T.TASK_STATE_WORKING,
        S.SUCCEEDED: T.TASK_STATE_COMPLETED,
        S.FAILED: T.TASK_STATE_FAILED,
        S.CANCELLED: T.TASK_STATE_CANCELED,
    }
    assert set(STATES) == set(S)


def test_payloads_from_parts():
    # protobuf keeps numbers as doubles: whole ones come back as ints, at any depth
    data = new_data_part({"n": 3, "x": 1.5, "items": [{"k": 2}], "big": 2.0**60})
    assert payload_of(message(data)) == {"n": 3, "x": 1.5, "items": [{"k": 2}], "big": 2.0**60}
    assert isinstance(payload_of(message(data))["n"], int)
    assert payload_of(message(new_text_part("a"), new_text_part("b"))) == {"text": "a\nb"}
    assert payload_of(message(new_text_part("note"), new_data_part([1]))) == [1]  # data wins
    assert payload_of(message(new_data_part("just a string"))) == "just a string"
    with pytest.raises(InvalidParamsError, match="2 data parts"):
        payload_of(message(new_data_part(1), new_data_part(2)))
    with pytest.raises(ContentTypeNotSupportedError):
        payload_of(message(Part(raw=b"\x00\x01")))


def test_results_as_parts():
    assert result_part(b'"hi"').text == "hi"
    assert get_data_parts([result_part(b'{"a": [1, 2]}')]) == [{"a": [1.0, 2.0]}]
    assert get_data_parts([result_part(b"")]) == [None]
    raw = result_part(b"\xff\xfe not json")
    assert raw.raw == b"\xff\xfe not json"
    assert raw.media_type == "application/octet-stream"


def record(state: S, **kw) -> TaskRecord:
    return TaskRecord(
        task_id="t1",
        capability="text.count",
        state=state,
        payload=b'{"text": "a b"}',
        submitted_ms=1_700_000_000_000,
        updated_ms=1_700_000_001_000,
        **kw,
    )


@pytest.mark.parametrize("state", list(S))
def test_a_record_in_any_state_is_a_valid_a2a_task(state):
    task = task_of(record(state, result=b'{"words": 2}' if state is S.SUCCEEDED else None))
    validate_proto_required_fields(task)
    assert task.id == task.context_id == "t1"
    assert task.status.state == STATES[state]
    assert task.status.timestamp.ToMilliseconds() == 1_700_000_001_000
    assert get_data_parts(task.history[0].parts) == [{"text": "a b"}]
    assert task.metadata["reach"]["state"] == str(state)
    assert len(task.artifacts) == (1 if state is S.SUCCEEDED else 0)
    events = events_of(record(state, result=b"1"))
    assert events[-1].status.state == STATES[state]
    assert len(events) == (2 if state is S.SUCCEEDED else 1)


def test_status_messages_say_why():
    failed = task_of(record(S.FAILED, error=ErrorBody(code="failed", message="boom")))
    assert get_message_text(failed.status.message) == "failed: boom"
    retry = record(
        S.RETRYING,
        attempt=1,
        attempts=[TaskAttempt(n=1, agent_id="a", started_ms=1, ended_ms=2, outcome="timeout")],
    )
    assert get_message_text(task_of(retry).status.message) == "attempt 1 ended timeout; retrying"
    running = task_of(record(S.RUNNING, progress=0.5, progress_note="halfway"))
    assert get_message_text(running.status.message) == "halfway"
    assert not task_of(record(S.PENDING)).status.HasField("message")


def agent(name: str, agent_id: str, status: Status = Status.UP, **info) -> AgentRecord:
    return AgentRecord(
        info=AgentInfo(agent_id=agent_id, name=name, **info), status=status, registered_ms=1
    )


def test_cards_merge_the_instances_of_a_name():
    echo = CapabilityInfo(name="text.echo", version="1.2", description="Echo")
    records = [
        agent("w", "w-1", capabilities=[echo], tags=["gpu"], version="1.0.0"),
        agent(
            "w",
            "w-2",
            capabilities=[echo],
            tasks=[CapabilityInfo(name="text.sum")],
            tags=["eu"],
            metadata={"description": "Writer"},
        ),
        agent("w", "w-3", Status.DOWN, capabilities=[CapabilityInfo(name="text.gone")]),
        agent("dead", "d-1", Status.DOWN, capabilities=[echo]),
    ]
    names = fleet(records)
    assert sorted(names) == ["w"]  # a name with only DOWN instances has no card
    card = card_of(names["w"], "http://gw/a2a/w")
    validate_proto_required_fields(card)
    assert card.description == "Writer"
    skills = {s.id: s for s in card.skills}
    assert sorted(skills) == ["text.echo", "text.sum"]
    assert list(skills["text.echo"].tags) == ["eu", "gpu", "mode:call", "version:1.2"]
    assert list(skills["text.sum"].tags) == ["eu", "mode:task", "version:1.0.0"]  # the default
    assert skills["text.sum"].description == "Reach capability text.sum, run as a durable task."


@pytest.mark.parametrize(
    ("error", "a2a", "code"),
    [
        (reach.TaskNotFound("t1"), TaskNotFoundError, None),
        (reach.BadRequest("bad", capability="c"), InvalidParamsError, "bad_request"),
        (reach.ConfigurationError("too big"), InvalidParamsError, "bad_request"),
        (reach.RequestTimeout("slow", agent_id="a-1"), InternalError, "timeout"),
        (reach.CapabilityNotFound("none"), InternalError, "capability_not_found"),
        (reach.NotStarted("closed"), InternalError, "failed"),
    ],
)
def test_reach_errors_are_a2a_errors(error, a2a, code):
    with pytest.raises(a2a) as info, a2a_errors():
        raise error
    assert info.value.message == str(error)
    if code is not None:
        assert info.value.data["code"] == code
        assert info.value.data["retryable"] == str(error.retryable).lower()
