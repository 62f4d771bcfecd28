"""Logs that say which request, task, trace and agent they are about.

The ids ride a context variable that the agent sets around each handler run and task
attempt (so a handler's own ``logging`` calls carry them too); the trace id is read from
the current span only when a record is actually written.
"""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar
from typing import Any

import msgspec
from opentelemetry import trace

__all__ = ["LOG_AGENT", "LOG_WORK", "IdsFilter", "JsonFormatter", "configure_logging"]

#: the agent whose task this is (set once per worker and task runner task)
LOG_AGENT: ContextVar[str] = ContextVar("reach_log_agent", default="")
#: what is being worked on: an object with ``request_id`` and/or ``task_id`` (a request's
#: job, a task's delivery), set around each run; read only when a record is written
LOG_WORK: ContextVar[Any] = ContextVar("reach_log_work", default=None)

_FIELDS = ("agent_id", "request_id", "task_id", "trace_id", "span_id")


class IdsFilter(logging.Filter):
    """Puts agent_id, request_id, task_id, trace_id and span_id on every record ('' when
    unknown), for the JSON formatter and for text formats that name them."""

    def filter(self, record: logging.LogRecord) -> bool:
        work = LOG_WORK.get()
        if not getattr(record, "agent_id", None):
            record.agent_id = LOG_AGENT.get()
        if not getattr(record, "request_id", None):
            record.request_id = getattr(work, "request_id", "") or ""
        if not getattr(record, "task_id", None):
            record.task_id = getattr(work, "task_id", "") or ""
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else ""
        record.span_id = format(ctx.span_id, "016x") if ctx.is_valid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the ids, and the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _FIELDS:
            value = getattr(record, name, "")
            if value:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(out).decode()


_TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(
            f"{name}={value}" for name in _FIELDS if (value := getattr(record, name, ""))
        )
        return f"{line} [{ids}]" if ids else line


def configure_logging(fmt: str = "text", level: str = "INFO") -> logging.Handler:
    """For a program's edge (the ``reach`` commands, ``Agent.run``): one stderr handler
    with the ids filter, text or JSON. Returns the handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(IdsFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else _TextFormatter(_TEXT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
