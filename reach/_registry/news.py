"""Which heartbeats a registry writes: those that carry news, and lease renewals. Pure.

Every write is an acked compare-and-set into the leases bucket that every client then
reads, so a heartbeat that only repeats what is stored is not written (it is counted in
``heartbeats_unwritten``). Against the record stored (not the previous heartbeat, so a
slow drift is written once it adds up), a heartbeat is news when:

- no heartbeat is stored yet, or its status or ``reason`` differs (what routing obeys,
  what people read);
- ``load`` moved by 0.1 or more (``LOAD_STEP``). Routing reads load inside a cost factor
  of 1 to 3 (``balanced``: latency x (1 + load + queued/capacity)) or a score out of 16
  (``scored``: 4 x (1 - load)), so 0.1 moves either by a few percent at most; and load
  moves in steps of 1/max_concurrency, so at the default 8 one request more or fewer in
  flight is written;
- ``queue_len`` moved by a tenth of max_concurrency, and at least by 1 (``QUEUE_STEP``):
  the same step of the same cost factor;
- ``latency_ms`` moved by 25% of the stored value and by 1 ms or more (``LATENCY_SHARE``,
  ``LATENCY_FLOOR_MS``): latency multiplies the cost, so its ratio is what counts, and a
  move under a millisecond is below what one request over NATS tells apart.

Counters (``served``, ``failed``, ``inflight``, ``seq``) ride along with the next write.

A heartbeat without news is still written when the lease is due: older than
R = lease_ttl/3 - heartbeat_interval/2 (``renew_after``). Why a live agent's lease then
never expires: call L the lease and I the interval. An agent heartbeats at least every I
(it takes the registry's interval, or its own when shorter); say heartbeats arrive less
than 1.25 I apart (a quarter of an interval late at most). The age a replica reads is not
under the true one (``Heartbeats.lease_age``; with replicas on hosts whose clocks differ,
by the watch's delay at most, milliseconds). So from age R on, every heartbeat that
arrives is written; and L - R = 2L/3 + I/2, which is 2.5 I or more for L >= 3 I (the
defaults are 15 s and 5 s): two heartbeats arrive between the renewal falling due and the
expiry, so one lost heartbeat, or one failed write, never lets a live agent's lease
expire. Writing every heartbeat gave the same at L = 3 I.

What that saves depends on L / I: a steady agent is written about every ceil(R / I)
heartbeats. At the default L = 3 I, R = I/2 is shorter than any regular gap, so every
heartbeat still renews; a lease longer than 4.5 I saves writes (6 I: one heartbeat in
two is written, 9 I: one in three).
"""

from __future__ import annotations

from ..wire import AgentRecord, Heartbeat, Status

__all__ = [
    "LATENCY_FLOOR_MS",
    "LATENCY_SHARE",
    "LOAD_STEP",
    "QUEUE_STEP",
    "is_news",
    "renew_after",
]

LOAD_STEP = 0.1
QUEUE_STEP = 0.1  # of max_concurrency
LATENCY_SHARE = 0.25
LATENCY_FLOOR_MS = 1.0
_EPSILON = 1e-9  # 0.35 - 0.25 is 0.0999... in floats: a step is taken as written


def renew_after(lease_ttl: float, heartbeat_interval: float) -> float:
    """The age (seconds) from which any heartbeat renews a lease."""
    return max(0.0, lease_ttl / 3 - heartbeat_interval / 2)


def is_news(stored: AgentRecord, hb: Heartbeat, status: Status) -> bool:
    """Whether ``hb`` (reporting ``status``) changes what routing or people read of
    ``stored``."""
    old = stored.heartbeat
    if old is None or stored.status != status or old.reason != hb.reason:
        return True
    if abs(hb.load - old.load) >= LOAD_STEP - _EPSILON:
        return True
    queue_step = max(1.0, QUEUE_STEP * stored.info.max_concurrency)
    if abs(hb.queue_len - old.queue_len) >= queue_step - _EPSILON:
        return True
    moved = abs(hb.latency_ms - old.latency_ms) + _EPSILON
    return moved >= LATENCY_FLOOR_MS and moved >= LATENCY_SHARE * old.latency_ms
