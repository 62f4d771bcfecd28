"""Contracts: every capability described once, from its handler, and served as documents.

The parts stand at different layers (ARCHITECTURE.md), so this package imports none of
them: ``schemas`` (the agent's: payload and result schemas from a handler's annotations),
``catalogue`` (pure: the fleet's contract from routing-table records), ``asyncapi`` (pure:
an AsyncAPI 3.0 document of a catalogue), and ``mcp`` (an MCP server over a ``Client``,
the ``mcp`` extra).
"""
