"""``ActorLearner``: one rank's optimizer steps over channels A and B, with fenced weight syncs.

Per optimizer step: the ``b_ratio`` schedule says whether B is wanted; the feasibility
gate (an all-reduce MIN of ready packs) commits every rank to the same channel; then
``gradient_accumulation_steps`` micro-steps, each exactly one packed forward/backward
(gradients all-reduced by DDP on the last one only); the optimizer steps; and every
``sync_every`` steps the fence pushes the weights and advances the version.

With ``asynchronous=False`` channel B is produced inline when a step wants it (generate,
then train, in turn): the baseline the benchmark measures the prefetch against.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_engine.rl.fence import WeightSyncFence
from omni_engine.rl.packing import Pack
from omni_engine.rl.prefetch import PrefetchWorker
from omni_engine.rl.ready_queue import VersionedReadyQueue
from omni_engine.rl.schedule import BresenhamSchedule, Channel, Decision, FeasibilityGate


@dataclass
class LoopCounters:
    steps: int = 0
    b_wanted: int = 0
    b_steps: int = 0
    b_step_skipped_due_to_queue: int = 0
    syncs: int = 0
    train_s: float = 0.0  # forward, backward, optimizer
    wait_s: float = 0.0  # everything else the loop waited on: inline rollouts, fences, packs of A
    decisions: list[Decision] = field(default_factory=list)


@dataclass
class StepPlan:
    """What a step trains on: the packs and, for B, how stale each was when taken."""

    decision: Decision
    packs: list[Pack]
    lags: list[int]


class ActorLearner:
    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, gradient_accumulation_steps: int,
                 a_packs: Iterator[Pack], schedule: BresenhamSchedule, gate: FeasibilityGate,
                 queue: VersionedReadyQueue[Pack], prefetch: PrefetchWorker, fence: WeightSyncFence,
                 sync_every: int, version: int, asynchronous: bool = True,
                 log: Callable[[dict[str, Any]], None] = lambda record: None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.ga = gradient_accumulation_steps
        self.a_packs = a_packs
        self.schedule = schedule
        self.gate = gate
        self.queue = queue
        self.prefetch = prefetch
        self.fence = fence
        self.sync_every = sync_every
        self.version = version
        self.asynchronous = asynchronous
        self.log = log
        self.counters = LoopCounters()

    # ------------------------------------------------------------------ plan
    def _plan(self, step: int) -> StepPlan:
        wants = self.schedule.wants_b(step)
        if self.asynchronous:
            self.prefetch.check()
            ready = self.queue.ready(self.version) if wants else 0
            decision = self.gate.decide(step, wants, ready)
        else:
            decision = Decision(step, wants, Channel.B if wants else Channel.A, None)
            while wants and self.queue.ready(self.version) < self.ga:
                for pack in self.prefetch.produce_batch():
                    self.queue.put(pack, pack.ver)
        if decision.channel is Channel.A:
            return StepPlan(decision, [next(self.a_packs) for _ in range(self.ga)], [])
        taken = [self.queue.pop(self.version) for _ in range(self.ga)]
        if any(t is None for t in taken):
            # The gate saw >= ga fresh packs and only this thread pops or advances the version.
            raise RuntimeError(f"step {step}: the feasibility gate passed but the ready queue ran short")
        return StepPlan(decision, [t.item for t in taken], [self.version - t.ver for t in taken])

    # ----------------------------------------------------------------- train
    def _train(self, packs: list[Pack]) -> float:
        total = 0.0
        for micro, pack in enumerate(packs):
            last = micro == len(packs) - 1
            no_sync = getattr(self.model, "no_sync", None)
            context = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with context:
                loss = self.model(**pack.model_inputs()).loss / len(packs)
                loss.backward()
            total += float(loss.detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def train_step(self, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        plan = self._plan(step)
        planned = time.perf_counter()
        loss = self._train(plan.packs)
        trained = time.perf_counter()
        synced = None
        if self.sync_every and (step + 1) % self.sync_every == 0:
            synced = self.sync()
        c = self.counters
        c.steps += 1
        c.b_wanted += plan.decision.wants_b
        c.b_steps += plan.decision.channel is Channel.B
        c.b_step_skipped_due_to_queue += plan.decision.skipped_due_to_queue
        c.decisions.append(plan.decision)
        c.train_s += trained - planned
        c.wait_s += (planned - start) + (time.perf_counter() - trained)
        record = {"step": step, "channel": plan.decision.channel.value, "wants_b": plan.decision.wants_b,
                  "min_ready": plan.decision.min_ready,
                  "b_step_skipped_due_to_queue": int(plan.decision.skipped_due_to_queue),
                  "loss": round(loss, 5), "version": self.version, "lags": plan.lags,
                  "queue_depth": len(self.queue), "pack_tokens": [p.tokens for p in plan.packs],
                  "seconds": round(time.perf_counter() - start, 4)}
        if synced is not None:
            record["sync"] = {k: round(v, 4) for k, v in synced.items()}
        self.log(record)
        return record

    def sync(self) -> dict[str, float]:
        """The fence on every rank; the version moves on everywhere."""
        timings = self.fence.sync(self.version + 1)
        self.version += 1
        self.queue.advance(self.version)
        self.counters.syncs += 1
        return timings

    def run(self, steps: int) -> dict[str, Any]:
        for step in range(steps):
            self.train_step(step)
        return self.summary()

    # ------------------------------------------------------------- counters
    def summary(self) -> dict[str, Any]:
        """This rank's counters (``merge_summaries`` adds the ranks up)."""
        c, q = self.counters, self.queue.counters
        stats = self.prefetch.client.stats
        return {
            "steps": c.steps, "b_wanted": c.b_wanted, "b_steps": c.b_steps,
            "b_step_skipped_due_to_queue": c.b_step_skipped_due_to_queue, "syncs": c.syncs,
            "stale_drops": q.stale_drops, "limit_drops": q.limit_drops, "packs_consumed": q.pops,
            "queue_depth": len(self.queue), "version_lag": dict(sorted(Counter(q.lags).items())),
            "rollout_latencies": list(stats.latencies), "rollout_requests": stats.requests,
            "rollout_failures": stats.failures, "rollout_splits": stats.splits,
            "version_mismatches": stats.version_mismatches,
            "rollouts": self.prefetch.counters.rollouts, "rollouts_rejected": self.prefetch.counters.rejected,
            "preprocess_errors": self.prefetch.counters.preprocess_errors,
            "rollout_errors": self.prefetch.counters.rollout_errors,
            "packs_underfilled": self.prefetch.packer.underfilled, "samples_truncated": self.prefetch.packer.truncated,
            "train_s": c.train_s, "wait_s": c.wait_s, "version": self.version,
            "channels": "".join(d.channel.value for d in c.decisions),
        }


def merge_summaries(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One report for the run: counts summed over ranks, ratios and percentiles over all of them."""
    total: dict[str, Any] = {"ranks": len(ranks)}
    for key in ("stale_drops", "limit_drops", "packs_consumed", "queue_depth",
                "rollout_requests", "rollout_failures", "rollout_splits", "version_mismatches", "rollouts",
                "rollouts_rejected", "preprocess_errors", "rollout_errors", "packs_underfilled", "samples_truncated"):
        total[key] = sum(r[key] for r in ranks)
    first = ranks[0]
    # Decisions are global (the gate makes every rank agree): one rank's count is the run's.
    total.update(steps=first["steps"], b_wanted=first["b_wanted"], b_steps=first["b_steps"], syncs=first["syncs"],
                 version=first["version"], b_step_skipped_due_to_queue=first["b_step_skipped_due_to_queue"])
    total["executed_b_ratio"] = round(first["b_steps"] / first["steps"], 4) if first["steps"] else 0.0
    lags: Counter[int] = Counter()
    for r in ranks:
        lags.update({int(k): v for k, v in r["version_lag"].items()})
    total["version_lag"] = dict(sorted(lags.items()))
    latencies = sorted(x for r in ranks for x in r["rollout_latencies"])
    if latencies:
        total["rollout_latency_s"] = {"p50": round(statistics.median(latencies), 3),
                                      "p95": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 3),
                                      "n": len(latencies)}
    busy = [r["train_s"] + r["wait_s"] for r in ranks]
    total["learner_wait_fraction"] = round(sum(r["wait_s"] for r in ranks) / sum(busy), 4) if sum(busy) else 0.0
    total["channels_agree"] = len({r["channels"] for r in ranks}) == 1
    return total
