import ast
from pathlib import Path

import reach
import reach.errors

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
            "Cancelled",
            "CapabilityNotFound",
            "CircuitOpen",
            "ConfigurationError",
            "ConnectionFailed",
            "Context",
            "Client",
            "ClientStats",
            "HandlerFailed",
            "InvalidReply",
            "NotStarted",
            "Priority",
            "ReachError",
            "ReachSettings",
            "Registry",
            "RegistryStats",
            "RemoteError",
            "Reply",
            "RequestTimeout",
            "ResourceExhausted",
            "Status",
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


def test_services_sdk_and_bench_use_only_the_public_api():
    offenders = []
    for folder in ("services", "sdk", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                offenders += [f"{path}: {n}" for n in names if n.startswith("reach._")]
    assert offenders == []


def test_importing_reach_creates_no_connection_or_settings():
    tree = ast.parse((ROOT / "reach" / "__init__.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert calls == []
