"""Which subjects an agent listens on, and leaving its queue groups without losing a request.

Queue-group subscriptions (``reach.cap.<cap>``) are the only ones pause and drain touch.
Direct subjects, ``$ping``, ``$ctl``, ``$SRV`` and topics stay until the connection closes:
a paused or draining agent still answers direct callers (``agent_unavailable``), probes and
control commands.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .._delivery import Deliver, subscribe_direct
from .._nats import TRANSIENT, NatsConnection, flush_nats, leave
from .._subjects import Subjects
from . import srv
from .control import ControlListeners
from .model import Served

__all__ = ["Subscriptions"]

log = logging.getLogger("reach.agent")

Callback = Callable[[Msg], Awaitable[None]]


class Subscriptions:
    def __init__(self, agent_id: str, subjects: Subjects) -> None:
        self.agent_id = agent_id
        self.subjects = subjects
        self._queues: list[Subscription] = []
        self._others: list[Subscription] = []

    async def subscribe(
        self,
        nc: NatsConnection,
        caps: dict[str, Served],
        handler_for: Callable[[Served], Deliver],
        listeners: ControlListeners,
        *,
        on_event: Callback,
        topics: list[tuple[str, Callback]],
        streams: Deliver | None = None,
    ) -> None:
        """Direct subjects, queue groups, ``$ping``, ``$ctl``, the agent's own registry
        events, ``$SRV`` and topics (``topics``: pattern and callback); with ``streams``,
        what the callers of its streams say (``<prefix>.agent.<id>.$stream.*``)."""
        s, agent_id = self.subjects, self.agent_id
        if streams is not None:  # before the capabilities: a caller speaks at the 1st chunk
            self._others.append(await subscribe_direct(nc, s.streams(agent_id) + "*", streams))
        for name, cap in caps.items():
            cap.direct = s.agent(agent_id, name)
            cap.handler = handler_for(cap)
            self._others.append(await subscribe_direct(nc, cap.direct, cap.handler))
        await self.join_queues(nc, caps)
        others: list[tuple[str, Callback]] = [
            (s.ping(agent_id), listeners.on_ping),
            (s.ctl(agent_id), listeners.on_ctl),
            (s.event(agent_id), on_event),
        ]
        others += [
            (subject, listeners.on_srv) for subject in srv.subjects(listeners.agent.name, agent_id)
        ]
        others += [(s.topic(pattern), cb) for pattern, cb in topics]
        for subject, cb in others:
            self._others.append(await nc.subscribe(subject, cb=cb))

    async def join_queues(self, nc: NatsConnection, caps: dict[str, Served]) -> None:
        for name, cap in caps.items():
            assert cap.handler is not None
            self._queues.append(
                await subscribe_direct(
                    nc, self.subjects.cap(name), cap.handler, queue=self.subjects.cap_queue(name)
                )
            )

    async def leave_queues(self, nc: NatsConnection) -> None:
        """Drain (not unsubscribe) so requests already delivered to us are still served."""
        subs, self._queues = self._queues, []  # a later join appends to a new list
        for sub in subs:
            try:
                await leave(nc, sub)
            except TRANSIENT as exc:
                log.debug("agent %s: leaving a queue group: %s", self.agent_id, exc)

    async def withdraw(self, nc: NatsConnection) -> None:
        """Before the connection closes: unsubscribe everything and wait two round trips,
        so the server has dropped our interest when ``stop()`` returns. A closed socket is
        noticed by the server a moment later; a request sent in that moment would reach a
        dead subscription and time out instead of getting no-responders at once."""
        subs, self._queues, self._others = [*self._queues, *self._others], [], []
        try:
            for sub in subs:
                await sub.unsubscribe()
            await flush_nats(nc)
        except TRANSIENT as exc:
            log.debug("agent %s: withdrawing subscriptions: %s", self.agent_id, exc)

    def forget(self) -> None:
        """The connection is closing: every subscription goes with it."""
        self._queues = []
        self._others = []
