"""Prometheus metrics of a transfer queue, read from its status at scrape time (nothing to
keep in step on the write path)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omni_engine.transfer_queue.service import TransferQueueService

_COUNTERS = (
    ("trajectories", "total_trajectories", "Trajectories accepted since the last reset"),
    ("consumed_trajectories", "total_consumed", "Trajectories delivered to readers"),
    ("duplicates", "duplicates_dropped", "Writes dropped as duplicates of a known uid"),
    ("refused_writes", "writes_refused", "Writes refused because the buffer was full"),
    ("timed_out_groups_delivered", "groups_timed_out_delivered", "Incomplete groups delivered at their timeout"),
    ("timed_out_groups_dropped", "groups_timed_out_dropped", "Incomplete groups dropped at their timeout"),
)
_GAUGES = (
    ("pending_groups", "pending_groups", "Complete groups waiting for a reader"),
    ("incomplete_groups", "incomplete_groups", "Groups still collecting samples"),
    ("memory_bytes", "memory_usage_bytes", "Trajectory bytes held in memory"),
    ("disk_bytes", "disk_usage_bytes", "Bytes on disk: spilled trajectories and the write-ahead log"),
)


class TransferQueueCollector:
    def __init__(self, service: TransferQueueService, prefix: str = "transfer_queue") -> None:
        self.service = service
        self.prefix = prefix

    def collect(self):
        status = self.service.status()
        for name, field, doc in _COUNTERS:
            yield CounterMetricFamily(f"{self.prefix}_{name}", doc, value=getattr(status, field))
        for name, field, doc in _GAUGES:
            yield GaugeMetricFamily(f"{self.prefix}_{name}", doc, value=getattr(status, field))
        yield GaugeMetricFamily(f"{self.prefix}_blocked_readers", "Readers waiting for a ready group",
                                value=self.service.blocked_readers)
        yield GaugeMetricFamily(f"{self.prefix}_healthy", "1 while writes can be acknowledged",
                                value=1 if self.service.healthy else 0)


def metrics_registry(service: TransferQueueService) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TransferQueueCollector(service))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
