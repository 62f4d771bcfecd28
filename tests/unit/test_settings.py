import msgspec
import pytest
from pydantic import ValidationError

from reach import Agent, Client, ConfigurationError, Priority, ReachSettings, Status
from reach._nats import credentials
from reach._routing import reject_reason
from reach.wire import AgentInfo, AgentRecord, CapabilityInfo


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


def test_secrets_are_never_shown():
    s = ReachSettings(
        nats_url="nats://client:url-pw@127.0.0.1:4222",
        nats_user="client",
        nats_password="the-pw",
        nats_token="the-token",
    )
    for shown in (repr(s), str(s), s.model_dump_json(), str(s.model_dump())):
        assert "the-pw" not in shown
        assert "the-token" not in shown
    assert "url-pw" not in repr(s)
    assert "nats://client:***@127.0.0.1:4222" in repr(s)
    # read at the connect boundary only
    assert credentials(s, "nats://127.0.0.1:4222") == {"user": "client", "password": "the-pw"}
    assert credentials(ReachSettings(nats_token="the-token"), "nats://h:4222") == {
        "token": "the-token"
    }


def test_a_settings_error_does_not_print_the_secrets_given():
    with pytest.raises(ValidationError) as info:
        ReachSettings(nats_password="the-pw", heartbeat_interval=20.0)
    assert "the-pw" not in str(info.value)
    with pytest.raises(ConfigurationError, match="heartbeat_interval") as bad:
        ReachSettings.load(nats_password="the-pw", heartbeat_interval=20.0)
    assert "the-pw" not in str(bad.value)
    assert "\n" not in str(bad.value)


@pytest.mark.parametrize(
    ("heartbeat_interval", "lease_ttl"), [(20.0, 15.0), (8.0, 15.0), (1.0, 1.5)]
)
def test_a_lease_that_cannot_outlive_two_heartbeats_is_refused(heartbeat_interval, lease_ttl):
    """The agent would flap between UP and DOWN whenever one heartbeat is late."""
    with pytest.raises(ValidationError, match=r"lease_ttl .* at least 2 x heartbeat_interval"):
        ReachSettings(heartbeat_interval=heartbeat_interval, lease_ttl=lease_ttl)


def test_the_default_lease_and_the_tests_fast_ones_outlive_two_heartbeats():
    assert ReachSettings().lease_ttl >= 2 * ReachSettings().heartbeat_interval
    ReachSettings(heartbeat_interval=7.5, lease_ttl=15.0)  # exactly two: accepted
    ReachSettings(heartbeat_interval=0.2, lease_ttl=1.0)  # registry_wire.fast_settings
    ReachSettings(heartbeat_interval=0.5, lease_ttl=2.0)  # the demo, the chaos harness


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"max_concurrency": 0}, "max_concurrency=0"),
        ({"max_concurrency": -2}, "max_concurrency=-2"),
        ({"max_queue": -1}, "max_queue=-1"),
    ],
)
def test_agent_limits_out_of_range_are_refused_not_replaced(arguments, named):
    with pytest.raises(ConfigurationError, match=named) as info:
        Agent("a", **arguments)
    assert "pass" in str(info.value)  # and it says what to pass


def test_agent_limits_given_are_kept():
    assert Agent("a", max_queue=0).max_queue == 0
    assert Agent("a", max_concurrency=1).max_concurrency == 1
    assert Agent("a").max_concurrency == ReachSettings().max_concurrency


def test_every_version_default_is_the_same_and_old_ones_still_route():
    agent = Agent("versions")

    @agent.capability("v.cap")
    async def cap(payload: dict) -> dict:
        return payload

    @agent.task("v.task")
    async def task(payload: dict) -> dict:
        return payload

    info = agent.info()
    assert info.version == "1.0.0"
    assert [c.version for c in info.capabilities + info.tasks] == ["1.0.0", "1.0.0"]
    assert CapabilityInfo(name="x").version == "1.0.0"
    decoded = msgspec.json.decode(b'{"type": "reach.capability", "name": "x"}', type=CapabilityInfo)
    assert decoded.version == "1.0.0"
    # an agent of before (capabilities "1.0") serves callers asking for 1.0.0 and the reverse
    old = AgentRecord(
        info=AgentInfo(
            agent_id="old-1", name="old", capabilities=[CapabilityInfo(name="x", version="1.0")]
        ),
        status=Status.UP,
    )
    assert reject_reason(old, "x", "1.0.0", (), Priority.NORMAL) is None
    new = AgentRecord(info=info, status=Status.UP)
    assert reject_reason(new, "v.cap", "1.0", (), Priority.NORMAL) is None
