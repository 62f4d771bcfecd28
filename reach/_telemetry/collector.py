"""One prometheus-client collector per ``Telemetry``: it asks every source (an agent, a
client, a registry) for its numbers at scrape time and merges them into families."""

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
    """What a source writes its samples into during one scrape."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}

    def _family(self, name: str) -> Metric:
        family = self.families.get(name)
        if family is None:
            family = _empty(name)
            self.families[name] = family
        return family

    def counter(self, name: str, labels: Sequence[str], value: float) -> None:
        family = self._family(name)
        assert isinstance(family, CounterMetricFamily), name
        family.add_metric(labels, value)

    def gauge(self, name: str, labels: Sequence[str], value: float) -> None:
        family = self._family(name)
        assert isinstance(family, GaugeMetricFamily), name
        family.add_metric(labels, value)

    def histogram(self, name: str, labels: Sequence[str], hist: Histogram) -> None:
        family = self._family(name)
        assert isinstance(family, HistogramMetricFamily), name
        family.add_metric(labels, list(hist.cumulative()), hist.sum)


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
        self.errors = 0  # sources that raised during a scrape (logged, skipped)

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
                self.errors += 1
                log.exception("metrics source %r failed; its samples are left out", source)
        yield from out.families.values()
