"""The shipped dashboard, alert rules and scrape config query only what Reach exports.

Pure file checks against the catalogue; promtool and a real Prometheus run the same files
in tests/integration/test_observability_tools.py and test_prometheus_scrape.py.
"""

import re

import pytest

from reach._telemetry import CATALOGUE
from reach.wire import Priority, Status

from ..observability import (
    GRAFANA_PROVISIONING,
    PROMETHEUS_DIR,
    ROOT,
    alert_rules,
    dashboard,
    dashboard_exprs,
    family,
    label_problems,
    load_yaml,
    matched_values,
    metric_names,
    panels,
)

DASH = dashboard()
DASH_EXPRS = dashboard_exprs(DASH)
RULES = alert_rules()
RULE_EXPRS = [(f"alert {r['alert']}", r["expr"]) for r in RULES]
ALL_EXPRS = DASH_EXPRS + RULE_EXPRS


def exposed(name: str) -> list[str]:
    kind = CATALOGUE[name].kind
    if kind == "counter":
        return [f"{name}_total"]
    if kind == "histogram":
        return [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
    return [name]


# -- the resolver the other checks rely on -------------------------------------------------


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        ("reach_client_requests_total", "reach_client_requests"),
        ("reach_client_requests", None),  # a counter is exposed with _total only
        ("reach_registry_heartbeat_lag_seconds_bucket", "reach_registry_heartbeat_lag_seconds"),
        ("reach_registry_heartbeat_lag_seconds", None),  # a histogram has no bare series
        ("reach_registry_agents", "reach_registry_agents"),
        ("reach_registry_agents_total", None),  # a gauge has no _total
        ("reach_no_such_thing", None),
    ],
)
def test_family_resolves_only_exposed_names(series, expected):
    assert family(series) == expected


def test_label_check_catches_wrong_labels():
    assert (
        label_problems('sum by (capability) (rate(reach_client_requests_total{outcome="ok"}[5m]))')
        == []
    )
    assert (
        label_problems("sum by (le) (rate(reach_registry_heartbeat_lag_seconds_bucket[5m]))") == []
    )
    assert label_problems("sum by (agent) (reach_client_requests_in_flight)") != []
    assert label_problems('reach_registry_agents{state="UP"}') != []
    assert label_problems('reach_registry_agent{status="UP"}') != []


# -- every query names real metrics and labels ---------------------------------------------


@pytest.mark.parametrize(("where", "expr"), ALL_EXPRS, ids=[w for w, _ in ALL_EXPRS])
def test_every_queried_metric_is_in_the_catalogue(where, expr):
    names = metric_names(expr)
    assert names or "up{" in expr, f"{where} queries no reach_ metric: {expr}"
    unknown = [n for n in names if family(n) is None]
    assert unknown == [], f"{where}: {unknown} are not exposed by Reach (catalogue.py)"


@pytest.mark.parametrize(("where", "expr"), ALL_EXPRS, ids=[w for w, _ in ALL_EXPRS])
def test_every_label_used_is_carried(where, expr):
    assert label_problems(expr) == [], where


def test_label_values_are_real_statuses_and_priorities():
    statuses = {s.value for s in Status}
    priorities = {p.value for p in Priority}
    exprs = [e for _, e in ALL_EXPRS]
    used = [v for e in exprs for v in matched_values(e, "status")]
    assert used, "no query filters by status; the check below would prove nothing"
    assert set(used) <= statuses
    assert {v for e in exprs for v in matched_values(e, "priority")} <= priorities


def test_dashboard_covers_every_metric_family():
    """A metric nobody can see is a metric nobody needs: each one has a panel."""
    shown = {family(n) for _, e in DASH_EXPRS for n in metric_names(e)}
    assert set(CATALOGUE) - shown == set()


# -- the dashboard -------------------------------------------------------------------------


def test_dashboard_is_a_provisionable_grafana_dashboard():
    assert isinstance(DASH["schemaVersion"], int)
    assert DASH["schemaVersion"] >= 36
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", DASH["uid"])
    assert DASH["title"]
    ids = [p["id"] for p in panels(DASH)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(DASH):
        pos = p["gridPos"]
        assert (pos["x"] >= 0, pos["x"] + pos["w"] <= 24, pos["h"] > 0) == (True,) * 3, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs, p["title"]
        assert len(refs) == len(set(refs)), p["title"]
        assert p.get("description"), f"panel {p['title']!r} says what it shows"


def test_dashboard_has_capability_and_datasource_variables():
    variables = {v["name"]: v for v in DASH["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    cap = variables["capability"]
    assert cap["type"] == "query"
    assert cap["includeAll"]
    assert cap["multi"]
    assert "capability" in cap["definition"]


def test_panels_with_a_capability_label_follow_the_variable():
    for p in panels(DASH):
        for t in p.get("targets", []):
            for name in metric_names(t["expr"]):
                base = family(name)
                if base is not None and "capability" in CATALOGUE[base].labels:
                    assert f'{name}{{capability=~"$capability"' in t["expr"], (p["title"], name)


def test_dashboard_shows_what_the_issue_asks_for():
    shown = {family(n) for _, e in DASH_EXPRS for n in metric_names(e)}
    asked = {
        "fleet status by capability": "reach_registry_agents",
        "request rate and errors": "reach_client_requests",
        "latency": "reach_client_request_duration_seconds",
        "failovers": "reach_client_failovers",
        "breaker openings": "reach_client_breaker_openings",
        "queue depths": "reach_agent_queue_length",
        "task states": "reach_tasks",
        "DLQ size": "reach_dlq_messages",
        "heartbeat lag": "reach_registry_heartbeat_lag_seconds",
    }
    assert {what for what, name in asked.items() if name not in shown} == set()
    latency = [e for _, e in DASH_EXPRS if "reach_client_request_duration_seconds_bucket" in e]
    assert {q for e in latency for q in re.findall(r"histogram_quantile\((0\.\d+)", e)} >= {
        "0.5",
        "0.95",
        "0.99",
    }


# -- the alert rules -----------------------------------------------------------------------


def test_every_alert_has_severity_and_explains_itself():
    assert len(RULES) >= 5
    for rule in RULES:
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]


def test_the_alerts_the_issue_asks_for_exist():
    by_metric = {r["alert"]: {family(n) for n in metric_names(r["expr"])} for r in RULES}
    asked = [
        "reach_registry_agents",  # an agent DOWN, a capability with no live instance
        "reach_client_requests",  # error rate
        "reach_agent_requests",
        "reach_dlq_messages",
        "reach_registry_heartbeat_lag_seconds",
    ]
    assert [m for m in asked if not any(m in used for used in by_metric.values())] == []
    assert any('status="DOWN"' in r["expr"] for r in RULES)


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    tests = load_yaml(PROMETHEUS_DIR / "alerts_test.yml")["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    for rule in RULES:
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c.get("exp_alerts") for c in mine), f"{rule['alert']} is never seen firing"
        assert any(not c.get("exp_alerts") for c in mine), f"{rule['alert']} is never seen quiet"


# -- scrape config and provisioning --------------------------------------------------------


def test_scrape_config_loads_the_rules_and_names_the_jobs_the_rules_use():
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    used = {v for _, e in RULE_EXPRS for v in matched_values(e, "job")}
    assert used
    assert used <= jobs


def test_scrape_config_covers_every_reach_service_on_the_metrics_port():
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    targets = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
        for dns in job.get("dns_sd_configs", []):
            targets.update(f"{name}:{dns['port']}" for name in dns["names"])
    services = ["registry", "agent-logistics", "agent-aftersales", "client", "gateway"]
    assert {f"{s}:9464" for s in services} <= targets


def test_grafana_provisioning_points_at_the_dashboards_and_prometheus():
    providers = load_yaml(GRAFANA_PROVISIONING / "dashboards" / "reach.yml")["providers"]
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards"]
    sources = load_yaml(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert [(s["type"], s["url"]) for s in sources] == [("prometheus", "http://prometheus:9090")]
    default = {v["name"]: v for v in DASH["templating"]["list"]}["datasource"]["current"]
    assert default["value"] == sources[0]["uid"]


# -- the README ----------------------------------------------------------------------------


def test_the_telemetry_page_lists_every_metric():
    """The docs' table (docs/telemetry.md, since the README moved its reference content
    there) is written by hand from the catalogue; it must not fall behind."""
    page = (ROOT / "docs" / "telemetry.md").read_text()
    section = page.split("## Metrics", 1)[1].split("\n## `reach status`", 1)[0]
    rows = {
        f"| `{exposed(name)[0] if spec.kind != 'histogram' else name}` | {spec.kind} |"
        for name, spec in CATALOGUE.items()
    }
    assert {row for row in rows if row not in section} == set()
    assert "services/grafana/dashboards/reach.json" in section
    assert [r["alert"] for r in RULES if f"`{r['alert']}`" not in section] == []
