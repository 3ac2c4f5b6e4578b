"""Prometheus metrics of a served pipeline, on the server's ``/metrics``.

vLLM's server (0.32) exposes prometheus_client's default ``REGISTRY`` at
``/metrics`` (``vllm.entrypoints.serve.instrumentator.metrics``) unless
``PROMETHEUS_MULTIPROC_DIR`` is set; ``register_pipeline_metrics`` adds one
collector there. Two kinds of series:

- observed when the event happens, through the orchestrator's ``observer``
  hook: the histograms (queue and run time per stage, transfer time per edge,
  end-to-end and time to first output per request) and the error and
  transfer-byte counters;
- read at scrape time from the pipeline's state: running and waiting
  sub-requests per stage, whether each stage is up, and the per-stage counters
  ``OrchestratorMetrics`` already keeps (requests, finished, failed, aborted,
  outputs, bytes), so nothing is counted twice.

Every name starts with ``omni_engine_``; stages are labelled ``stage``, stage
replicas ``stage`` and ``replica``, edges ``src`` and ``dst``. Sub-requests
count as requests of their stage (an ``async_chunk`` speech stage gets one per
sentence).

Beside them, what the stage processes keep themselves, with ``stage`` and
``replica`` labels added: the ``vllm:*`` series of each LLM stage's own vLLM
(requests running and waiting, KV-cache usage, TTFT, ITL, e2e, tokens ...), as
vLLM names them, and every stage's playback-deadline figures (pieces served,
done late, the worst lateness: ``DeadlineStats.families``).
``StageEngineMetrics`` fetches them when ``/metrics`` is scraped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omni_engine import envs
from omni_engine.loop_context import LoopContext, loop_context, running_loop
from omni_engine.metrics import PipelineObserver
from omni_engine.prometheus_snapshot import FamilySnapshot, merge_families

logger = logging.getLogger(__name__)

PREFIX = "omni_engine_"

# Seconds: from a few milliseconds (a TTS sentence) to minutes (a long generation).
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Seconds between a source's output and the submit to its consumer: routing, usually sub-millisecond.
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# (family name, OrchestratorMetrics attribute, help) of the per-stage counters.
STAGE_COUNTERS = (
    ("stage_requests", "requests", "Per stage: (sub-)requests submitted"),
    ("stage_requests_finished", "finished", "Per stage: (sub-)requests finished"),
    ("stage_requests_failed", "failed", "Per stage: requests the stage reported an error for"),
    ("stage_requests_aborted", "aborted", "Per stage: (sub-)requests aborted while in flight"),
    ("stage_outputs", "outputs", "Per stage: outputs received (a streamed request has many)"),
    ("stage_bytes_in", "bytes_in", "Per stage: bytes of requests sent to the stage"),
    ("stage_bytes_out", "bytes_out", "Per stage: bytes of outputs received from the stage"),
)


class StageEngineMetrics:
    """The stage processes' own families (``vllm:*``, deadlines), fetched at scrape time.

    vLLM's ``/metrics`` handler collects in a worker thread, so a scrape waits
    (up to ``timeout``) for the stages' answers on the client's loop and shows
    what they report now. A stage that does not answer in time shows its last
    snapshot; a dead stage shows none (``omni_engine_stage_up`` says why).
    Collected on the loop itself (no waiting possible there), the last
    snapshots are shown and a fetch is started for the next scrape.
    """

    def __init__(self, client: Any, loop: asyncio.AbstractEventLoop | None, timeout: float) -> None:
        self.client = client
        self.loop = loop
        self.timeout = timeout
        self._last: dict[tuple[int, int], list[FamilySnapshot]] = {}  # (stage, replica) -> snapshot
        self._fetching: set[asyncio.Task] = set()

    def collect(self) -> list[Metric]:
        self._refresh()
        return merge_families({(("stage", str(sid)), ("replica", str(replica))): snap
                               for (sid, replica), snap in self._last.items()
                               if self.client.replica_alive(sid, replica)})

    def _refresh(self) -> None:
        loop, where = self.loop, loop_context(self.loop)
        if where is LoopContext.NOT_RUNNING:
            return
        if where is LoopContext.ON_LOOP:
            task = loop.create_task(self._fetch())
            self._fetching.add(task)
            task.add_done_callback(self._fetching.discard)
            return
        future = asyncio.run_coroutine_threadsafe(self._fetch(), loop)
        try:
            future.result(self.timeout + 1.0)
        except Exception as exc:  # noqa: BLE001 - a scrape shows the last snapshots instead
            future.cancel()
            logger.debug("stage engine metrics not fetched: %r", exc)

    async def _fetch(self) -> None:
        self._last.update(await self.client.engine_metrics(self.timeout))


class PipelineMetricsCollector(PipelineObserver, Collector):
    """The orchestrator's observer and a Prometheus collector of one ``MultiStageEngineClient``."""

    def __init__(self, client: Any, engine_metrics: StageEngineMetrics | None = None) -> None:
        self.client = client
        self.engine_metrics = engine_metrics
        self._lock = threading.Lock()
        self._errors: dict[tuple[str, str], int] = {}
        self._edge_bytes: dict[tuple[str, str], int] = {}
        self._request_outcomes: dict[str, int] = {"finished": 0, "failed": 0, "aborted": 0}
        # registry=None: exported through this collector only, so one registration covers all.
        self.queue_time = Histogram(
            PREFIX + "stage_queue_time_seconds",
            "Per stage: time from submitting a (sub-)request to its first output",
            ["stage"], buckets=TIME_BUCKETS, registry=None)
        self.run_time = Histogram(
            PREFIX + "stage_run_time_seconds",
            "Per stage: time from a (sub-)request's first output to its last",
            ["stage"], buckets=TIME_BUCKETS, registry=None)
        self.transfer_time = Histogram(
            PREFIX + "edge_transfer_seconds",
            "Per edge: time from the source stage's output to the submit of the input built from it "
            "to the destination stage",
            ["src", "dst"], buckets=TRANSFER_BUCKETS, registry=None)
        self.e2e = Histogram(
            PREFIX + "request_e2e_seconds",
            "Per finished request: arrival to the end of its last final stage, by the final stages it asked for",
            ["final_stages"], buckets=TIME_BUCKETS, registry=None)
        self.ttfo = Histogram(
            PREFIX + "request_time_to_first_output_seconds",
            "Per finished request and final stage: arrival to that stage's first output",
            ["stage"], buckets=TIME_BUCKETS, registry=None)
        self._histograms = (self.queue_time, self.run_time, self.transfer_time, self.e2e, self.ttfo)
        # Every stage and edge shows up (at zero) before its first request.
        for sid in client.stage_ids():
            self.queue_time.labels(stage=str(sid))
            self.run_time.labels(stage=str(sid))
        for src, dst in client.stage_edges():
            self.transfer_time.labels(src=str(src), dst=str(dst))
            self._edge_bytes[(str(src), str(dst))] = 0
        for sid in client.final_stage_ids():
            self.ttfo.labels(stage=str(sid))

    # ------------------------------------------------------------ observer
    def on_first_output(self, stage_id: int, queue_s: float) -> None:
        self.queue_time.labels(stage=str(stage_id)).observe(queue_s)

    def on_finished(self, stage_id: int, run_s: float) -> None:
        self.run_time.labels(stage=str(stage_id)).observe(run_s)

    def on_error(self, stage_id: int, error_type: str) -> None:
        key = (str(stage_id), error_type or "Error")
        with self._lock:
            self._errors[key] = self._errors.get(key, 0) + 1

    def on_forward(self, src: int, dst: int, nbytes: int, seconds: float) -> None:
        key = (str(src), str(dst))
        with self._lock:
            self._edge_bytes[key] = self._edge_bytes.get(key, 0) + nbytes
        self.transfer_time.labels(src=key[0], dst=key[1]).observe(seconds)

    def on_request_done(self, e2e_s: float, ttfo_by_stage: dict[int, float], outcome: str,
                        final_stages: tuple[int, ...] = ()) -> None:
        with self._lock:
            self._request_outcomes[outcome] = self._request_outcomes.get(outcome, 0) + 1
        if outcome != "finished":
            return  # a failed or aborted request's times say nothing about latency
        self.e2e.labels(final_stages=",".join(map(str, final_stages))).observe(e2e_s)
        for sid, seconds in ttfo_by_stage.items():
            self.ttfo.labels(stage=str(sid)).observe(seconds)

    # ----------------------------------------------------------- collector
    @staticmethod
    def _replica_families(client: Any, stage_ids: list[int]) -> Iterable[Metric]:
        up = GaugeMetricFamily(PREFIX + "replica_up", "1 while the stage replica's process is alive",
                               labels=["stage", "replica"])
        running = GaugeMetricFamily(PREFIX + "replica_requests_in_flight",
                                    "Per stage replica: (sub-)requests submitted and not finished",
                                    labels=["stage", "replica"])
        sent = CounterMetricFamily(PREFIX + "replica_requests",
                                   "Per stage replica: (sub-)requests sent to it, resubmissions included",
                                   labels=["stage", "replica"])
        for sid in stage_ids:
            for replica, status in enumerate(client.replica_status(sid)):
                labels = [str(sid), str(replica)]
                up.add_metric(labels, 1.0 if status.alive else 0.0)
                running.add_metric(labels, status.in_flight)
                sent.add_metric(labels, status.submitted)
        retried = CounterMetricFamily(PREFIX + "stage_requests_retried",
                                      "Per stage: requests moved to another replica when theirs died "
                                      "(runtime.retry)", labels=["stage"])
        for sid, count in sorted(client.stage_retries().items()):
            retried.add_metric([str(sid)], count)
        return [up, running, sent, retried]

    @staticmethod
    def _stage_state_families(client: Any, stage_ids: list[int]) -> Iterable[Metric]:
        """What each stage is doing now: up, waiting and running (sub-)requests, restarts so far."""
        load = client.stage_load()
        up = GaugeMetricFamily(PREFIX + "stage_up",
                               "1 while the stage serves (one of its replicas is alive), 0 once none is",
                               labels=["stage"])
        waiting = GaugeMetricFamily(PREFIX + "stage_requests_waiting",
                                    "Per stage: (sub-)requests submitted that have no output yet", labels=["stage"])
        running = GaugeMetricFamily(PREFIX + "stage_requests_running",
                                    "Per stage: (sub-)requests producing outputs", labels=["stage"])
        restarts = CounterMetricFamily(PREFIX + "stage_restarts",
                                       "Per stage: restarts after the stage died (runtime.restart)", labels=["stage"])
        restart_counts = client.stage_restarts()
        for sid in stage_ids:
            label = [str(sid)]
            up.add_metric(label, 1.0 if client.stage_alive(sid) else 0.0)
            w, r = load.get(sid, (0, 0))
            waiting.add_metric(label, w)
            running.add_metric(label, r)
            restarts.add_metric(label, restart_counts.get(sid, 0))
        return [up, waiting, running, restarts]

    @staticmethod
    def _stage_counter_families(client: Any, stage_ids: list[int]) -> Iterable[Metric]:
        """The per-stage counters ``OrchestratorMetrics`` keeps."""
        stats = {sid: client.metrics.stage(sid) for sid in stage_ids}
        for name, attr, doc in STAGE_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["stage"])
            for sid in stage_ids:
                family.add_metric([str(sid)], getattr(stats[sid], attr))
            yield family

    def _event_families(self, client: Any, stage_ids: list[int]) -> Iterable[Metric]:
        """The counters this observer keeps: errors per stage, bytes per edge, requests per outcome."""
        with self._lock:
            errors = dict(self._errors)
            edge_bytes = dict(self._edge_bytes)
            outcomes = dict(self._request_outcomes)
        # A stage's death is an error of that stage too (once: a dead stage stays dead).
        for sid in stage_ids:
            if not client.stage_alive(sid):
                errors[(str(sid), "StageDeadError")] = errors.get((str(sid), "StageDeadError"), 0) + 1
        family = CounterMetricFamily(PREFIX + "stage_errors",
                                     "Per stage and error type: request errors the stage reported, and its death",
                                     labels=["stage", "error"])
        for (stage, error), count in sorted(errors.items()):
            family.add_metric([stage, error], count)
        yield family

        family = CounterMetricFamily(PREFIX + "edge_transfer_bytes",
                                     "Per edge: bytes of the inputs built from the source's outputs and sent "
                                     "to the destination", labels=["src", "dst"])
        for (src, dst), count in sorted(edge_bytes.items()):
            family.add_metric([src, dst], count)
        yield family

        family = CounterMetricFamily(PREFIX + "requests", "Pipeline requests ended, by outcome", labels=["outcome"])
        for outcome, count in sorted(outcomes.items()):
            family.add_metric([outcome], count)
        yield family

    def collect(self) -> Iterable[Metric]:
        client = self.client
        stage_ids = client.stage_ids()
        yield from self._stage_state_families(client, stage_ids)
        yield from self._replica_families(client, stage_ids)
        yield from self._stage_counter_families(client, stage_ids)
        yield from self._event_families(client, stage_ids)
        for histogram in self._histograms:
            yield from histogram.collect()
        if self.engine_metrics is not None:
            yield from self.engine_metrics.collect()


def register_pipeline_metrics(client: Any, registry: CollectorRegistry | None = None, *,
                              engine_metrics_timeout: float = 2.0) -> PipelineMetricsCollector:
    """Hook a collector into ``client``'s orchestrator and register it (default: vLLM's ``/metrics``
    registry). Called on the client's loop, the collector also carries the LLM stages' ``vllm:*`` series."""
    collector = PipelineMetricsCollector(client, StageEngineMetrics(client, running_loop(), engine_metrics_timeout))
    if registry is None:
        registry = REGISTRY
        if envs.prometheus_multiproc_dir():
            logger.warning("PROMETHEUS_MULTIPROC_DIR is set: vLLM's /metrics then reads only the multiprocess "
                           "files, so the omni_engine_* series read at scrape time (gauges, stage counters) "
                           "are not shown")
    registry.register(collector)
    client.observer = collector
    return collector


def unregister_pipeline_metrics(collector: PipelineMetricsCollector, registry: CollectorRegistry | None = None) -> None:
    (registry or REGISTRY).unregister(collector)
    if collector.client.observer is collector:
        collector.client.observer = None
