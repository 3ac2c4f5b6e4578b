"""Prometheus metric families carried across a process boundary.

A stage process's vLLM records its ``vllm:*`` metrics in that process's
registry; the server's ``/metrics`` is another process. ``snapshot_families``
turns the families of a registry into plain lists (msgpack-friendly, sent as
a utility result over the stage socket); ``merge_families`` turns the
snapshots of several processes back into one family per name, each sample
labelled with the process it came from (``stage="0", replica="1"``), as the text format
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


def merge_families(snapshots: Mapping[tuple[tuple[str, str], ...], list[FamilySnapshot]]) -> list[Metric]:
    """One ``Metric`` per family name over all ``snapshots`` (labels -> snapshot), every
    sample given the labels of the snapshot it came from (e.g. ``stage``, ``replica``)."""
    families: dict[str, Metric] = {}
    for labels, snapshot in sorted(snapshots.items()):
        for name, typ, documentation, samples in snapshot:
            family = families.get(name)
            if family is None:
                family = families[name] = Metric(name, documentation, typ)
            for sample_name, sample_labels, value in samples:
                family.add_sample(sample_name, {**sample_labels, **dict(labels)}, value)
    return list(families.values())
