"""What the observability tests share: the shipped dashboard and rule files, the PromQL
they contain, how an exposed series name maps back to the catalogue, and the tools.

The catalogue (``reach/_telemetry/catalogue.py``) is the one list of what Reach exports;
everything the dashboard and the alerts query must resolve to an entry of it.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from reach._telemetry import CATALOGUE, LAG_BUCKETS, LATENCY_BUCKETS, Emitter, Histogram
from reach.wire import Status

from .tools import need

ROOT = Path(__file__).parents[1]
PROMETHEUS_DIR = ROOT / "services" / "prometheus"
DASHBOARD = ROOT / "services" / "grafana" / "dashboards" / "reach.json"
GRAFANA_PROVISIONING = ROOT / "services" / "grafana" / "provisioning"

#: series names PromQL may use besides Reach's own: Prometheus's target health
NOT_REACH = {"up"}
#: labels Prometheus adds to every scraped series
TARGET_LABELS = {"job", "instance"}

_SUFFIXES = {
    "_total": "counter",
    "_bucket": "histogram",
    "_sum": "histogram",
    "_count": "histogram",
}
_METRIC = re.compile(r"\breach_[a-z0-9_]+")
_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = [
        (f"panel {p['title']!r} target {t['refId']}", t["expr"])
        for p in panels(dash)
        for t in p.get("targets", [])
    ]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out.append(
                (f"variable {var['name']}", query["query"] if isinstance(query, dict) else query)
            )
    return out


def substitute(expr: str) -> str:
    """A dashboard query as Grafana sends it with every capability selected."""
    return expr.replace("$__rate_interval", "1m").replace("$capability", ".*")


def alert_rules() -> list[dict[str, Any]]:
    groups = load_yaml(PROMETHEUS_DIR / "alerts.yml")["groups"]
    return [rule for group in groups for rule in group["rules"]]


def family(series: str) -> str | None:
    """The catalogue name a queried series name belongs to, or None if it names nothing Reach
    exposes (a counter without ``_total``, a histogram without ``_bucket`` etc., a typo)."""
    for suffix, kind in _SUFFIXES.items():
        base = series.removesuffix(suffix)
        if base != series and base in CATALOGUE and CATALOGUE[base].kind == kind:
            return base
    spec = CATALOGUE.get(series)
    return series if spec is not None and spec.kind == "gauge" else None


def metric_names(expr: str) -> list[str]:
    return _METRIC.findall(expr)


def label_problems(expr: str) -> list[str]:
    """Labels ``expr`` matches on or groups by that the series it reads do not carry."""
    problems = []
    names = metric_names(expr)
    carried = set(TARGET_LABELS)
    for name in names:
        base = family(name)
        if base is not None:
            carried.update(CATALOGUE[base].labels)
            if name.endswith("_bucket"):
                carried.add("le")
    for name, matchers in _SELECTOR.findall(expr):
        base = family(name)
        if base is None:
            if name not in NOT_REACH:
                problems.append(f"{name} is neither in the catalogue nor one of {NOT_REACH}")
            continue
        own = {
            *CATALOGUE[base].labels,
            *TARGET_LABELS,
            *(["le"] if name.endswith("_bucket") else []),
        }
        problems += [
            f"{name} has no label {label!r}"
            for label, _, _ in _MATCHER.findall(matchers)
            if label not in own
        ]
    for group in _GROUPING.findall(expr):
        for label in filter(None, (part.strip() for part in group.split(","))):
            if label not in carried:
                problems.append(f"grouping by {label!r}, which none of {names} carries")
    return problems


def matched_values(expr: str, label: str) -> list[str]:
    """Values a selector in ``expr`` compares ``label`` with (alternations split)."""
    values = []
    for _, matchers in _SELECTOR.findall(expr):
        for name, _, value in _MATCHER.findall(matchers):
            if name == label:
                values += value.split("|")
    return values


def tool(name: str) -> str:
    """Path of a Prometheus tool (promtool, prometheus): skipped without it, failed where
    ``REACH_REQUIRE_TOOLS=1`` (CI, whose .ci/run installs it)."""
    return need(name, "apt-get install prometheus")


def emit_catalogue(out: Emitter) -> None:
    """Samples of every catalogue entry: a ``Telemetry`` source.

    Every status and an error outcome get a series of their own, so that each dashboard
    query finds data (one filters on DOWN, another on outcomes other than ok). Gauges are 1
    (a ``> 0`` still matches), counters 3, histograms hold one observation.
    """
    for name, spec in CATALOGUE.items():
        values = [_SAMPLE_LABELS.get(label, [f"{label}-1"]) for label in spec.labels]
        for labels in itertools.product(*values):
            if spec.kind == "counter":
                out.counter(name, labels, 3)
            elif spec.kind == "gauge":
                out.gauge(name, labels, 1)
            else:
                hist = Histogram(LAG_BUCKETS if "lag" in name else LATENCY_BUCKETS)
                hist.observe(0.02)
                out.histogram(name, labels, hist)


_SAMPLE_LABELS = {
    "capability": ["geo.route"],
    "status": [s.value for s in Status],
    "outcome": ["ok", "timeout"],
    "priority": ["normal"],
    "policy": ["balanced"],
    "agent": ["router"],
    "agent_id": ["router-1"],
    "state": ["completed", "SCHEDULED"],
}
