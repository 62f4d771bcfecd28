"""Deployable registry replica: ``python -m services.registry`` (settings from REACH_*)."""

import asyncio
import logging
import signal

from reach import ReachSettings, Registry


async def main() -> None:
    registry = Registry(settings=ReachSettings())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with registry:
        await stop.wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main())
