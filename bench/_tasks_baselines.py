"""The two baselines of bench/tasks.py: a bare JetStream work-queue loop, and taskiq-nats.

Each has a worker (the entry point of a child process, started by ``_fleet.Children``) and a
submitter (used in the bench process): ``await submitter.submit(body)`` returns once the
worker's result for that body has been seen, as ``ref.result()`` does for reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from request_reply import Mux, expire

BARE_STREAM = "BENCH_BARE"
BARE_SUBJECT = "bench.bare.work"
BARE_DURABLE = "bench_bare"
REPLY = "Bench-Reply"  # header: where the worker publishes the result
FETCH = 64  # largest batch the bare worker fetches

TASKIQ_STREAM = "BENCH_TASKIQ"
TASKIQ_SUBJECT = "bench.taskiq.work"
TASKIQ_DURABLE = "bench_taskiq"
TASKIQ_POLL = 0.005  # s between result polls (taskiq's default is 0.2 s)
TIMEOUT = 10.0  # s a submit may wait for its result before the run counts as failed


async def wait_stop(stop: Any) -> None:
    """Until the bench sets ``stop`` (a multiprocessing Event), without blocking the loop."""
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)


# -- bare: publish with a reply header, fetch, publish the result, ack --------------------


def run_bare_worker(url: str, ready: Any, stop: Any) -> None:
    """Create the work-queue stream and its durable pull consumer, then serve it."""

    async def main() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name=BARE_STREAM,
                subjects=[BARE_SUBJECT],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
            )
        )
        await js.add_consumer(
            BARE_STREAM, ConsumerConfig(durable_name=BARE_DURABLE, ack_policy=AckPolicy.EXPLICIT)
        )
        sub = await js.pull_subscribe_bind(BARE_DURABLE, BARE_STREAM)

        async def serve() -> None:
            while True:
                try:
                    msgs = await sub.fetch(FETCH, timeout=1.0)
                except TimeoutError:  # nats.errors.TimeoutError is one (3.11)
                    continue
                for msg in msgs:
                    await nc.publish(msg.headers[REPLY], msg.data)
                    await msg.ack()

        loop = asyncio.create_task(serve())
        ready.set()
        await wait_stop(stop)
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await nc.close()

    asyncio.run(main())


class BareSubmitter(Mux):
    """Publish to the stream (awaiting its ack) with a reply header on a muxed inbox."""

    def __init__(self, nc: Any) -> None:
        super().__init__(nc)
        self.js = nc.jetstream()

    async def submit(self, body: bytes) -> bytes:
        self.seq += 1
        token = str(self.seq)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending[token] = fut
        timer = loop.call_later(TIMEOUT, expire, fut)
        try:
            await self.js.publish(BARE_SUBJECT, body, headers={REPLY: self.prefix + token})
            msg = await fut
        finally:
            timer.cancel()
            del self.pending[token]
        data: bytes = msg.data
        return data


# -- taskiq 0.13 + taskiq-nats 0.7: pull broker, object-store result backend --------------


def taskiq_broker(url: str) -> tuple[Any, Any]:
    """The broker (work-queue stream on file storage, as for bare) and its echo task."""
    from taskiq_nats import NATSObjectStoreResultBackend, PullBasedJetStreamBroker

    broker = PullBasedJetStreamBroker(
        url,
        subject=TASKIQ_SUBJECT,
        stream_name=TASKIQ_STREAM,
        durable=TASKIQ_DURABLE,
        stream_config=StreamConfig(retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE),
    ).with_result_backend(NATSObjectStoreResultBackend(url))

    async def work(body: str) -> str:
        return body

    return broker, broker.register_task(work, task_name="bench.work")


def run_taskiq_worker(url: str, ready: Any, stop: Any) -> None:
    """taskiq's receiver through its API (``run_receiver_task``), not its CLI."""

    async def main() -> None:
        from taskiq.api import run_receiver_task

        # It logs a warning for the cancellation that is its only way to stop.
        logging.getLogger("taskiq.receiver").setLevel(logging.ERROR)
        broker, _ = taskiq_broker(url)
        broker.is_worker_process = True
        await broker.startup()
        receiver = asyncio.create_task(run_receiver_task(broker, run_startup=False))
        ready.set()
        await wait_stop(stop)
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver
        await broker.shutdown()

    asyncio.run(main())


class TaskiqSubmitter:
    """``kiq`` then ``wait_result``, polling the result backend every TASKIQ_POLL s.

    Each read of a ready result (``is_ready`` once, ``get_result`` once) is an object-store
    ``get``: an ordered consumer that the server keeps about 5 s after it is unsubscribed,
    and the server refuses the 1001st consumer on the results stream (err 10026). So taskiq
    cannot keep up more than ~100 tasks/s for longer than those 5 s, at any concurrency;
    ``settle()`` waits for the last run's consumers to expire, so each run starts clean.
    """

    def __init__(self, url: str) -> None:
        self.broker, self.task = taskiq_broker(url)
        self.stuck = 0  # most consumers a settle() found left over (from cancelled reads)

    async def start(self) -> None:
        await self.broker.startup()

    async def close(self) -> None:
        await self.broker.shutdown()

    async def consumers(self) -> int:
        """Consumers on the result backend's stream (its object store)."""
        js = self.broker.result_backend.nats_jetstream
        info = await js.stream_info(f"OBJ_{self.broker.result_backend.bucket_name}")
        count: int = info.state.consumer_count
        return count

    async def settle(self, quiet: float = 8.0) -> int:
        """Until the result stream has no consumer left from earlier reads; how many stay.

        A read cancelled mid-way (a failed run cancels its callers) never unsubscribes, so
        its consumer lives on: stop waiting once the count has not fallen for ``quiet`` s.
        """
        loop = asyncio.get_running_loop()
        last, since = await self.consumers(), loop.time()
        while last and loop.time() - since < quiet:
            await asyncio.sleep(0.25)
            count = await self.consumers()
            if count < last:
                last, since = count, loop.time()
        self.stuck = max(self.stuck, last)
        return last

    async def submit(self, body: str) -> str:
        sent = await self.task.kiq(body)
        result = await sent.wait_result(check_interval=TASKIQ_POLL, timeout=TIMEOUT)
        value: str = result.raise_for_error().return_value
        return value
