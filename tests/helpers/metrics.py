"""Reading Prometheus samples off a `Metrics` registry."""

from __future__ import annotations

from stride.metrics.registry import Metrics


def value(m: Metrics, name: str, **labels: str) -> float:
    """Sum of a sample over every label set that matches `labels`."""
    total = 0.0
    for family in m.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total

