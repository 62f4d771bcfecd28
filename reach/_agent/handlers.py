"""Handlers as the agent sees them (defined below the agent, in ``reach._handlers``, so the
task runtime shares them without importing the agent)."""

from .._handlers import Context, Handler, HandlerSpec, inspect_handler

__all__ = ["Context", "Handler", "HandlerSpec", "inspect_handler"]
