"""Telemetry for applications: the ``Telemetry`` object to pass to every Agent, Client and
Registry of a process, and the log filter and formatter that add Reach's ids to records.
See ``reach._telemetry.core`` for how it works."""

from ._telemetry import IdsFilter, JsonFormatter, MetricsServer, configure_logging
from ._telemetry.core import Telemetry

__all__ = ["IdsFilter", "JsonFormatter", "MetricsServer", "Telemetry", "configure_logging"]
