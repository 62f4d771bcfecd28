"""How often a waiting TaskRef re-reads its record (pure: no server)."""

from reach._tasks.refs import NOTICED_POLL_CAP, UNNOTICED_POLL_CAP, poll_delays


def take(n, delays):
    return [next(delays) for _ in range(n)]


def test_a_ref_that_hears_of_its_end_polls_rarely():
    delays = take(20, poll_delays(noticed=True, jitter=lambda: 1.0))
    assert delays[0] < 1.0  # a lost notice on a quick task costs little
    assert max(delays) == NOTICED_POLL_CAP == 30.0
    assert delays[-5:] == [30.0] * 5
    assert delays == sorted(delays)


def test_a_ref_that_hears_nothing_polls_at_most_every_five_seconds():
    delays = take(20, poll_delays(noticed=False, jitter=lambda: 1.0))
    assert max(delays) == UNNOTICED_POLL_CAP == 5.0
    assert delays == sorted(delays)


def test_jitter_spreads_a_batch_of_waiters_below_the_cap():
    low = take(20, poll_delays(noticed=True, jitter=lambda: 0.5))
    high = take(20, poll_delays(noticed=True, jitter=lambda: 1.0))
    assert all(lo < hi for lo, hi in zip(low, high, strict=True))
    assert max(low) == 15.0
