"""No request outlives its deadline: 10,000 requests with random deadlines, answered fast,
late or never, while the client's connection is cut again and again (a TCP proxy between
the client and nats-server resets every connection it carries, at random moments)."""

import asyncio
import random
import time

import nats
from nats.aio.msg import Msg

import reach
from chaos.proxy import Proxy
from reach import Client
from reach._subjects import Subjects  # the queue group's names, as an agent forms them

#: how late a request may end, past its deadline, beyond the event loop's own lateness
GRACE = 0.050


async def _loop_lateness(stop: asyncio.Event, worst: list[float]) -> None:
    """How late the event loop runs what is due (the machine's load, not the client's)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        due = loop.time() + 0.005
        await asyncio.sleep(0.005)
        worst[0] = max(worst[0], loop.time() - due)


async def test_no_request_waits_past_its_deadline_under_reconnects(reach_settings):
    rng = random.Random(19)
    proxy = await Proxy(reach_settings.nats_url).start()
    url = proxy.url
    # The responder is plain nats-py: it answers at once, late or never, and knows nothing
    # of deadlines (an agent would answer "timeout" itself at the caller's deadline, which
    # would hide the client's own timer). A quarter go unanswered in time: too few to open
    # the capability's breaker, which would end requests at once.
    responder = await nats.connect(reach_settings.nats_url)
    subjects = Subjects(reach_settings.subject_prefix)
    loop = asyncio.get_running_loop()

    async def answer(msg: Msg) -> None:
        roll = rng.random()
        if roll < 0.75:
            await responder.publish(msg.reply, b"{}")
        elif roll < 0.9:  # late, or just in time
            loop.call_later(rng.uniform(0.0, 0.6), _reply_later, responder, msg.reply)

    await responder.subscribe(subjects.cap("churn.work"), cb=answer)
    await responder.flush()
    stop = asyncio.Event()
    lateness = [0.0]
    late: list[float] = []
    outcomes: dict[str, int] = {}
    try:
        # the capability's breaker half-opens at once: it ends requests without a wait,
        # which would leave fewer of them to test
        settings = reach_settings.model_copy(update={"breaker_cooldown": 0.01})
        async with Client(url, settings=settings) as client:
            watch = asyncio.create_task(_loop_lateness(stop, lateness))

            async def one(i: int) -> None:
                timeout = rng.uniform(0.05, 0.5)
                loop = asyncio.get_running_loop()
                started = loop.time()
                try:
                    await client.request("churn.work", {}, timeout=timeout)
                    outcome = "ok"
                except reach.ReachError as exc:
                    outcome = exc.code
                late.append(loop.time() - started - timeout)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

            async def churn() -> None:
                while not stop.is_set():
                    await asyncio.sleep(rng.uniform(0.05, 0.4))  # a fault at a random moment
                    proxy.cut()

            cutter = asyncio.create_task(churn())
            window = asyncio.Semaphore(200)

            async def bounded(i: int) -> None:
                async with window:
                    await one(i)

            started = time.monotonic()
            await asyncio.wait_for(
                asyncio.gather(*(bounded(i) for i in range(10_000))), timeout=120
            )
            stop.set()
            await asyncio.gather(cutter, watch)
            assert client.footprint()["pending"] == 0
    finally:
        stop.set()
        await responder.close()
        await proxy.close()
    assert len(late) == 10_000
    assert proxy.cuts >= 5, f"only {proxy.cuts} cuts in {time.monotonic() - started:.0f}s"
    # both ways a request ends by itself were exercised, many times (how many: the load)
    assert outcomes.get("ok", 0) > 1_000, outcomes
    assert outcomes.get("timeout", 0) > 100, outcomes
    worst = max(late)
    assert worst <= GRACE + lateness[0], (
        f"a request ended {worst * 1000:.0f} ms past its deadline (loop lateness "
        f"{lateness[0] * 1000:.0f} ms); outcomes {outcomes}"
    )


def _reply_later(nc: nats.NATS, subject: str) -> None:
    if nc.is_connected:
        asyncio.get_running_loop().create_task(nc.publish(subject, b"{}"))
