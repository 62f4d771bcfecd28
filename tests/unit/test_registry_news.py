"""Which heartbeats carry news (``reach._registry.news``): pure, against a stored record."""

import pytest

from reach._registry.news import is_news, renew_after
from reach.wire import AgentInfo, AgentRecord, Heartbeat, Status


def record(hb: Heartbeat | None, *, max_concurrency: int = 8) -> AgentRecord:
    info = AgentInfo(agent_id="a-1", name="a", max_concurrency=max_concurrency)
    return AgentRecord(info=info, status=Status.UP, heartbeat=hb)


STORED = Heartbeat(agent_id="a-1", seq=1, load=0.25, latency_ms=10.0, queue_len=0)


def beat(**fields: object) -> Heartbeat:
    values: dict[str, object] = {"agent_id": "a-1", "seq": 2, "load": 0.25, "latency_ms": 10.0}
    return Heartbeat(**{**values, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "news"),
    [
        ({}, False),
        ({"served": 100, "failed": 4, "inflight": 2, "dropped": 1, "sent_ms": 9}, False),
        ({"load": 0.34}, False),
        ({"load": 0.35}, True),  # 0.35 - 0.25 is 0.0999... in floats: a step all the same
        ({"load": 0.15}, True),
        ({"latency_ms": 12.4}, False),  # 24%
        ({"latency_ms": 12.5}, True),  # 25% and 2.5 ms
        ({"latency_ms": 7.5}, True),
        ({"queue_len": 1}, True),  # a tenth of 8 is less than one: any move
        ({"status": Status.DEGRADED}, True),
        ({"reason": "queue overload"}, True),
    ],
)
def test_what_is_news(fields: dict[str, object], news: bool) -> None:
    hb = beat(**fields)
    status = hb.status
    assert is_news(record(STORED), hb, status) is news


def test_a_first_heartbeat_is_news() -> None:
    assert is_news(record(None), beat(), Status.UP)


def test_latency_under_a_millisecond_moves_nothing() -> None:
    fast = record(Heartbeat(agent_id="a-1", seq=1, latency_ms=0.4))
    assert not is_news(fast, beat(load=0.0, latency_ms=0.9), Status.UP)  # +125%, 0.5 ms
    assert is_news(fast, beat(load=0.0, latency_ms=1.4), Status.UP)


def test_the_queue_step_grows_with_capacity() -> None:
    wide = record(STORED, max_concurrency=100)
    assert not is_news(wide, beat(queue_len=9), Status.UP)
    assert is_news(wide, beat(queue_len=10), Status.UP)


def test_renewal_age() -> None:
    assert renew_after(15.0, 5.0) == pytest.approx(2.5)  # the defaults: every heartbeat
    assert renew_after(30.0, 5.0) == pytest.approx(7.5)  # one heartbeat in two
    assert renew_after(2.0, 1.0) == pytest.approx(1 / 6)
    assert renew_after(1.0, 3.0) == 0.0
