"""Durable tasks on JetStream.

The wire (TaskSubmit, TaskRecord) is ``reach.wire.tasks``; ``states`` (the state machine,
fencing, backoff, priority aging) is pure. ``store`` names and reads/writes the streams and
buckets. The agent side is ``runner`` (pulling by priority, leases, cancel, drain) over
``execute`` (one delivery: claim, RUNNING, result, retry, dead letter, callback). The client
side is ``submit`` (Tasks) and ``refs`` (TaskRef, Batch); ``faults`` turns what nats-py
raises into ``ReachError``s for every public task method. ``dlq`` writes dead letters;
``admin`` lists records and reads and replays dead letters; ``recovery`` (run by the
registry) moves what hit max deliveries to the DLQ and sweeps for lost tasks. ``delayed``
(a delayed submit, a retry later) and ``schedules`` (periodic schedules, over the pure
``cron``) put tasks on the server's own scheduler.
Nothing here imports the agent or the client packages.
"""

from ..wire.tasks import TaskAttempt, TaskRecord, TaskState, TaskStep, TaskSubmit
from . import admin
from .admin import DeadLetter
from .execute import Executor
from .model import TaskDecl, TaskStats
from .refs import Batch, BatchProgress, TaskRef
from .runner import TaskRunner
from .schedules import ScheduleInfo
from .submit import Tasks, unserved

__all__ = [
    "Batch",
    "BatchProgress",
    "DeadLetter",
    "Executor",
    "ScheduleInfo",
    "TaskAttempt",
    "TaskDecl",
    "TaskRecord",
    "TaskRef",
    "TaskRunner",
    "TaskState",
    "TaskStats",
    "TaskStep",
    "TaskSubmit",
    "Tasks",
    "admin",
    "unserved",
]
