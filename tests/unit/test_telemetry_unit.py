"""Telemetry's pure parts: fixed-bucket histograms, the merging collector, the catalogue
guard against two collectors on one registry, scrape errors, breaker metrics, JSON logs
and tracing from settings."""

import logging
import sys

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from reach import ConfigurationError, ReachSettings, Telemetry
from reach._client.metrics import ClientMetrics
from reach._routing import Router
from reach._telemetry import CATALOGUE, Histogram, JsonFormatter, configure_tracing


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert list(h.cumulative()) == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4
    assert h.sum == pytest.approx(2.65)


def test_sources_are_merged_into_one_family_per_name():
    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    for agent_id in ("a-1", "a-2"):
        telemetry.add_source(
            lambda out, a=agent_id: out.gauge("reach_agent_info", ("a", a, "UP"), 1)
        )
    text = telemetry.exposition().decode()
    assert text.count("# TYPE reach_agent_info gauge") == 1
    assert 'agent_id="a-1"' in text
    assert 'agent_id="a-2"' in text


def test_a_second_reach_collector_on_one_registry_is_refused():
    registry = CollectorRegistry()
    Telemetry(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Telemetry(registry)


def test_a_failing_source_is_counted_and_the_rest_still_scraped(caplog):
    telemetry = Telemetry()

    def broken(out):
        raise RuntimeError("bug")

    telemetry.add_source(broken)
    telemetry.add_source(lambda out: out.counter("reach_registry_heartbeats", (), 3))
    with caplog.at_level(logging.ERROR, "reach.telemetry"):
        text = telemetry.exposition().decode()
    assert "reach_registry_heartbeats_total 3.0" in text
    assert telemetry.scrape_errors == 1
    assert "failed" in caplog.text


def test_removed_sources_and_off_telemetry_report_nothing():
    telemetry = Telemetry()
    remove = telemetry.add_source(lambda out: out.counter("reach_registry_heartbeats", (), 1))
    remove()
    assert b"reach_registry_heartbeats_total" not in telemetry.exposition()
    off = Telemetry.off()
    off.add_source(lambda out: out.counter("reach_registry_heartbeats", (), 1))
    assert off.exposition() == b""
    assert off.tracer is None


def test_breaker_openings_and_state_per_instance():
    router = Router()
    for _ in range(5):
        router.started("sick-1")
        router.finished("sick-1", "w.do", "timeout", 1.0, 0.0)
    metrics = ClientMetrics(router)
    telemetry = Telemetry()
    telemetry.add_source(metrics.collect)
    registry = telemetry.registry
    assert registry.get_sample_value("reach_client_breaker_open", {"agent_id": "sick-1"}) == 1
    labels = {"agent_id": "sick-1"}
    assert registry.get_sample_value("reach_client_breaker_openings_total", labels) == 1
    router.forget("sick-1")
    assert registry.get_sample_value("reach_client_breaker_openings_total", labels) is None


def test_catalogue_names_follow_conventions():
    for name, spec in CATALOGUE.items():
        assert name.startswith("reach_")
        assert not name.endswith("_total"), name  # prometheus-client adds it to counters
        assert spec.help.endswith(".")
        assert not {"request_id", "task_id", "payload"} & set(spec.labels), name
        if spec.kind == "histogram":
            assert name.endswith("_seconds"), name


def test_json_formatter_writes_one_object_with_ids_and_traceback():
    record = logging.LogRecord("reach.agent", logging.ERROR, __file__, 1, "boom %s", ("x",), None)
    record.request_id, record.agent_id = "r-1", "a-1"
    try:
        raise ValueError("inner")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line  # the traceback is escaped inside the one line
    out = msgspec.json.decode(line)
    assert out["message"] == "boom x"
    assert out["request_id"] == "r-1"
    assert out["agent_id"] == "a-1"
    assert "ValueError: inner" in out["exception"]


def test_tracing_from_settings():
    assert configure_tracing(ReachSettings(), "svc") is None
    provider = configure_tracing(ReachSettings(trace_exporter="console"), "svc")
    assert provider is not None
    provider.shutdown()
    with pytest.raises(ConfigurationError, match="REACH_OTLP_ENDPOINT"):
        configure_tracing(ReachSettings(trace_exporter="otlp"), "svc")
    with pytest.raises(ValueError, match="trace_exporter"):
        ReachSettings(trace_exporter="zipkin")
    with pytest.raises(ValueError, match="log_format"):
        ReachSettings(log_format="xml")


def test_samples_with_the_same_labels_are_merged_not_repeated():
    """Two agents of one name, or two clients, on one Telemetry: one series each, summed."""
    telemetry = Telemetry()
    for inflight in (0, 5):
        telemetry.add_source(
            lambda out, n=inflight: out.gauge("reach_agent_requests_in_flight", ("billing",), n)
        )
    for latency in (0.001, 2.0):
        h = Histogram((0.01, 1.0))
        h.observe(latency)
        telemetry.add_source(
            lambda out, h=h: out.histogram("reach_client_request_duration_seconds", ("c",), h)
        )
    text = telemetry.exposition().decode()
    assert text.count("reach_agent_requests_in_flight{") == 1
    assert 'reach_agent_requests_in_flight{agent="billing"} 5.0' in text
    assert 'reach_client_request_duration_seconds_count{capability="c"} 2.0' in text
    assert 'reach_client_request_duration_seconds_bucket{capability="c",le="0.01"} 1.0' in text


def test_a_raising_health_check_counts_as_unhealthy():
    telemetry = Telemetry()

    def boom() -> bool:
        raise RuntimeError("check broke")

    telemetry.add_health("broken", boom)
    telemetry.add_health("fine", lambda: True)
    ok, details = telemetry.health()
    assert not ok
    assert details["checks"] == {"broken": False, "fine": True}
