"""The agent's own subjects: ``$ctl`` (pause, resume, drain, register), ``$ping`` and ``$SRV``.

They talk to the agent through the small ``Controlled`` interface, never to its insides.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec
from nats.aio.msg import Msg

from .._codec import encode_json, error_reply
from .._nats import TRANSIENT, NatsConnection
from ..wire import Control, ControlReply, Heartbeat, Status
from . import srv
from .lifecycle import State

__all__ = ["ControlListeners", "Controlled"]

log = logging.getLogger("reach.agent")

_control = msgspec.json.Decoder(Control)

#: command -> the states in which it counts as done (``ok`` in the reply)
_OK_IN: dict[str, tuple[State, ...]] = {
    "pause": (State.PAUSED,),
    "resume": (State.UP, State.DEGRADED),
    "drain": (State.DRAINING, State.STOPPED),
    "register": tuple(State),
}


class Controlled(Protocol):
    """What the control subjects may do to an agent."""

    agent_id: str
    name: str

    @property
    def state(self) -> State: ...

    @property
    def status(self) -> Status: ...

    def heartbeat(self, seq: int = 0) -> Heartbeat: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    def request_drain(self) -> None: ...

    def register_again(self) -> None: ...

    def service_snapshot(self) -> srv.ServiceSnapshot: ...


class ControlListeners:
    """Callbacks for the agent's ``$ctl``, ``$ping`` and ``$SRV`` subscriptions."""

    def __init__(self, agent: Controlled, nc: NatsConnection) -> None:
        self.agent = agent
        self.nc = nc

    async def _send(self, reply: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            await self.nc.publish(reply, body, headers=headers)
        except TRANSIENT as exc:
            log.debug("agent %s: control reply lost: %s", self.agent.agent_id, exc)

    async def on_ctl(self, msg: Msg) -> None:
        agent = self.agent
        try:
            command = _control.decode(msg.data).command
        except msgspec.DecodeError as exc:
            if msg.reply:
                await self._send(
                    msg.reply,
                    *error_reply("bad_request", f"invalid control: {exc}", agent.agent_id),
                )
            return
        if command == "register":
            agent.register_again()
        elif command == "pause":
            await agent.pause()
        elif command == "resume":
            await agent.resume()
        elif command == "drain":
            agent.request_drain()
        else:
            if msg.reply:
                message = f"unknown command {command!r}: use pause, resume, drain or register"
                await self._send(msg.reply, *error_reply("bad_request", message, agent.agent_id))
            return
        if msg.reply:
            ok = agent.state in _OK_IN[command]
            reply = ControlReply(agent_id=agent.agent_id, status=agent.status, ok=ok)
            await self._send(msg.reply, encode_json(reply))

    async def on_ping(self, msg: Msg) -> None:
        if msg.reply:
            await self._send(msg.reply, encode_json(self.agent.heartbeat()))

    async def on_srv(self, msg: Msg) -> None:
        if not msg.reply:
            return
        body = srv.answer(msg.subject, self.agent.service_snapshot())
        if body is not None:
            await self._send(msg.reply, body)
