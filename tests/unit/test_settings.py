import pytest
from pydantic import ValidationError

from reach import Agent, Client, ConfigurationError, ReachSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in ("REACH_NATS_URL", "REACH_TIMEOUT_MS", "REACH_MAX_CONCURRENCY", "REACH_MAX_QUEUE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)


def test_defaults():
    s = ReachSettings()
    assert s.nats_url == "nats://127.0.0.1:4222"
    assert s.subject_prefix == "reach"
    assert s.heartbeat_interval == 5
    assert s.lease_ttl == 15


def test_precedence_arguments_over_env_over_dotenv_over_defaults(monkeypatch, tmp_path):
    (tmp_path / ".env").write_text("REACH_TIMEOUT_MS=1111\nREACH_MAX_QUEUE=7\n")
    s = ReachSettings()
    assert (s.timeout_ms, s.max_queue) == (1111, 7)
    monkeypatch.setenv("REACH_TIMEOUT_MS", "2222")
    s = ReachSettings()
    assert (s.timeout_ms, s.max_queue) == (2222, 7)
    s = ReachSettings(timeout_ms=3333)
    assert (s.timeout_ms, s.max_queue) == (3333, 7)


def test_env_url_reaches_clients_and_agents(monkeypatch):
    monkeypatch.setenv("REACH_NATS_URL", "nats://127.0.0.1:4999")
    assert Client().url == "nats://127.0.0.1:4999"
    assert Client("nats://127.0.0.1:5000").url == "nats://127.0.0.1:5000"


def test_explicit_agent_arguments_win(monkeypatch):
    monkeypatch.setenv("REACH_MAX_CONCURRENCY", "3")
    assert Agent("a").max_concurrency == 3
    assert Agent("a", max_concurrency=5).max_concurrency == 5


def test_invalid_settings_are_rejected():
    with pytest.raises(ValidationError):
        ReachSettings(timeout_ms=0)
    with pytest.raises(ValidationError, match="prefix"):
        ReachSettings(subject_prefix="a b")


def test_agent_identity_is_validated():
    assert Agent("translator").agent_id.startswith("translator-")
    with pytest.raises(ConfigurationError, match="agent_id"):
        Agent("translator", "bad.id")
    with pytest.raises(ConfigurationError, match="agent_id"):
        Agent("has space")


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"task_retention": 60.0, "task_timeout": 120.0}, "task_timeout"),
        ({"task_retention": 60.0, "task_timeout": 30.0, "task_idempotency_ttl": 600.0}, "ttl"),
        ({"task_max_deliver": 3, "task_max_attempts": 3}, "task_max_attempts"),
        ({"task_max_deliver": 2, "task_max_attempts": 5}, "task_max_deliver"),
    ],
)
def test_task_settings_that_contradict_each_other_are_refused(values, named):
    with pytest.raises(ValidationError, match=named):
        ReachSettings(**values)


def test_task_settings_that_agree_are_accepted():
    s = ReachSettings(
        task_retention=600.0,
        task_timeout=600.0,
        task_idempotency_ttl=600.0,
        task_max_deliver=4,
        task_max_attempts=3,
    )
    assert (s.task_retention, s.task_max_deliver) == (600.0, 4)
