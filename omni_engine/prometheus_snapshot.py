"""Prometheus metric families carried across a process boundary.

A stage process's vLLM records its ``vllm:*`` metrics in that process's
registry; the server's ``/metrics`` is another process. ``snapshot_families``
turns the families of a registry into plain lists (msgpack-friendly, sent as
a utility result over the stage socket); ``merge_families`` turns the
snapshots of several processes back into one family per name, each sample
labelled with the process it came from (``stage="0"``), as the text format
requires (one ``# TYPE`` per name).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.core import Metric

# [name, type, documentation, [[sample name, labels, value], ...]]
FamilySnapshot = list[Any]


def snapshot_families(registry: Any, prefix: str) -> list[FamilySnapshot]:
    """The families of ``registry`` whose name starts with ``prefix``, as plain lists."""
    return [
        [family.name, family.type, family.documentation,
         [[sample.name, dict(sample.labels), float(sample.value)] for sample in family.samples]]
        for family in registry.collect() if family.name.startswith(prefix)
    ]


def merge_families(snapshots: Mapping[str, list[FamilySnapshot]], label: str) -> list[Metric]:
    """One ``Metric`` per family name over all ``snapshots`` (label value -> snapshot),
    every sample with ``label`` set to the key of the snapshot it came from."""
    families: dict[str, Metric] = {}
    for label_value, snapshot in sorted(snapshots.items()):
        for name, typ, documentation, samples in snapshot:
            family = families.get(name)
            if family is None:
                family = families[name] = Metric(name, documentation, typ)
            for sample_name, labels, value in samples:
                family.add_sample(sample_name, {**labels, label: label_value}, value)
    return list(families.values())
