import asyncio

from hypothesis import given
from hypothesis import strategies as st

from reach import Priority
from reach._agent.scheduler import PriorityQueue, WorkQueue
from reach.testing import eventually

H, N, L = Priority.HIGH, Priority.NORMAL, Priority.LOW


def test_high_before_normal_before_low_fifo_within_level():
    q: PriorityQueue[str] = PriorityQueue(10)
    for prio, item in [(L, "l1"), (N, "n1"), (H, "h1"), (L, "l2"), (H, "h2"), (N, "n2")]:
        assert q.push(prio, item)
    assert [q.pop() for _ in range(6)] == ["h1", "h2", "n1", "n2", "l1", "l2"]
    assert q.pop() is None


def test_full_queue_refuses_without_queueing():
    q: PriorityQueue[int] = PriorityQueue(2)
    assert q.push(L, 1)
    assert q.push(L, 2)
    assert not q.push(H, 3)
    assert len(q) == 2
    assert list(q.drain()) == [1, 2]


@given(st.lists(st.tuples(st.sampled_from([H, N, L]), st.integers())))
def test_pop_order_is_stable_sort_by_priority(items):
    q: PriorityQueue[tuple[Priority, int]] = PriorityQueue(len(items))
    for prio, value in items:
        assert q.push(prio, (prio, value))
    rank = {H: 0, N: 1, L: 2}
    assert list(q.drain()) == sorted(items, key=lambda t: rank[t[0]])


async def test_work_queue_hands_items_to_waiting_workers():
    wq: WorkQueue[str] = WorkQueue(1)
    getter = asyncio.ensure_future(wq.get())
    await eventually(lambda: wq.idle == 1)
    assert wq.offer(L, "direct")
    assert await getter == "direct"
    assert len(wq) == 0
    assert wq.offer(L, "queued")
    assert not wq.offer(H, "refused")
    assert await wq.get() == "queued"
