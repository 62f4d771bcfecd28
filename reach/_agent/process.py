"""An agent as a whole process: ``serve_forever`` (signals, drain, a handler's exit) and
``run``, the blocking entry point that also sets up logs and tracing from settings."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .._runtime import on_stop_signals, run_async
from .._telemetry import configure_logging, configure_tracing
from ..errors import ReachError

if TYPE_CHECKING:
    from .._telemetry.core import Telemetry
    from ..settings import ReachSettings

__all__ = ["Serving"]

log = logging.getLogger("reach.agent")


class Serving:
    """Mixed into ``Agent``."""

    agent_id: str
    name: str
    settings: ReachSettings
    telemetry: Telemetry
    _serving: bool
    _exit: BaseException | None
    _drain_requested: asyncio.Event
    drain_timeout: float

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    def request_drain(self) -> None:
        raise NotImplementedError

    def _handler_exit(self, exc: BaseException) -> bool:
        """A handler raised SystemExit or KeyboardInterrupt. Under ``serve_forever`` the
        agent drains as on SIGTERM (other work in flight finishes) and ``serve_forever``
        raises it; True then. Otherwise it propagates as Python would: asyncio ends the
        loop abruptly, under everything still running."""
        if not self._serving:
            return False
        if self._exit is None:
            self._exit = exc
        self.request_drain()
        return True

    async def serve_forever(self) -> None:
        """Start, serve until SIGTERM/SIGINT, ``$ctl drain`` or cancellation, then drain and
        stop. A second Ctrl-C while it drains ends the process at once (status 130)."""
        self._serving, self._exit = True, None
        draining = f"draining in-flight work for up to {self.drain_timeout:g}s"
        # The drain is inside the block: a second Ctrl-C during it is heard.
        with on_stop_signals(lambda _: self.request_drain(), draining=draining):
            try:
                await self.start()
                await self._drain_requested.wait()
                log.info("agent %s: draining", self.agent_id)
            finally:
                await self.stop()
                self._serving = False
        if self._exit is not None:
            raise self._exit

    def run(self) -> None:
        """Blocking entry point for a process that is one agent (uses uvloop when present).
        Logs go to stderr as ``REACH_LOG_FORMAT`` says, unless logging is set up already;
        spans are exported as ``REACH_TRACE_EXPORTER`` says, unless a tracer is set. A
        ``ReachError`` (NATS out of reach, credentials refused) ends the process with one
        ``error: <code>: <message>`` line on stderr and status 1."""
        if not logging.getLogger().handlers:
            configure_logging(self.settings.log_format, self.settings.log_level)
        provider = None
        if self.telemetry.tracer is None and self.telemetry.tracing:
            provider = configure_tracing(self.settings, self.name)
            if provider is not None:
                self.telemetry.tracer = provider.get_tracer("reach")
        try:
            run_async(self.serve_forever())
        except ReachError as exc:
            # A program's entry point: one line that says what to do and a non-zero status,
            # not a traceback (a start that cannot connect or is refused ends here).
            raise SystemExit(f"error: {exc.code}: {exc.message}") from None
        finally:
            if provider is not None:
                provider.shutdown()  # export what is buffered
