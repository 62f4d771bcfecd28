"""The shipped monitoring files and Reach's exposition, run through Debian's promtool.

Without promtool these tests are skipped, saying how to install it; CI installs the
`prometheus` package in .ci/run and sets REACH_REQUIRE_TOOLS=1, which makes them fail instead.
"""

import subprocess

import yaml

from reach.telemetry import Telemetry

from ..observability import (
    PROMETHEUS_DIR,
    dashboard,
    dashboard_exprs,
    emit_catalogue,
    substitute,
    tool,
)


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"promtool exited {result.returncode}\n{result.stdout}\n{result.stderr}"


def test_alert_rules_pass_promtool_check_rules():
    result = promtool("check", "rules", str(PROMETHEUS_DIR / "alerts.yml"))
    assert result.returncode == 0, explain(result)
    assert "SUCCESS" in result.stdout


def test_alert_unit_tests_pass():
    result = promtool("test", "rules", str(PROMETHEUS_DIR / "alerts_test.yml"))
    assert result.returncode == 0, explain(result)
    assert "SUCCESS" in result.stdout


def test_scrape_config_passes_promtool_check_config():
    # Static and DNS targets are only parsed here, never resolved, so the compose service
    # names need not exist on this machine; the rule files it names must (they are loaded).
    result = promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert result.returncode == 0, explain(result)
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_every_dashboard_query_is_valid_promql(tmp_path):
    """promtool parses each panel's query as a recording rule (Grafana's variables replaced
    by what they stand for), so a typo in a panel fails here and not on a screen at 3 a.m."""
    exprs = dashboard_exprs(dashboard())
    rules = [
        {"record": f"dashboard:query_{i}", "expr": substitute(expr)}
        for i, (_, expr) in enumerate(exprs)
        if not expr.startswith("label_values(")  # Grafana's own function, not PromQL
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, explain(result)
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_every_catalogue_metric_passes_promtool_check_metrics():
    """Names, help, types and units of the whole catalogue, as a process exposes them."""
    telemetry = Telemetry()
    telemetry.add_source(emit_catalogue)
    exposition = telemetry.exposition()
    assert exposition.count(b"# TYPE reach_") >= 30
    result = promtool("check", "metrics", stdin=exposition)
    assert (result.returncode, result.stdout + result.stderr) == (0, ""), explain(result)
