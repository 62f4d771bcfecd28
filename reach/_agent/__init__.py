"""The agent runtime, one module per part.

``agent`` (the Agent: declaration, start and stop, telemetry, ``run``), ``intake``
(admission in the subscription's task), ``workers`` (run, answer, deadlines, handler
spans), ``scheduler`` (the priority queue), ``lifecycle`` (the state machine), ``presence``
(registration and heartbeats), ``subscriptions`` (what it listens on), ``control`` ($ctl,
$ping, $SRV), ``srv`` ($SRV answers from a snapshot), ``metrics`` (the scrape-time source),
``model`` (records and counters). Handlers and their Context live below, in
``reach._handlers``, shared with the task runtime. Nothing here imports ``agent`` but this
file, and nothing imports what stands above it.
"""

from .._handlers import Context
from .agent import Agent
from .lifecycle import State
from .model import AgentStats

__all__ = ["Agent", "AgentStats", "Context", "State"]
