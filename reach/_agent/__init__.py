"""The agent runtime, one module per part.

``agent`` (the facade: declaration, start/stop, run), ``intake`` (admission in the
subscription's task), ``workers`` (run, reply, deadlines), ``scheduler`` (the priority
queue), ``lifecycle`` (the state machine), ``presence`` (registration and heartbeats),
``control`` ($ctl, $ping, $SRV), ``srv`` ($SRV answers from a snapshot), ``handlers``
(Context, HandlerSpec), ``model`` (records and counters). Nothing here imports ``agent``
but this file, so there is no import circle.
"""

from .agent import Agent
from .handlers import Context
from .lifecycle import State
from .model import AgentStats

__all__ = ["Agent", "AgentStats", "Context", "State"]
