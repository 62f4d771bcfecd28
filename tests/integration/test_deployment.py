"""docker-compose.yml, checked by the real docker-compose (Debian's 1.29 in CI: `.ci/run`
installs it); there is no Docker engine, so nothing runs. Beyond "it validates": every
Reach process connects as a user of the shipped secured config with that user's password,
each agent runs under its own id, and the cluster profile is three routed nodes at R3."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..tools import need

ROOT = Path(__file__).parents[2]
CONF = ROOT / "services" / "nats" / "nats-server.conf"
NODES = ("nats-1", "nats-2", "nats-3")


SECRETS = (
    "NATS_REGISTRY_PASSWORD",
    "NATS_CLIENT_PASSWORD",
    "NATS_LOGISTICS_1_PASSWORD",
    "NATS_AFTERSALES_1_PASSWORD",
    "NATS_ADMIN_PASSWORD",
    "NATS_SYSTEM_PASSWORD",
    "GRAFANA_ADMIN_PASSWORD",
    "GATEWAY_TOKEN",
)


def compose(*args: str, secrets: bool = True) -> subprocess.CompletedProcess[str]:
    binary = need("docker-compose", "apt-get install docker-compose")
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    if secrets:
        env |= {name: f"test-{name.lower()}" for name in SECRETS}
    return subprocess.run(
        [binary, "-f", "docker-compose.yml", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    """The cluster profile's full config, interpolated with the file's defaults."""
    out = compose("--profile", "cluster", "config")
    assert out.returncode == 0, out.stderr
    services: dict[str, Any] = yaml.safe_load(out.stdout)["services"]
    return services


def users_of_config() -> dict[str, str]:
    """user -> the environment variable holding its password, from the secured config."""
    text = CONF.read_text()
    found = re.findall(r'user:\s*"?([\w-]+)"?\s*[,\n]\s*password:\s*\$(\w+)', text)
    return dict(found)


@pytest.mark.parametrize("profile", [(), ("--profile", "cluster")], ids=["default", "cluster"])
def test_the_compose_file_validates(profile: tuple[str, ...]):
    out = compose(*profile, "config", "-q")
    assert out.returncode == 0, out.stderr


def test_no_secret_has_a_default():
    """Without the passwords set, compose refuses to run rather than ship a known one."""
    out = compose("config", "-q", secrets=False)
    assert out.returncode != 0
    assert "NATS_" in out.stderr or "GRAFANA_" in out.stderr or "GATEWAY_" in out.stderr


def test_task_streams_are_made_by_admin_before_agents_and_clients(rendered: dict[str, Any]):
    for init, dependents in (
        ("tasks-init", ("agent-logistics", "agent-aftersales", "client")),
        ("tasks-init-r3", ("agent-logistics-r3", "agent-aftersales-r3", "client-r3")),
    ):
        assert rendered[init]["command"] == ["reach", "tasks", "init"]
        assert rendered[init]["environment"]["REACH_NATS_USER"] == "admin"
        for name in dependents:
            condition = rendered[name]["depends_on"][init]["condition"]
            assert condition == "service_completed_successfully", name


def test_every_reach_process_is_a_user_of_the_secured_config(rendered: dict[str, Any]):
    users = users_of_config()
    assert set(users) >= {"registry", "client", "logistics-1", "aftersales-1", "admin"}
    reach = {n: s for n, s in rendered.items() if "REACH_NATS_USER" in s.get("environment", {})}
    stack = ("tasks-init", "registry", "agent-logistics", "agent-aftersales", "client")
    assert set(reach) == {*stack, *(f"{name}-r3" for name in stack), "gateway"}
    for name, service in reach.items():
        env = service["environment"]
        user = env["REACH_NATS_USER"]
        server = rendered["nats-1" if name.endswith("-r3") else "nats"]
        assert env["REACH_NATS_PASSWORD"] == server["environment"][users[user]], name
        assert env["REACH_METRICS_PORT"] == "9464"
        assert env["REACH_METRICS_HOST"] == "0.0.0.0"
        if user.endswith("-1"):  # an agent's own user: it must run under that agent id
            assert service["command"][-1] == user, name


def test_nats_runs_the_secured_config_with_a_volume_and_a_health_check(
    rendered: dict[str, Any],
):
    for name in ("nats", *NODES):
        service = rendered[name]
        assert service["image"].startswith("nats:")
        assert any(v.endswith(":/etc/nats/nats-server.conf:ro") for v in service["volumes"])
        assert any(v.split(":")[1] == "/data" for v in service["volumes"])
        assert "8222/healthz" in " ".join(service["healthcheck"]["test"])
    assert 'store_dir: "/data/jetstream"' in CONF.read_text()


def test_the_cluster_profile_is_three_routed_nodes_at_r3(rendered: dict[str, Any]):
    for node in NODES:
        command = rendered[node]["command"]
        assert rendered[node]["profiles"] == ["cluster"]
        assert command[command.index("--server_name") + 1] == node
        routes = command[command.index("--routes") + 1]
        assert routes == ",".join(f"nats://{n}:6222" for n in NODES)
    for name, service in rendered.items():
        if name.endswith("-r3"):
            assert service["environment"]["REACH_REPLICAS"] == "3"
            assert service["environment"]["REACH_NATS_URL"].count("nats://") == 3
            assert set(service["depends_on"]) - {"tasks-init-r3"} == set(NODES)


def test_prometheus_and_grafana_get_the_provisioning_files(rendered: dict[str, Any]):
    mounts = {
        v.split(":")[0].removeprefix(str(ROOT) + "/")
        for name in ("prometheus", "grafana")
        for v in rendered[name]["volumes"]
    }
    assert mounts == {
        "services/prometheus/prometheus.yml",
        "services/prometheus/alerts.yml",
        "services/grafana/provisioning",
        "services/grafana/dashboards",
    }


@pytest.mark.parametrize(
    "dockerfile",
    ["services/registry/Dockerfile", "services/gateway/Dockerfile", "sdk/examples/Dockerfile"],
)
def test_images_run_as_an_unprivileged_user(dockerfile: str):
    lines = [line.split() for line in (ROOT / dockerfile).read_text().splitlines() if line.strip()]
    users = [i for i, words in enumerate(lines) if words[0] == "USER"]
    runs = [i for i, words in enumerate(lines) if words[0] == "RUN"]
    assert users
    assert users[-1] > runs[-1], "USER must come after the last RUN"
    assert lines[users[-1]][1] not in {"root", "0"}


def test_the_build_context_leaves_out_the_venv_and_the_history():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)
