import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import reach
import reach.errors
from reach import ReachSettings

ROOT = Path(__file__).parents[2]


def test_public_api_is_pinned():
    assert sorted(reach.__all__) == sorted(
        [
            "Agent",
            "AgentEvent",
            "AgentRecord",
            "AgentStats",
            "AgentUnavailable",
            "BadRequest",
            "Batch",
            "BatchProgress",
            "Cancelled",
            "CapabilityNotFound",
            "CircuitOpen",
            "ConfigurationError",
            "ConnectionFailed",
            "Context",
            "Client",
            "CorruptRecord",
            "DeadLetter",
            "DeadLetterNotFound",
            "ClientStats",
            "Gathered",
            "HandlerFailed",
            "InvalidReply",
            "NotReplayable",
            "NotStarted",
            "NotStored",
            "PayloadTooLarge",
            "Priority",
            "ReachError",
            "ReachSettings",
            "Registry",
            "RegistryStats",
            "RemoteError",
            "Reply",
            "RequestTimeout",
            "ResourceExhausted",
            "RetryLater",
            "ScheduleInfo",
            "Status",
            "Stream",
            "StreamBroken",
            "TaskAttempt",
            "TaskContext",
            "TaskNotFound",
            "TaskRecord",
            "TaskRef",
            "TaskState",
            "TaskStats",
            "Telemetry",
            "TopicMessage",
            "TopicSubscription",
            "Unauthorized",
            "__version__",
        ]
    )
    for name in reach.__all__:
        assert hasattr(reach, name), name


def test_every_error_is_a_reach_error():
    for name in reach.errors.__all__:
        obj = getattr(reach.errors, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, reach.ReachError), name


def test_services_sdk_bench_and_the_examples_use_only_the_public_api():
    offenders = []
    for folder in ("services", "sdk", "bench", "chaos", "reach/examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                offenders += [f"{path}: {n}" for n in names if n.startswith("reach._")]
    assert offenders == []


IMPORT_EVERY_MODULE = """
import asyncio, json, pkgutil, socket, sys
import pydantic_settings

seen = []

def record(what, original):
    def wrapper(*args, **kwargs):
        seen.append(what)
        return original(*args, **kwargs)
    return wrapper

socket.socket.__init__ = record("socket", socket.socket.__init__)
socket.socket.connect = record("connect", socket.socket.connect)
socket.create_connection = record("connect", socket.create_connection)
asyncio.open_connection = record("connect", asyncio.open_connection)
asyncio.BaseEventLoop.create_connection = record(
    "connect", asyncio.BaseEventLoop.create_connection
)
asyncio.new_event_loop = record("event loop", asyncio.new_event_loop)
pydantic_settings.BaseSettings.__init__ = record(
    "settings", pydantic_settings.BaseSettings.__init__
)

import reach

names = ["reach"]
for info in pkgutil.walk_packages(reach.__path__, "reach."):
    __import__(info.name)
    names.append(info.name)
print(json.dumps({"modules": names, "seen": seen}))
"""


def test_importing_every_reach_module_opens_no_connection_and_reads_no_settings(tmp_path):
    # Settings that would fail validation if anything read them at import time.
    (tmp_path / ".env").write_text("REACH_MAX_QUEUE=-5\nREACH_SUBJECT_PREFIX=not valid\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    env |= {
        "REACH_TIMEOUT_MS": "0",
        "REACH_ROUTING": "nowhere",
        "REACH_NATS_URL": "nats://192.0.2.1:4222",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    }
    with pytest.raises(ValidationError):
        ReachSettings(_env_file=tmp_path / ".env")  # the trap is armed
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"reach", "reach.cli", "reach.testing", "reach.settings"} <= set(out["modules"])
    assert out["seen"] == []
