"""What the server, cluster, registry and partition scenarios share (``load``: request and
task load with every item in a ``Ledger``; ``fleet``: registry processes, agents killed
mid-task, the routing table watched)."""

from .fleet import (
    RegistryProc,
    TableWatch,
    all_up,
    kill_mid_task,
    next_write,
    reach_env,
    tasks_init,
    within,
)
from .load import HANG, RequestLoad, TaskLoad, account, examples, executions

__all__ = [
    "HANG",
    "RegistryProc",
    "RequestLoad",
    "TableWatch",
    "TaskLoad",
    "account",
    "all_up",
    "examples",
    "executions",
    "kill_mid_task",
    "next_write",
    "reach_env",
    "tasks_init",
    "within",
]
