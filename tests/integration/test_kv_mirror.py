"""The one bucket mirror: no leaked watchers, no rebuilds of an idle bucket, a dead watch
noticed, nothing after stop, and a rebuild asked for after a reconnect is not merged into
an older one."""

import asyncio

import nats
import nats.js.errors
import pytest

from reach._background import Background
from reach._kv import BucketMirror, KvEntry, agents_bucket
from reach._wait import eventually
from reach.testing import unique_prefix


class Sink:
    def __init__(self):
        self.values: dict[str, bytes | None] = {}
        self.snapshots = 0

    def replace(self, snapshot: dict[str, KvEntry]) -> None:
        self.snapshots += 1
        self.values = {k: e.value for k, e in snapshot.items()}

    def update(self, key: str, entry: KvEntry) -> None:
        self.values[key] = entry.value


class SpyWatcher:
    def __init__(self, watcher):
        self.watcher = watcher
        self.stopped = False
        self.muted = False

    async def stop(self):
        self.stopped = True
        await self.watcher.stop()

    def __aiter__(self):
        return self._items()

    async def _items(self):
        """The watcher's items, or none while ``muted``: a watch that stays alive and
        says nothing (as nats-py's can after a reconnect)."""
        async for item in self.watcher:
            if not self.muted:
                yield item


class SpyKV:
    """A real bucket whose watchers and status calls the test can see."""

    def __init__(self, kv):
        self.kv = kv
        self.watchers: list[SpyWatcher] = []
        self.status_calls = 0
        self.entered = 0  # watch opens begun (held ones included)
        self.hold: asyncio.Event | None = None

    async def watchall(self, **kwargs):
        self.entered += 1
        if self.hold is not None:
            await self.hold.wait()
        watcher = SpyWatcher(await self.kv.watchall(**kwargs))
        self.watchers.append(watcher)
        return watcher

    async def watch(self, keys, **kwargs):
        watcher = SpyWatcher(await self.kv.watch(keys, **kwargs))
        self.watchers.append(watcher)
        return watcher

    async def status(self):
        self.status_calls += 1
        return await self.kv.status()


@pytest.fixture
async def bucket(nats_server):
    nc = await nats.connect(nats_server.url)
    name = unique_prefix() + "_mirror"
    kv = await agents_bucket(nc.jetstream(), name, create=True)
    await kv.put("a", b"1")
    spy = SpyKV(kv)
    spy.stream = f"KV_{name}"
    yield nc, spy
    await nc.close()


def mirror(spy, sink, owner, **kwargs):
    async def bind():
        return spy

    return BucketMirror(bind, sink, owner, name="test mirror", **kwargs)


async def test_rebuilds_cut_short_by_their_timeout_leak_no_watcher(bucket):
    nc, spy = bucket
    owner = Background("test")
    m = mirror(spy, Sink(), owner)
    for timeout in [0.0005, 0.001, 0.002, 0.004] * 5:
        await m.rebuild(timeout)
    assert await m.rebuild(5.0)
    await m.stop()
    await eventually(lambda: all(w.stopped for w in spy.watchers))
    await owner.close()
    assert [w for w in spy.watchers if not w.stopped] == []

    async def nobody_listens():
        # A watcher that nats-py subscribed but never handed back keeps its consumer bound.
        infos = await nc.jetstream().consumers_info(spy.stream)
        return not any(i.push_bound for i in infos)

    await eventually(nobody_listens)


async def test_an_idle_bucket_is_not_rebuilt_and_a_dead_watch_is(bucket):
    _, spy = bucket
    owner = Background("test")
    sink = Sink()
    m = mirror(spy, sink, owner, silence_limit=0.15)
    assert await m.start(5.0)
    await eventually(lambda: spy.status_calls >= 4)
    assert m.rebuilds == 1  # silent, but the bucket did not change either
    await spy.watchers[-1].watcher.stop()  # the watch dies behind the mirror's back
    await spy.kv.put("b", b"2")
    await eventually(lambda: sink.values.get("b") == b"2")
    assert m.rebuilds >= 2
    await m.stop()
    await owner.close()


async def test_a_filtered_watch_is_not_rebuilt_for_other_keys_and_a_dead_one_is(bucket):
    """A mirror of some keys (a client following one capability's routes) asks for the
    newest sequence of its keys only: the rest of the bucket moving while it is silent is
    not a reason to rebuild; its own keys moving while it is silent is."""
    nc, spy = bucket
    js = nc.jetstream()
    subject = f"$KV.{spy.stream[3:]}.x.*"
    asked: list[int] = []

    async def last_of():
        try:
            msg = await js.get_last_msg(spy.stream, subject)
        except nats.js.errors.NotFoundError:
            return 0
        asked.append(msg.seq)
        return msg.seq

    owner = Background("test")
    sink = Sink()
    m = mirror(spy, sink, owner, silence_limit=0.15, keys="x.*", last_of=last_of)
    await spy.kv.put("x.k", b"1")
    assert await m.start(5.0)
    assert sink.values == {"x.k": b"1"}
    spy.watchers[-1].muted = True  # alive, and silent from now on
    for n in range(20):  # other keys move all along, each check
        await spy.kv.put("y.k", str(n).encode())
        await eventually(lambda n=n: len(asked) > n)
    assert m.rebuilds == 1
    assert not m.stale
    assert spy.status_calls == 0  # the filtered look is one read, no bucket status
    await spy.kv.put("x.k", b"2")  # its own keys move while it is silent
    await eventually(lambda: sink.values.get("x.k") == b"2")
    assert m.rebuilds >= 2
    await m.stop()
    await owner.close()


async def test_mirrors_sharing_a_gate_rebuild_so_many_at_once(bucket):
    """A reconnect asks every view of a client to rebuild; with a shared gate of 2, two
    open their watch while the others wait, then the rest follow."""
    _, spy = bucket
    owner = Background("test")
    gate = asyncio.Semaphore(2)
    mirrors = [mirror(spy, Sink(), owner, gate=gate) for _ in range(6)]
    for m in mirrors:
        assert await m.start(5.0)
    assert spy.entered == 6
    spy.hold = asyncio.Event()
    for m in mirrors:
        m.rebuild_soon()
    # without the gate all six would enter at once: 12, never 8
    await eventually(lambda: spy.entered == 8)
    assert gate.locked()  # the other four wait at it while the two are held
    spy.hold.set()
    await eventually(lambda: spy.entered == 12 and all(m.rebuilds == 2 for m in mirrors))
    for m in mirrors:
        await m.stop()
    await owner.close()


async def test_nothing_is_rebuilt_after_stop(bucket):
    _, spy = bucket
    owner = Background("test")
    m = mirror(spy, Sink(), owner)
    assert await m.start(5.0)
    await m.stop()
    m.rebuild_soon()
    assert not await m.rebuild(5.0)
    await owner.close()
    assert len(spy.watchers) == 1
    assert spy.watchers[0].stopped


async def test_a_rebuild_asked_for_during_another_gets_its_own(bucket):
    _, spy = bucket
    owner = Background("test")
    m = mirror(spy, Sink(), owner)
    spy.hold = asyncio.Event()
    first = asyncio.ensure_future(m.rebuild(5.0))
    await eventually(lambda: m.rebuilds == 1)
    second = asyncio.ensure_future(m.rebuild(5.0))
    third = asyncio.ensure_future(m.rebuild(5.0))
    spy.hold.set()
    assert await asyncio.gather(first, second, third) == [True, True, True]
    assert m.rebuilds == 2  # the second and third share one, begun after they asked
    await m.stop()
    await owner.close()


async def test_a_reconnect_during_a_background_rebuild_gets_one_more(bucket):
    _, spy = bucket
    owner = Background("test")
    m = mirror(spy, Sink(), owner)
    spy.hold = asyncio.Event()
    m.rebuild_soon()  # a first reconnect
    await eventually(lambda: m.rebuilds == 1)
    m.rebuild_soon()  # a second one, while the first rebuild is under way
    spy.hold.set()
    await eventually(lambda: m.rebuilds == 2 and not m.stale)
    await m.stop()
    await owner.close()


async def test_a_watchdog_whose_cancel_was_swallowed_ends_at_stop(bucket):
    """nats-py on Python 3.11 can swallow a cancel (its asyncio.wait_for returns a reply
    that came as the cancel did): the watchdog then ran on forever, and ``stop`` (which
    awaited it with no bound) with it: a registry or client that never closed. The
    watchdog now ends at its next look at the stop."""
    _, spy = bucket
    owner = Background("test")
    m = mirror(spy, Sink(), owner, silence_limit=0.15)
    asked, swallowed = asyncio.Event(), 0
    status = spy.status

    async def swallowing_status():
        nonlocal swallowed
        if swallowed:
            return await status()
        asked.set()
        try:
            await asyncio.Event().wait()  # as a request whose reply is on its way
        except asyncio.CancelledError:
            swallowed += 1  # ... and came at the same moment as the cancel (once)
        return await status()

    assert await m.start(5.0)
    spy.status = swallowing_status  # the bucket is idle: the watchdog asks its status
    await asyncio.wait_for(asked.wait(), 30)
    watchdog = m._watchdog
    assert watchdog is not None
    try:
        async with asyncio.timeout(20):  # (it hung here)
            await m.stop()
        assert swallowed == 1
        assert watchdog.done()  # ended, not left behind
    finally:
        await owner.close(timeout=5)
