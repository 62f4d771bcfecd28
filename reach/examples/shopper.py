"""Shopper: a client that keeps the desk busy (tracking, refunds, reroute tasks).

It gives a deployment traffic to show; docker-compose.yml runs it beside the two agents.

python -m reach.examples.shopper [SECONDS_BETWEEN_ORDERS]

Settings come from ``REACH_*`` (``REACH_NATS_URL``, ``REACH_NATS_USER``,
``REACH_NATS_PASSWORD``, ...); with ``REACH_METRICS_PORT`` it serves its client metrics on
``/metrics``. A refused user (``Unauthorized``) ends it: permissions do not fix themselves;
any other error is printed and the next order goes on.
"""

import asyncio
import itertools
import signal
import sys

from reach import Client, ReachError, ReachSettings, Telemetry, Unauthorized


async def shop(settings: ReachSettings, pause: float) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    telemetry = Telemetry()
    metrics = None
    if settings.metrics_port is not None:
        metrics = await telemetry.serve(settings.metrics_port, settings.metrics_host)
    try:
        async with Client(settings=settings, name="shopper", telemetry=telemetry) as client:
            return await orders(client, stop, pause)
    finally:
        if metrics is not None:
            await metrics.close()


async def orders(client: Client, stop: asyncio.Event, pause: float) -> int:
    """One order every ``pause`` seconds until ``stop``; 1 when refused."""
    for n in itertools.count(1):
        order = {"order_id": f"A-{n}"}
        try:
            print("track", await client.request("logistics.track", order), flush=True)
            if n % 5 == 0:
                print("refund", await client.request("aftersales.refund", order), flush=True)
            if n % 10 == 0:
                ref = await client.submit("logistics.reroute", order)
                print("reroute task", ref.task_id, flush=True)
        except Unauthorized as exc:
            print(f"refused: {exc}", file=sys.stderr, flush=True)
            return 1
        except ReachError as exc:
            print(f"order {order['order_id']}: {exc.code}: {exc}", flush=True)
        try:
            await asyncio.wait_for(stop.wait(), pause)
            return 0
        except TimeoutError:
            pass
    return 0


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    sys.exit(asyncio.run(shop(ReachSettings(), seconds)))
