"""Deployable registry replica: ``python -m services.registry`` (settings from REACH_*)."""

import asyncio
import logging
import signal

from reach import ReachError, ReachSettings, Registry
from reach.telemetry import configure_logging


async def main() -> None:
    registry = Registry(settings=ReachSettings())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with registry:
        await stop.wait()


if __name__ == "__main__":
    settings = ReachSettings()
    if not logging.getLogger().handlers:
        configure_logging(settings.log_format, settings.log_level)  # REACH_LOG_FORMAT=json
    try:
        asyncio.run(main())
    except ReachError as exc:  # NATS out of reach, refused: one line, not a traceback
        raise SystemExit(f"error: {exc.code}: {exc.message}") from None
