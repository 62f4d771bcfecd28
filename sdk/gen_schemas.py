"""Write sdk/schemas/*.json from reach.wire (run: python -m sdk.gen_schemas)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from reach import wire

SCHEMAS = Path(__file__).parent / "schemas"
TYPES = {
    "error": wire.ErrorBody,
    "capability": wire.CapabilityInfo,
    "agent-info": wire.AgentInfo,
    "heartbeat": wire.Heartbeat,
    "agent-record": wire.AgentRecord,
    "agent-event": wire.AgentEvent,
    "registration": wire.Registration,
    "register-reply": wire.RegisterReply,
    "deregistration": wire.Deregistration,
    "control": wire.Control,
    "control-reply": wire.ControlReply,
    "list-query": wire.ListQuery,
    "list-reply": wire.ListReply,
    "route-query": wire.RouteQuery,
    "route-reply": wire.RouteReply,
    "task-submit": wire.TaskSubmit,
    "task-record": wire.TaskRecord,
    "stream-credit": wire.StreamCredit,
    "stream-cancel": wire.StreamCancel,
    "task-schedule": wire.ScheduleSpec,
}


def render() -> dict[str, str]:
    out = {}
    for name, type_ in TYPES.items():
        schema = msgspec.json.schema(type_)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = f"Agent-Reach v{wire.PROTOCOL_VERSION} {name}"
        out[f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def main() -> None:
    SCHEMAS.mkdir(exist_ok=True)
    for filename, text in render().items():
        (SCHEMAS / filename).write_text(text)
        print(f"wrote {SCHEMAS / filename}")


if __name__ == "__main__":
    main()
