"""``patiently``: what it tries again (JetStream not answering yet) and what it does not."""

import time
import types

import nats.errors
import nats.js.errors
import pytest

from reach import ConnectionFailed
from reach._tasks import faults
from reach._tasks.faults import patiently


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(faults, "_FIRST_PAUSE", 0.001)
    monkeypatch.setattr(faults, "_LONGEST_PAUSE", 0.002)


def conn(closed=False):
    return types.SimpleNamespace(is_closed=closed)  # all patiently reads of a connection


def failing(*errors, then="done"):
    calls = []

    async def op():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return then

    return op, calls


def far():
    return time.monotonic() + 60


@pytest.mark.parametrize(
    "error",
    [
        nats.errors.NoRespondersError(),
        nats.errors.TimeoutError(),
        nats.js.errors.NoStreamResponseError(),
        nats.js.errors.ServiceUnavailableError(code=503, err_code=10008),
        nats.js.errors.APIError(code=409, err_code=10158, description="duplicate id in process"),
        nats.errors.ConnectionReconnectingError(),
    ],
)
async def test_not_answering_yet_is_tried_again(error):
    op, calls = failing(error, error)
    assert await patiently(conn(), "op", op, until=far()) == "done"
    assert len(calls) == 3


@pytest.mark.parametrize(
    "error",
    [
        nats.js.errors.BadRequestError(code=400, err_code=10058, description="in use"),
        nats.js.errors.APIError(code=400, err_code=10065, description="subjects overlap"),
        nats.errors.MaxPayloadError(),
        nats.errors.ConnectionClosedError(),
    ],
)
async def test_an_answer_that_refused_or_a_closed_connection_is_final_at_once(error):
    op, calls = failing(error)
    with pytest.raises(type(error)):
        await patiently(conn(), "op", op, until=far())
    assert len(calls) == 1


async def test_a_closed_connection_ends_the_waiting():
    op, calls = failing(nats.errors.NoRespondersError())
    with pytest.raises(nats.errors.NoRespondersError):
        await patiently(conn(closed=True), "op", op, until=far())
    assert len(calls) == 1


async def test_it_gives_up_at_its_deadline_saying_how_often_it_tried():
    op, calls = failing(*[nats.errors.NoRespondersError()] * 1000)
    with pytest.raises(ConnectionFailed, match=r"setup: JetStream did not answer, \d+ tries"):
        await patiently(conn(), "setup", op, until=time.monotonic() + 0.05, advice="; again")
    assert 1 < len(calls) < 1000


async def test_it_stops_when_its_owner_stops():
    op, calls = failing(*[nats.errors.TimeoutError()] * 1000)
    with pytest.raises(ConnectionFailed, match="stopped while waiting"):
        await patiently(conn(), "op", op, until=far(), stopped=lambda: len(calls) >= 3)
    assert len(calls) == 3
