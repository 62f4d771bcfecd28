"""Every metric Reach exports: name, type, help and label names, in one place.

The dashboard, the alert rules and their tests are checked against this table, and the
collector describes exactly these names, so two collectors on one registry are refused.
Labels are bounded: capability, policy, outcome, priority, status, agent name or instance
id, never a request id, task id or payload.
"""

from __future__ import annotations

from typing import Final, Literal, NamedTuple

__all__ = ["CATALOGUE", "LAG_BUCKETS", "LATENCY_BUCKETS", "Spec"]

Kind = Literal["counter", "gauge", "histogram"]


class Spec(NamedTuple):
    kind: Kind
    help: str
    labels: tuple[str, ...]


#: seconds, for request and handler latency (sub-millisecond to a slow LLM call)
LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
#: seconds, for heartbeat lag (send to receipt) and drains
LAG_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_CAP = ("capability",)

CATALOGUE: Final[dict[str, Spec]] = {
    # -- clients (counter names without the _total suffix, as prometheus-client wants)
    "reach_client_requests": Spec(
        "counter",
        "Requests by capability, routing policy and outcome.",
        ("capability", "policy", "outcome"),
    ),
    "reach_client_request_duration_seconds": Spec(
        "histogram", "Request latency as the caller saw it, all attempts included.", _CAP
    ),
    "reach_client_requests_in_flight": Spec("gauge", "Requests awaiting an answer.", _CAP),
    "reach_client_attempts": Spec(
        "counter",
        "Request attempts by outcome (one request may make several).",
        ("capability", "outcome"),
    ),
    "reach_client_retries": Spec("counter", "Attempts after the first.", _CAP),
    "reach_client_failovers": Spec(
        "counter", "Retries sent to another instance than the attempt before.", _CAP
    ),
    "reach_client_hedges": Spec("counter", "Second attempts sent by hedging.", _CAP),
    "reach_client_retry_budget_exhausted": Spec(
        "counter", "Retries refused because the retry budget was spent.", _CAP
    ),
    "reach_client_breaker_open": Spec(
        "gauge",
        "1 while this client's circuit breaker for the instance is open.",
        ("agent_id",),
    ),
    "reach_client_breaker_openings": Spec(
        "counter", "Times a circuit breaker opened, per instance.", ("agent_id",)
    ),
    "reach_client_tasks_submitted": Spec(
        "counter", "Durable tasks submitted.", ("capability", "priority")
    ),
    "reach_client_tasks_finished": Spec(
        "counter",
        "Durable tasks this client saw end, by final state.",
        ("capability", "state"),
    ),
    "reach_client_topic_published": Spec(
        "counter",
        "Durable topic messages this client published and the server stored.",
        ("topic",),
    ),
    # -- agents
    "reach_agent_info": Spec(
        "gauge",
        "1 per agent instance in the process, with its status.",
        ("agent", "agent_id", "status"),
    ),
    "reach_agent_requests": Spec(
        "counter",
        "Requests handled by capability, priority and outcome.",
        ("agent", "capability", "priority", "outcome"),
    ),
    "reach_agent_handler_duration_seconds": Spec(
        "histogram", "Handler run time of answered requests.", ("agent", "capability")
    ),
    "reach_agent_queue_length": Spec(
        "gauge", "Requests waiting for a worker, by priority.", ("agent", "priority")
    ),
    "reach_agent_requests_in_flight": Spec("gauge", "Requests being handled.", ("agent",)),
    "reach_agent_requests_expired": Spec(
        "counter", "Requests dropped because their deadline passed before they ran.", ("agent",)
    ),
    "reach_agent_requests_rejected": Spec(
        "counter",
        "Requests refused at intake, by reason (full, degraded, paused, stopping, bad_header,"
        " no_reply_subject).",
        ("agent", "reason"),
    ),
    "reach_agent_refusals_unsent": Spec(
        "counter",
        "Refusals never sent (past the sending queue's bound, or queued at stop): their"
        " callers wait for their timeout.",
        ("agent",),
    ),
    "reach_agent_drain_duration_seconds": Spec(
        "gauge", "How long the last drain took.", ("agent",)
    ),
    "reach_agent_task_attempts": Spec(
        "counter",
        "Durable task attempts by capability and outcome.",
        ("agent", "capability", "outcome"),
    ),
    "reach_agent_task_redeliveries": Spec(
        "counter", "Task deliveries that were not the first.", ("agent",)
    ),
    "reach_agent_tasks_dead_lettered": Spec(
        "counter", "Tasks this agent moved to the dead-letter stream.", ("agent",)
    ),
    "reach_agent_tasks_running": Spec("gauge", "Durable tasks running now.", ("agent",)),
    "reach_agent_schedule_firings": Spec(
        "counter",
        "Periods of periodic schedules this agent handled, by outcome: made (a task),"
        " skipped (overlap skip, or paused), missed (beyond the catch-up cap); dropped"
        " counts firings dropped unhandled (a definition no firing can use, or a task"
        " JetStream refuses for good).",
        ("agent", "outcome"),
    ),
    "reach_agent_schedule_firings_late": Spec(
        "counter",
        "Periods whose task entered the work queue more than 5 s after their due time.",
        ("agent",),
    ),
    "reach_agent_task_records_undecodable": Spec(
        "counter",
        "Task records that did not decode (junk, or a newer version's), replaced by a FAILED"
        " record, the task dead-lettered with reason undecodable.",
        ("agent",),
    ),
    "reach_agent_handlers_stuck": Spec(
        "gauge",
        "Handlers that ignored their cancellation and still run, by kind (request, task,"
        " topic); a task handler holds its slot and claim, a durable topic handler its"
        " worker, until it returns.",
        ("agent", "kind"),
    ),
    "reach_agent_topic_deliveries": Spec(
        "counter",
        "Durable topic messages delivered to this instance (redeliveries included), by"
        " agent name and subscribed pattern.",
        ("agent", "topic"),
    ),
    "reach_agent_topic_acked": Spec(
        "counter", "Durable topic messages handled and acknowledged.", ("agent", "topic")
    ),
    "reach_agent_topic_redeliveries": Spec(
        "counter", "Durable topic deliveries that were not a message's first.", ("agent", "topic")
    ),
    "reach_agent_topic_failures": Spec(
        "counter",
        "Durable topic handler runs that raised or ran over topic_timeout (each message is"
        " redelivered with backoff, or dead-lettered on its last delivery).",
        ("agent", "topic"),
    ),
    "reach_agent_topic_dead_lettered": Spec(
        "counter", "Durable topic messages this instance moved to the DLQ.", ("agent", "topic")
    ),
    "reach_agent_topic_lag": Spec(
        "gauge",
        "Messages stored for the agent name's durable subscription and not yet delivered"
        " (the consumer's num_pending, sampled every topic_lag_interval).",
        ("agent", "topic"),
    ),
    "reach_agent_topic_ack_pending": Spec(
        "gauge",
        "Durable topic messages delivered to the agent name and not yet settled (sampled).",
        ("agent", "topic"),
    ),
    # -- registry
    "reach_registry_agents": Spec(
        "gauge", "Agent instances by capability and status.", ("capability", "status")
    ),
    "reach_registry_transitions": Spec(
        "counter", "Agent status transitions, by new status and reason.", ("status", "reason")
    ),
    "reach_registry_heartbeats": Spec("counter", "Heartbeats received.", ()),
    "reach_registry_heartbeats_unwritten": Spec(
        "counter",
        "Heartbeats not written: no news (status, reason, a load, queue or latency move)"
        " and a lease younger than lease_ttl/3 - heartbeat_interval/2.",
        (),
    ),
    "reach_registry_routes_unsent": Spec(
        "counter",
        "Lease writes whose copies into the routes bucket were not sent (the connection"
        " closed, or its reconnect buffer full); the agent's next write sends them again.",
        (),
    ),
    "reach_registry_heartbeats_dropped": Spec(
        "counter", "Heartbeats dropped, by reason.", ("reason",)
    ),
    "reach_registry_heartbeat_lag_seconds": Spec(
        "histogram", "Time from an agent sending a heartbeat to the registry reading it.", ()
    ),
    "reach_registry_requests_refused": Spec(
        "counter",
        "Registry API requests refused: bad_request, or agent_mismatch (a body naming"
        " another agent than its subject).",
        ("reason",),
    ),
    "reach_registry_legacy_requests": Spec(
        "counter", "Registrations on the old subjects without the agent id.", ()
    ),
    "reach_registry_probes": Spec("counter", "Liveness probes by outcome.", ("outcome",)),
    "reach_registry_queries": Spec("counter", "Route and list queries.", ("kind",)),
    "reach_registry_task_sweeps": Spec("counter", "Task recovery sweeps run.", ()),
    "reach_registry_tasks_recovered": Spec(
        "counter",
        "Tasks the sweeps and advisories put back on course, by action: republished,"
        " dead_lettered (max deliveries), undecodable (a record replaced), cancel_finished.",
        ("action",),
    ),
    "reach_tasks": Spec(
        "gauge",
        "Tasks by state as of the last sweep: records, and SCHEDULED from the delayed tasks"
        " the server holds (they have no record).",
        ("state",),
    ),
    "reach_schedules": Spec(
        "gauge", "Periodic schedules defined, by state: active, paused (last sweep).", ("state",)
    ),
    # -- the HTTP gateway (route: the app's path template; code: the HTTP status code)
    "reach_gateway_http_requests": Spec(
        "counter", "HTTP requests by route, method and status code.", ("route", "method", "code")
    ),
    "reach_gateway_http_request_duration_seconds": Spec(
        "histogram", "HTTP request latency by route, as the gateway served it.", ("route",)
    ),
    "reach_gateway_http_requests_in_flight": Spec(
        "gauge", "HTTP requests being served (event streams included).", ()
    ),
    "reach_dlq_messages": Spec("gauge", "Messages in the dead-letter stream.", ()),
}
