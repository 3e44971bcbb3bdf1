"""vLLM's ``LLM.get_metrics()``: the engine's Prometheus metrics as Python objects.

The offline engine keeps the same ``EngineMetrics`` the server exposes at ``/metrics`` (with
``disable_log_stats=False``); ``snapshot`` reads its registry into vLLM's shapes
(``vllm.v1.metrics.reader``): a ``Counter`` or ``Gauge`` per label set, a ``Histogram`` with its
cumulative bucket counts keyed by upper bound, and a ``Vector`` for a counter kept per position
(the accepted draft tokens per draft position). Names are Sparrow's (``sparrow:...``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound ("0.1", ..., "+Inf") -> cumulative count


VECTOR_LABEL = "position"


def snapshot(registry: Any) -> list[Metric]:
    """Every metric of a ``prometheus_client.CollectorRegistry``, one object per label set."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            metrics += _counters(family)
        elif family.type == "gauge":
            metrics += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples]
        elif family.type == "histogram":
            metrics += _histograms(family)
    return metrics


def _counters(family: Any) -> list[Metric]:
    totals = [s for s in family.samples if s.name.endswith("_total")]
    if not any(VECTOR_LABEL in s.labels for s in totals):
        return [Counter(family.name, dict(s.labels), int(s.value)) for s in totals]
    vectors: dict[tuple, list[int]] = {}
    for sample in totals:
        labels = {k: v for k, v in sample.labels.items() if k != VECTOR_LABEL}
        values = vectors.setdefault(tuple(sorted(labels.items())), [])
        position = int(sample.labels[VECTOR_LABEL])
        values.extend([0] * (position + 1 - len(values)))
        values[position] = int(sample.value)
    return [Vector(family.name, dict(key), values) for key, values in vectors.items()]


def _histograms(family: Any) -> list[Metric]:
    by_labels: dict[tuple, Histogram] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        histogram = by_labels.setdefault(key, Histogram(family.name, labels, count=0, sum=0.0))
        if sample.name.endswith("_bucket"):
            histogram.buckets[sample.labels["le"]] = int(sample.value)
        elif sample.name.endswith("_count"):
            histogram.count = int(sample.value)
        elif sample.name.endswith("_sum"):
            histogram.sum = float(sample.value)
    return list(by_labels.values())
