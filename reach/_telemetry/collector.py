"""One prometheus-client collector per ``Telemetry``: it asks every source (an agent, a
client, a registry) for its numbers at scrape time and merges them into families.

Sources sharing a ``Telemetry`` may report the same series (two agents of one name, an
application's client and an agent's own): their samples are summed (histograms merged),
so every series appears once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .catalogue import CATALOGUE
from .cells import Histogram

__all__ = ["Emitter", "ReachCollector", "Source"]

log = logging.getLogger("reach.telemetry")


class Emitter:
    """What sources write their samples into during one scrape."""

    def __init__(self) -> None:
        self.values: dict[str, dict[tuple[str, ...], float]] = {}
        self.histograms: dict[str, dict[tuple[str, ...], Histogram]] = {}

    def counter(self, name: str, labels: Sequence[str], value: float) -> None:
        self._add(name, labels, value)

    def gauge(self, name: str, labels: Sequence[str], value: float) -> None:
        self._add(name, labels, value)

    def _add(self, name: str, labels: Sequence[str], value: float) -> None:
        series = self.values.setdefault(name, {})
        key = tuple(labels)
        series[key] = series.get(key, 0.0) + value

    def histogram(self, name: str, labels: Sequence[str], hist: Histogram) -> None:
        series = self.histograms.setdefault(name, {})
        key = tuple(labels)
        merged = series.get(key)
        if merged is None:
            merged = series[key] = Histogram(hist.bounds)
        merged.merge(hist)

    def families(self) -> Iterator[Metric]:
        for name, series in self.values.items():
            family = _empty(name)
            assert isinstance(family, CounterMetricFamily | GaugeMetricFamily), name
            for labels, value in series.items():
                family.add_metric(labels, value)
            yield family
        for name, hists in self.histograms.items():
            family = _empty(name)
            assert isinstance(family, HistogramMetricFamily), name
            for labels, hist in hists.items():
                family.add_metric(labels, list(hist.cumulative()), hist.sum)
            yield family


Source = Callable[[Emitter], None]


def _empty(name: str) -> Metric:
    spec = CATALOGUE[name]
    if spec.kind == "counter":
        return CounterMetricFamily(name, spec.help, labels=spec.labels)
    if spec.kind == "gauge":
        return GaugeMetricFamily(name, spec.help, labels=spec.labels)
    return HistogramMetricFamily(name, spec.help, labels=spec.labels)


class ReachCollector(Collector):
    """Registered once in the ``CollectorRegistry`` a ``Telemetry`` was given."""

    def __init__(self) -> None:
        self.sources: dict[int, Source] = {}
        self.errors = 0  # sources that raised during a scrape (logged)

    def add(self, source: Source) -> Callable[[], None]:
        key = id(source)
        self.sources[key] = source
        return lambda: self.sources.pop(key, None) and None

    def describe(self) -> Iterator[Metric]:
        # Every name, so a second Reach collector on the same registry is refused.
        for name in CATALOGUE:
            yield _empty(name)

    def collect(self) -> Iterator[Metric]:
        out = Emitter()
        for source in list(self.sources.values()):
            try:
                source(out)
            except Exception:
                self.errors += 1  # what it wrote before failing stays in
                log.exception("metrics source %r failed during a scrape", source)
        yield from out.families()
