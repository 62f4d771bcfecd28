"""The registry service: leases in KV, heartbeats into status, probes, list and route,
and (unless ``tasks=False``) durable-task recovery (``reach._tasks.recovery``).

Stateless by design: everything it knows is in the ``reach_agents`` bucket (which it
mirrors) or arrives with the next heartbeat. Every write is a compare-and-set on the key's
revision, so any number of replicas can run; a lost race is retried on the fresh record.

One lifecycle: ``start`` connects, opens the bucket, loads a snapshot, subscribes and
flushes, all within ``start_timeout``; any failure is ``ConnectionFailed`` and leaves
nothing behind. ``stop`` drains the subscriptions (requests already taken are answered),
lets taken heartbeats be written, then cancels and awaits every background coroutine,
closes the request inbox every lease write and read goes through (``reach._jsapi.JsApi``,
one per connection), and closes the connection last. Start and stop take turns (one
lock): a ``stop`` called while ``start`` runs waits for it and then stops, and a second
``start`` finds the first done.

nats-py reconnects a lost link by itself, but gives a connection up for good when the
server closes it for an error (a message over max_payload, say). A registry does not live
on with a dead connection: it stops the NATS side and starts it again on a new connection
(``_mend``, with backoff until it works), as a restarted process would, but in place:
its metrics endpoint stays, and being stateless it loses nothing. Restarting in place
rather than exiting, because nothing would start it again: ``reach up`` and the compose
file run it once, and a ``Registry`` may run inside another program.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Self

from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from nats.nuid import NUID

from .. import _kv
from .._background import Background
from .._jsapi import JsApi
from .._nats import (
    TRANSIENT,
    check_refused,
    close_nats,
    connect_nats,
    flush_nats,
    redact,
    refusals,
)
from .._subjects import Subjects
from .._tasks.recovery import RecoveryStats, TaskRecovery
from .._telemetry.core import Attachment, Telemetry
from ..errors import ConnectionFailed, ReachError
from ..settings import ReachSettings
from ..wire import AgentRecord
from .api import Api
from .counters import RegistryCells, RegistryStats
from .heartbeats import Heartbeats
from .liveness import Liveness
from .observe import registry_source
from .state import Core, Entries, Throttle
from .writer import RecordWriter

__all__ = ["Registry"]

log = logging.getLogger("reach.registry")

_ROUTES_WAIT = 2.0  # seconds a start or rebuild gives the routes bucket before the leases
_ROUTES_PAUSE_MAX = 30.0  # seconds between later tries at most
_MEND_BACKOFF = 0.5  # seconds before connecting again, doubled up to _MEND_BACKOFF_MAX
_MEND_BACKOFF_MAX = 15.0


class Registry:
    """One registry replica; run as many as you like (``reach registry``)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: ReachSettings | None = None,
        registry_id: str | None = None,
        max_inflight: int = 256,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        tasks: bool = True,
        telemetry: Telemetry | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.settings = settings if settings is not None else ReachSettings()
        #: metrics and health of this replica (its own unless one is passed in)
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        #: serve /metrics and /healthz on this port while running (0: any free port)
        self.metrics_port = metrics_port if metrics_port is not None else self.settings.metrics_port
        self._attachment: Attachment | None = None
        self.url = self.settings.nats_url if url is None else url
        self.subjects = Subjects(self.settings.subject_prefix)
        self.bucket_name = self.subjects.bucket("agents")
        self.registry_id = registry_id or f"registry-{NUID().next().decode()}"
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        stats = RegistryStats()
        self._owner = Background(self.registry_id)
        self._core = core = Core(
            settings=self.settings,
            subjects=self.subjects,
            registry_id=self.registry_id,
            bucket=self.bucket_name,
            routes=self.subjects.bucket("routes"),
            stats=stats,
            entries=Entries(stats),
            throttle=Throttle(),
            owner=self._owner,
        )
        writer = RecordWriter(core)
        self._api = Api(core, writer)
        self._heartbeats = Heartbeats(core, writer, max_inflight)
        self._liveness = Liveness(core, writer)
        core.entries.on_expired = self._liveness.expired
        self._mirror: _kv.BucketMirror | None = None
        #: durable-task recovery (max-deliveries advisories, sweeps); off with tasks=False
        self.tasks = tasks
        self._recovery_stats = RecoveryStats()
        self._recovery: TaskRecovery | None = None
        self._subs: list[Subscription] = []
        self._running = False
        self._lifecycle = asyncio.Lock()
        self._given_up = asyncio.Event()  # nats-py closed the connection for good
        #: owns ``_mend``, which outlives the NATS side (``_owner``) it stops and starts
        self._keeper = Background(f"{self.registry_id} keeper")

    # -- what anyone may read ------------------------------------------------------------

    @property
    def cells(self) -> RegistryCells:
        """Counters by label (transitions, probes, queries, heartbeat lag) for metrics."""
        return self._core.cells

    @property
    def recovery_stats(self) -> RecoveryStats:
        return self._recovery_stats

    @property
    def metrics_url(self) -> str | None:
        """Where ``/metrics`` and ``/healthz`` are served while running, if asked."""
        return self._attachment.url if self._attachment is not None else None

    @property
    def stats(self) -> RegistryStats:
        """Counters of the traffic handled (``background_failures`` is read at access)."""
        stats = self._core.stats
        stats.background_failures = self._owner.failures + self._keeper.failures
        rs = self._recovery_stats
        stats.sweeps, stats.sweeps_skipped = rs.sweeps, rs.sweeps_skipped
        stats.tasks_recovered = rs.tasks_recovered
        stats.max_deliveries, stats.recovery_errors = rs.max_deliveries, rs.errors
        stats.advisories_missed, stats.undecodable_records = rs.advisories_missed, rs.undecodable
        stats.cancels_finished = rs.cancels_finished
        return stats

    def records(self) -> dict[str, AgentRecord]:
        """The registry's current view (from its own watch of the bucket)."""
        return self._core.entries.records()

    def footprint(self) -> dict[str, int]:
        """Sizes of everything this replica holds, so tests and operators can see that
        agent churn leaves nothing behind: keys known (with and without a record), agents
        recently asked to register, senders of refused requests recently logged, heartbeat
        writes in flight and waiting, background coroutines, subscriptions."""
        core = self._core
        return {
            "entries": len(core.entries),
            "records": len(core.entries.records()),
            "asked_to_register": len(core.throttle),
            "refusals_logged": len(core.warned),
            "heartbeats_in_flight": self._heartbeats.in_flight,
            "heartbeats_waiting": self._heartbeats.waiting,
            "expiries_queued": self._liveness.queued,
            "background": len(self._owner),
            "subscriptions": len(self._subs),
        }

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Serve once this returns; ConnectionFailed (nothing left running) if it cannot."""
        async with self._lifecycle:
            if self._running:
                return
            try:
                await self._begin()
                await self._expose()
            except BaseException:
                await self._close()
                raise
            self._running = True
            if self._keeper.closed:
                self._keeper.reopen()
            self._keeper.keep(self._mend, "mend")
        log.info("registry %s serving bucket %s", self.registry_id, self.bucket_name)

    async def stop(self) -> None:
        """Stop serving (after a ``start`` that is under way, if any). Each stage waits at
        most ``stop_timeout``: the drain, then the background coroutines once cancelled (one
        that swallows its cancellation is logged by name and left behind)."""
        async with self._lifecycle:
            if not self._running:
                return
            self._running = False
            # _mend waits (for this lock, an event, a backoff): it ends at once
            await self._keeper.close(self.stop_timeout)
            await self._close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def serve_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    # -- start ---------------------------------------------------------------------------

    async def _begin(self) -> None:
        """The NATS side: connect, load the bucket, subscribe (``_release`` undoes it)."""
        if self._owner.closed:
            self._owner.reopen()
        self._heartbeats.reset()
        self._liveness.reset()
        self._core.routes_refused = 0  # a new connection, a new look
        self._core.routes_made = False
        self._given_up.clear()
        try:
            await self._open()
        except BaseException:
            await self._release()
            raise

    async def _mend(self) -> None:
        """While the registry runs: when nats-py has given its connection up for good,
        start the NATS side again on a new connection, with backoff until it serves."""
        backoff = _MEND_BACKOFF
        while True:
            await self._given_up.wait()
            async with self._lifecycle:
                if not self._running:
                    return
                log.warning(
                    "registry %s: its NATS connection is closed for good; connecting again",
                    self.registry_id,
                )
                await self._release()
                try:
                    await self._begin()
                except ReachError as exc:
                    log.warning(
                        "registry %s: not serving yet (%s); trying again in %gs",
                        self.registry_id,
                        exc,
                        backoff,
                    )
                    self._given_up.set()
                except Exception:
                    log.exception(
                        "registry %s: starting again failed; trying again in %gs",
                        self.registry_id,
                        backoff,
                    )
                    self._given_up.set()
                else:
                    self._core.stats.connections_replaced += 1
                    log.info("registry %s serving again on a new connection", self.registry_id)
                    backoff = _MEND_BACKOFF
                    continue
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _MEND_BACKOFF_MAX)

    async def _on_closed(self) -> None:
        self._given_up.set()

    async def _open(self) -> None:
        core = self._core
        nc = await connect_nats(
            self.settings,
            self.url,
            self.registry_id,
            reconnected=self._on_reconnect,
            closed=self._on_closed,
        )
        core.nc, core.js = nc, nc.jetstream()
        step = "bind"
        try:
            async with asyncio.timeout(self.start_timeout):
                await self._bind()
                step = "open its request inbox"
                api = JsApi(nc)  # its subscription is the connection's: renewed on reconnect
                await api.open()
                core.api = api
                step = "load the bucket"
                self._mirror = _kv.BucketMirror(
                    self._bind,
                    core.entries,
                    self._owner,
                    name=f"registry {self.registry_id} leases",
                    silence_limit=max(3 * self.settings.heartbeat_interval, 1.0),
                    rebuild_timeout=self.start_timeout,
                    connected=lambda: nc.is_connected,
                )
                if not await self._mirror.start(self.start_timeout):
                    check_refused(
                        nc,
                        f"registry {self.registry_id}: watch of {self.bucket_name}",
                        since=core.routes_refused,
                    )
                    raise ConnectionFailed(
                        f"registry {self.registry_id}: no snapshot of bucket "
                        f"{self.bucket_name!r} within {self.start_timeout:g}s"
                        f" on {redact(self.url)}",
                        url=self.url,
                    )
                step = "subscribe"
                s = self.subjects
                on_heartbeat = self._heartbeats.on_message
                self._subs.append(
                    await nc.subscribe(s.heartbeat("*"), queue="registry", cb=on_heartbeat)
                )
                for subject, cb in self._api.handlers().items():
                    self._subs.append(await nc.subscribe(subject, queue="registry", cb=cb))
                if self.tasks:
                    self._recovery = TaskRecovery(
                        nc, self.settings, s, self._owner, self._recovery_stats
                    )
                    self._recovery.start()
                await flush_nats(nc)
                check_refused(nc, f"registry {self.registry_id} start", since=core.routes_refused)
        except TRANSIENT as exc:
            check_refused(
                nc, f"registry {self.registry_id} start ({step})", exc, since=core.routes_refused
            )
            if step == "bind":
                raise ConnectionFailed(self._unavailable(exc), url=self.url) from exc
            raise ConnectionFailed(
                f"registry {self.registry_id} could not {step} on {redact(self.url)} within "
                f"{self.start_timeout:g}s ({type(exc).__name__}: {exc})",
                url=self.url,
            ) from exc
        self._owner.keep(self._liveness.housekeeping, "housekeeping")
        if not (self._core.routes_made or self._core.routes_refused):
            self._owner.spawn(self._make_routes(), "routes bucket")

    async def _expose(self) -> None:
        if self._attachment is None:
            self._attachment = await self.telemetry.attach(
                f"registry {self.registry_id}",
                registry_source(self),
                self._healthy,
                self.metrics_port,
                self.settings.metrics_host,
            )

    def _healthy(self) -> bool:
        nc = self._core.nc
        return nc is not None and nc.is_connected and not (self._mirror and self._mirror.stale)

    async def _bind(self) -> KeyValue:
        # The buckets live in memory: after a server restart they may have to be created
        # again (the mirror binds again on every rebuild). Routes first: a client that
        # finds the leases without the routes takes it for a registry from before them.
        core = self._core
        if not core.routes_refused:
            await self._bind_routes()
        return await _kv.agents_bucket(
            core.jsc(), self.bucket_name, create=True, replicas=self.settings.replicas
        )

    async def _bind_routes(self) -> None:
        """The routes bucket, best effort, for ``_ROUTES_WAIT`` at most: the leases come
        first. Refused by the server (the user may not use it), no copies are made from
        then on, said once; anything else (no answer yet) leaves copies on: a publish to a
        stream not there yet is lost like any copy, and the next write makes it again."""
        core = self._core
        nc, mark = core.conn(), refusals(core.conn())
        try:
            async with asyncio.timeout(_ROUTES_WAIT):
                await _kv.routes_bucket(
                    core.jsc(), core.routes, create=True, replicas=self.settings.replicas
                )
            core.routes_made = True
        except TRANSIENT as exc:  # a timeout included
            if refusals(nc) == mark:
                log.debug("registry %s: bucket %r: %s", self.registry_id, core.routes, exc)
                return
            core.routes_refused = refusals(nc)
            log.warning(
                "registry %s: the server refused bucket %r, so no leases are copied by "
                "capability; clients follow the whole fleet instead (allow this user "
                "$JS.API.STREAM.CREATE.KV_%s, $JS.API.STREAM.INFO.KV_%s and $KV.%s.>, as in "
                "services/nats/nats-server.conf)",
                self.registry_id,
                core.routes,
                core.routes,
                core.routes,
                core.routes,
            )

    async def _make_routes(self) -> None:
        """The routes bucket was neither made nor refused at the start (JetStream slow, a
        stream leader not yet elected): tried again, with backoff, until it is; the
        owner cancels it on stop. Meanwhile copies are published to no stream, and
        clients wait for the bucket (or follow the leases)."""
        pause = _ROUTES_WAIT
        core = self._core
        while not (core.routes_made or core.routes_refused):
            await asyncio.sleep(pause)
            await self._bind_routes()
            pause = min(2 * pause, _ROUTES_PAUSE_MAX)

    def _unavailable(self, exc: BaseException) -> str:
        cause = type(exc).__name__
        # JetStream API errors carry a description (often none); others say it in str().
        detail = getattr(exc, "description", None) if hasattr(exc, "err_code") else str(exc)
        if detail:
            cause += f": {detail}"
        return (
            f"registry {self.registry_id} cannot open KV bucket {self.bucket_name!r} on "
            f"{redact(self.url)} ({cause}); it needs JetStream enabled (nats-server -js) and the "
            f"right to create the bucket"
        )

    async def _on_reconnect(self) -> None:
        if self._mirror is not None:
            self._mirror.rebuild_soon()  # the old watcher may stay silent (NATS-FACTS.md)

    # -- stop ----------------------------------------------------------------------------

    async def _close(self) -> None:
        """Stop taking work, finish what was taken, end every task, then disconnect."""
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            await attachment.close()
        await self._release()

    async def _release(self) -> None:
        """The NATS side stops: drain, end every task, disconnect (each stage bounded)."""
        core = self._core
        subs, self._subs = self._subs, []
        try:
            async with asyncio.timeout(self.stop_timeout):
                await asyncio.gather(*(self._drain(sub) for sub in subs))
                await self._heartbeats.wait_idle()
        except TimeoutError:
            log.warning(
                "registry %s: work still in flight after %gs", self.registry_id, self.stop_timeout
            )
        mirror, self._mirror = self._mirror, None
        if mirror is not None:
            await mirror.stop(self.stop_timeout)
        recovery, self._recovery = self._recovery, None
        if recovery is not None:
            recovery.stop()  # its loops end with the owner, even if a cancel is lost
        # bounded: a coroutine that swallowed its cancellation is logged by name, left behind
        await self._owner.close(self.stop_timeout)
        api, core.api = core.api, None
        if api is not None:  # after the writers: a request still waiting fails, as closed
            try:
                async with asyncio.timeout(self.stop_timeout):
                    await api.close()
            except TimeoutError:
                log.warning("registry %s: request inbox not closed", self.registry_id)
        nc, core.nc, core.js = core.nc, None, None
        if nc is not None:
            await close_nats(nc, drain=False)

    async def _drain(self, sub: Subscription) -> None:
        """Unsubscribe and wait until the messages already delivered are handled; except
        heartbeats, whose backlog is dropped (at 100,000 agents it held tens of thousands,
        and working through them made a stop take over 10 s): a heartbeat is soft state,
        and the agent's next one renews its lease, at this replica or another. The one
        being handled is cancelled with the subscription; writes already started finish
        (``Heartbeats.wait_idle``)."""
        try:
            if sub.subject == self.subjects.heartbeat("*"):
                await sub.unsubscribe()
                return
            await sub.drain()  # type: ignore[no-untyped-call]
        except TRANSIENT as exc:
            log.debug("registry %s: draining %s: %s", self.registry_id, sub.subject, exc)
