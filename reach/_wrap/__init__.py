"""The wrapper for existing HTTP agents (``reach wrap``): a Reach agent that serves each
capability by calling an HTTP endpoint, unchanged. Part of the ``edge`` extra (httpx): only
``reach wrap`` or a program that imports ``reach._wrap`` loads it.

``spec`` (endpoints, health check, TOML files), ``forward`` (one request each way, the
header and error mappings), ``health`` (the probe loop), ``wrapper`` (the agent and its
owned pool).
"""

from .forward import HttpHeader, WrapStats
from .health import HealthMonitor
from .spec import Endpoint, HealthCheck, WrapSpec, build_spec, load_config, redact
from .wrapper import HttpWrapper

__all__ = [
    "Endpoint",
    "HealthCheck",
    "HealthMonitor",
    "HttpHeader",
    "HttpWrapper",
    "WrapSpec",
    "WrapStats",
    "build_spec",
    "load_config",
    "redact",
]
