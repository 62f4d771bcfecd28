"""Settings for every Agent-Reach process, from ``REACH_*`` variables, ``.env``, a settings
file and arguments.

Precedence, highest first: arguments passed to ``ReachSettings(...)`` (and the explicit
arguments of ``Agent``/``Client``), environment variables, a ``.env`` file, the settings
file named by ``REACH_CONFIG`` (or ``reach --config``), defaults. Settings are built at the
program's edge and passed in; nothing reads them at import.
"""

from __future__ import annotations

import difflib
import importlib
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from ._settings_errors import load_settings
from ._subjects import validate_prefix
from ._urls import redact
from .errors import ConfigurationError

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
        hide_input_in_errors=True,  # a ValidationError would print every value, secrets too
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
    #: seconds the first connect keeps trying each server of nats_url; then ConnectionFailed
    connect_timeout: float = Field(default=2.0, gt=0)
    routing: str = "balanced"
    max_attempts: int = Field(default=3, ge=1)
    retry_base: float = Field(default=0.2, ge=0)
    retry_cap: float = Field(default=3.0, ge=0)
    retry_budget: float = Field(default=0.2, ge=0)
    breaker_cooldown: float = Field(default=5.0, gt=0)
    #: capability -> [rate per second, burst]; JSON in REACH_RATE_LIMITS
    rate_limits: dict[str, tuple[float, float]] = Field(
        default_factory=dict, examples=['{"text.translate": [50, 100]}']
    )
    #: capability -> {"w_load": .., "w_latency": .., "threshold": ..} for the scored policy
    routing_weights: dict[str, dict[str, float]] = Field(
        default_factory=dict, examples=['{"text.translate": {"w_load": 0.7, "w_latency": 0.3}}']
    )
    #: task type -> capability, so callers can ask by task type
    task_types: dict[str, str] = Field(
        default_factory=dict, examples=['{"translation": "text.translate"}']
    )
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
    # -- durable topics --------------------------------------------------------------------
    #: how long stream ``REACH_TOPICS`` keeps a topic message (its max age; 7 days), and the
    #: most bytes it holds (1 GiB; the oldest go first): the window of ``since`` replays, and
    #: how long a durable subscriber may be away without missing anything
    topic_retention: float = Field(default=7 * 86400.0, gt=0)
    topic_max_bytes: int = Field(default=1 << 30, gt=0)
    #: seconds before a durable topic message whose instance went silent is redelivered; a
    #: running handler's message is kept with in_progress() every third of it
    topic_ack_wait: float = Field(default=30.0, ge=1)
    #: deliveries of one message to one agent name before it goes to the DLQ (a handler that
    #: raised, timed out, or an instance that died holding it)
    topic_max_deliver: int = Field(default=5, ge=1, le=100)
    #: backoff of a redelivery after a handler raised (exponential, jitter in [d/2, d])
    topic_retry_base: float = Field(default=1.0, ge=0)
    topic_retry_cap: float = Field(default=60.0, ge=0)
    #: seconds a durable topic handler may run; then it is cancelled and counts as failed
    #: (its message is nak'd, or dead-lettered on its last delivery). One that ignores its
    #: cancellation for 1 s more is abandoned: its message is settled so all the same, and
    #: it keeps its worker until it returns (counted as stuck, the agent DEGRADED)
    topic_timeout: float = Field(default=60.0, gt=0)
    #: durable topic messages one instance handles at once, per subscription; 0:
    #: max_concurrency (an ``ordered`` subscription handles one at a time)
    topic_concurrency: int = Field(default=0, ge=0)
    #: seconds between samples of a durable subscription's consumer lag (for metrics)
    topic_lag_interval: float = Field(default=15.0, gt=0)
    # -- deployment ------------------------------------------------------------------------
    #: replicas of every stream and KV bucket Reach creates (3 on a 3-node cluster: R3)
    replicas: int = Field(default=1, ge=1, le=5)
    #: credentials for a server with authorization on (nats-server.conf's users); a
    #: user:password in ``nats_url`` works too. ``nats_creds``: a .creds file (JWT + nkey)
    nats_user: str = ""
    #: secrets: shown as ``**********``; read with ``.get_secret_value()`` at the connect only
    nats_password: SecretStr = SecretStr("")
    nats_token: SecretStr = SecretStr("")
    nats_creds: str = ""
    #: the request path's shortcuts through nats-py's internals (about +25% req/s); off:
    #: nats-py's public API only. They also turn themselves off on a nats-py version they
    #: were not tested with (``reach._delivery.TESTED_NATS_PY``), with one warning.
    nats_shortcuts: bool = True
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
    # -- where the rest came from ----------------------------------------------------------
    #: a settings file (.toml; .yaml with PyYAML) whose keys are these names, e.g.
    #: ``nats_url = "nats://nats:4222"``: REACH_CONFIG, or ``reach --config``
    config: str = ""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The settings file sits below the environment and ``.env``, above the defaults."""
        named_by = (init_settings, env_settings, dotenv_settings)
        return (
            init_settings,
            env_settings,
            dotenv_settings,
            _SettingsFile(settings_cls, named_by),
            file_secret_settings,
        )

    @classmethod
    def load(cls, **values: Any) -> Self:
        """Settings as a program's entry point builds them: a bad value or settings file is
        one ``ConfigurationError`` line naming the setting, not pydantic's report."""
        return load_settings(cls, **values)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """A password in ``nats_url`` is not shown either (the secrets are SecretStr)."""
        for name, value in super().__repr_args__():
            yield name, redact(value) if name == "nats_url" else value

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
    def _lease_outlives_heartbeats(self) -> Self:
        """A lease renewed by heartbeats must outlive two of them: one heartbeat late or
        lost would otherwise let it expire, and the agent flaps between UP and DOWN."""
        if self.lease_ttl < 2 * self.heartbeat_interval:
            raise ValueError(
                f"lease_ttl ({self.lease_ttl:g}s) must be at least 2 x heartbeat_interval "
                f"({self.heartbeat_interval:g}s), or an agent flaps between UP and DOWN when "
                "a heartbeat is late; raise lease_ttl or lower heartbeat_interval (defaults: "
                "15s and 5s)"
            )
        return self

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


class _SettingsFile(PydanticBaseSettingsSource):
    """The settings file, read here rather than by pydantic-settings' TOML and YAML sources,
    which skip a missing file silently and let an unknown key pass (``extra="ignore"``,
    needed for the environment): a typo in a file must not be ignored."""

    def __init__(
        self, settings_cls: type[BaseSettings], named_by: tuple[PydanticBaseSettingsSource, ...]
    ) -> None:
        super().__init__(settings_cls)
        self._named_by = named_by

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the whole file

    def __call__(self) -> dict[str, Any]:
        path = ""
        for source in self._named_by:  # the first that names one, even as "" (no file)
            named = source()
            if "config" in named:
                path = str(named["config"] or "")
                break
        if not path:
            return {}
        values = _read_settings_file(Path(path))
        known = set(self.settings_cls.model_fields) - {"config"}
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(str(key).lower(), known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else "see the REACH_* settings"
                raise ConfigurationError(
                    f"settings file {path}: unknown setting {key!r}; {hint} (keys are the "
                    "setting names without REACH_, lowercase: nats_url, timeout_ms, ...)"
                )
        return values


def _read_settings_file(path: Path) -> dict[str, Any]:
    """The mapping in a .toml or .yaml file; ConfigurationError (one line) if there is none."""
    where = f"settings file {path}"
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigurationError(f"{where}: use a .toml or .yaml file (REACH_CONFIG, --config)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigurationError(
            f"{where}: no such file; fix the path in REACH_CONFIG (or --config)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigurationError(f"{where}: cannot be read ({why})") from None
    data: Any
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"{where}: not valid TOML ({exc})") from None
    else:
        data = _load_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigurationError(f"{where}: must hold a mapping of setting names to values")
    return data


def _load_yaml(text: str, where: str) -> Any:
    try:
        yaml = importlib.import_module("yaml")  # optional, and without type stubs here
    except ImportError:
        raise ConfigurationError(
            f"{where}: YAML needs PyYAML (pip install pyyaml), or use a .toml file"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        why = " ".join(str(exc).split())  # its report spans lines
        raise ConfigurationError(f"{where}: not valid YAML ({why})") from None
