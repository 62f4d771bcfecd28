"""Settings for every Agent-Reach process, from ``REACH_*`` variables, ``.env`` and arguments.

Precedence, highest first: arguments passed to ``ReachSettings(...)`` (and the explicit
arguments of ``Agent``/``Client``), environment variables, a ``.env`` file, defaults.
Settings are built at the program's edge and passed in; nothing reads them at import.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ._subjects import validate_prefix

__all__ = ["DEFAULT_NATS_URL", "ReachSettings"]

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class ReachSettings(BaseSettings):
    """Knobs people set every day, flat: ``REACH_NATS_URL``, ``REACH_TIMEOUT_MS``, ..."""

    model_config = SettingsConfigDict(
        env_prefix="REACH_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
    )

    nats_url: str = DEFAULT_NATS_URL
    subject_prefix: str = "reach"
    timeout_ms: int = Field(default=5000, gt=0)
    max_concurrency: int = Field(default=8, gt=0)
    max_queue: int = Field(default=64, ge=0)
    drain_timeout: float = Field(default=30.0, ge=0)
    heartbeat_interval: float = Field(default=5.0, gt=0)
    lease_ttl: float = Field(default=15.0, gt=0)
    probe_timeout: float = Field(default=2.0, gt=0)
    down_grace: float = Field(default=30.0, gt=0)
    register_backoff: float = Field(default=0.5, gt=0)
    register_backoff_max: float = Field(default=15.0, gt=0)
    connect_timeout: float = Field(default=2.0, gt=0)
    routing: str = "balanced"
    max_attempts: int = Field(default=3, ge=1)
    retry_base: float = Field(default=0.2, ge=0)
    retry_cap: float = Field(default=3.0, ge=0)
    retry_budget: float = Field(default=0.2, ge=0)
    breaker_cooldown: float = Field(default=5.0, gt=0)
    #: capability -> [rate per second, burst]; JSON in REACH_RATE_LIMITS
    rate_limits: dict[str, tuple[float, float]] = Field(default_factory=dict)
    #: capability -> {"w_load": .., "w_latency": .., "threshold": ..} for the scored policy
    routing_weights: dict[str, dict[str, float]] = Field(default_factory=dict)
    #: task type -> capability, so callers can ask by task type
    task_types: dict[str, str] = Field(default_factory=dict)
    nats_server_bin: str = ""
    # -- durable tasks ---------------------------------------------------------------------
    #: seconds before JetStream redelivers a task whose agent went silent; a running task is
    #: kept with in_progress() every third of it
    task_ack_wait: float = Field(default=30.0, ge=1)
    #: how long a task record is kept after its last change (per-key TTL in reach_tasks)
    task_retention: float = Field(default=86400.0, gt=0)
    #: how long an idempotency key maps to its task
    task_idempotency_ttl: float = Field(default=86400.0, gt=0)
    task_timeout: float = Field(default=300.0, gt=0)
    task_max_attempts: int = Field(default=3, ge=1, le=100)
    task_retry_base: float = Field(default=1.0, ge=0)
    task_retry_cap: float = Field(default=60.0, ge=0)
    #: JetStream's own delivery ceiling, a safety net above max_attempts (the MAX_DELIVERIES
    #: advisory sends what reaches it to the DLQ)
    task_max_deliver: int = Field(default=20, ge=2)
    #: tasks one agent runs at once (per agent, across its task capabilities); 0: max_concurrency
    task_concurrency: int = Field(default=0, ge=0)
    callback_attempts: int = Field(default=3, ge=1)
    callback_timeout: float = Field(default=5.0, gt=0)
    dlq_retention: float = Field(default=14 * 86400.0, gt=0)
    #: seconds between recovery sweeps (one registry replica of several sweeps per interval;
    #: a sweep is a headers-only scan of the task records); 0 turns them off
    task_sweep_interval: float = Field(default=60.0, ge=0)
    #: seconds durable-task setup (streams, buckets, consumers) and each submit keep trying
    #: while JetStream does not answer (a leader election, a server restarting); then
    #: ConnectionFailed
    #: (at most 90: a submit tried again stays inside the stream's 2-minute duplicate window)
    task_patience: float = Field(default=30.0, gt=0, le=90)
    #: replicas of task streams and buckets; 0: ``replicas``
    task_replicas: int = Field(default=0, ge=0, le=5)
    # -- deployment ------------------------------------------------------------------------
    #: replicas of every stream and KV bucket Reach creates (3 on a 3-node cluster: R3)
    replicas: int = Field(default=1, ge=1, le=5)
    #: credentials for a server with authorization on (nats-server.conf's users); a
    #: user:password in ``nats_url`` works too. ``nats_creds``: a .creds file (JWT + nkey)
    nats_user: str = ""
    nats_password: str = ""
    nats_token: str = ""
    nats_creds: str = ""
    # -- telemetry -------------------------------------------------------------------------
    #: serve /metrics and /healthz on this port (0: any free port); None: not served
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    #: where /metrics listens; loopback unless exposed on purpose (0.0.0.0 in a container)
    metrics_host: str = "127.0.0.1"
    #: "text" or "json" (one JSON object per line, with request, task, trace and agent ids)
    log_format: str = "text"
    log_level: str = "INFO"
    #: spans from the ``reach`` entry points: "none", "console" or "otlp" (the ``otlp``
    #: extra, and ``otlp_endpoint``); an application configures its own tracer provider
    trace_exporter: str = "none"
    otlp_endpoint: str = ""
    trace_sample_ratio: float = Field(default=1.0, ge=0, le=1)

    @field_validator("routing")
    @classmethod
    def _routing(cls, value: str) -> str:
        allowed = ("balanced", "scored", "queue", "affinity")
        if value not in allowed:
            raise ValueError(f"routing must be one of {', '.join(allowed)}")
        return value

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value not in ("text", "json"):
            raise ValueError("log_format must be text or json")
        return value

    @field_validator("trace_exporter")
    @classmethod
    def _trace_exporter(cls, value: str) -> str:
        if value not in ("none", "console", "otlp"):
            raise ValueError("trace_exporter must be none, console or otlp")
        return value

    @property
    def stream_replicas(self) -> int:
        """Replicas of the task streams and buckets."""
        return self.task_replicas or self.replicas

    @field_validator("subject_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        return validate_prefix(value)

    @model_validator(mode="after")
    def _task_limits(self) -> Self:
        """Task settings that contradict each other would lose records or attempts: a record
        gone before its task can end or before its idempotency key does, and JetStream
        giving up on a message before the last attempt."""
        if self.task_retention < self.task_timeout:
            raise ValueError(
                f"task_retention ({self.task_retention}s) must be >= task_timeout "
                f"({self.task_timeout}s): a record would expire while its task runs"
            )
        if self.task_retention < self.task_idempotency_ttl:
            raise ValueError(
                f"task_retention ({self.task_retention}s) must be >= task_idempotency_ttl "
                f"({self.task_idempotency_ttl}s): a key would name a task whose record is gone"
            )
        if self.task_max_deliver <= self.task_max_attempts:
            raise ValueError(
                f"task_max_deliver ({self.task_max_deliver}) must be > task_max_attempts "
                f"({self.task_max_attempts}): JetStream would stop before the last attempt"
            )
        return self
