"""Everything of one learner rank, built from an ``ActorLearnerConfig`` and run.

Launched once per rank by ``torchrun`` (gloo on CPU); without torchrun it is a
one-rank run. The caller gives the task's parts: the ``preprocess`` that turns a
rollout into a training target, and the rollout server's URL.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from omni_engine.rl.config import ActorLearnerConfig
from omni_engine.rl.data import load_jsonl, pack_stream, sample_stream
from omni_engine.rl.fence import RequestGate, WeightSyncFence
from omni_engine.rl.learner import ActorLearner, merge_summaries
from omni_engine.rl.packing import IGNORE_INDEX, Pack, Packer, encode_chat, make_pack
from omni_engine.rl.prefetch import Preprocess, PrefetchWorker
from omni_engine.rl.ready_queue import VersionedReadyQueue
from omni_engine.rl.rollout_client import HTTPRolloutClient
from omni_engine.rl.schedule import BresenhamSchedule, FeasibilityGate
from omni_engine.rl.weight_push import LearnerWeightPusher

logger = logging.getLogger(__name__)
B_STREAM_SEED_OFFSET = 7919  # channel B's sample stream is seeded apart from channel A's


@dataclass
class Rank:
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Rank:
    """gloo when torchrun started this process (``WORLD_SIZE`` set), else a single rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return Rank(dist.get_rank() if dist.is_initialized() else 0, world)


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def model_directory(name: str) -> Path:
    """A prepare-model recipe name (prepared on first use) or a model directory."""
    from omni_engine.models.prepare import RECIPES, prepare_model

    return prepare_model(name) if name in RECIPES else Path(name).expanduser()


def load_model(path: Path, seed: int) -> tuple[Any, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)  # every rank starts from the same weights anyway; dropout etc. agree
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    return tokenizer, model


def heldout_loss(model: torch.nn.Module, packs: list[Pack]) -> float:
    """Mean token loss over the held-out packs (the unwrapped model: no collectives)."""
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for pack in packs:
            n = int((pack.labels[:, 1:] != IGNORE_INDEX).sum())
            total += float(model(**pack.model_inputs()).loss) * n
            tokens += n
    model.train()
    return total / max(tokens, 1)


class ActorLearnerRun:
    """One rank's run: model, both channels, the fence, the loop; ``run`` returns the merged counters."""

    def __init__(self, config: ActorLearnerConfig, preprocess: Preprocess, url: str, *,
                 log_dir: Path | None = None) -> None:
        self.config = config
        self.me = init_distributed()
        self.url = url
        self.log_dir = log_dir
        # Rank 0 prepares the model if it must (once, not racing the other ranks); all load the same directory.
        path = broadcast(str(model_directory(config.model)) if self.me.is_main else None)
        self.tokenizer, self.model = load_model(Path(path), config.train.seed)
        self.pusher = None
        if self.me.is_main and config.sync.every_steps:
            self.pusher = LearnerWeightPusher(url, self.model, backend=config.sync.backend,
                                              api_key=config.rollout.api_key, fence=config.sync.fence)
        self.version = broadcast(self.pusher.server_version() if self.pusher else 0)
        self.learner = self._learner(preprocess)
        self._log: TextIO | None = None

    def _encode(self, sample: dict[str, Any], target: str, ver: int):
        return encode_chat(self.tokenizer, sample["messages"], target, ver)

    def _render(self, sample: dict[str, Any]) -> str:
        return self.tokenizer.apply_chat_template(sample["messages"], tokenize=False, add_generation_prompt=True)

    def _learner(self, preprocess: Preprocess) -> ActorLearner:
        c, me = self.config, self.me
        train = load_jsonl(c.resolve(c.data.train))
        packing = (c.packing.packing_length, c.packing.packing_min_fill_ratio)
        a_packs = pack_stream(sample_stream(train, me.rank, me.world_size, c.train.seed),
                              lambda s: self._encode(s, s["answer"], self.version), Packer(*packing))
        queue: VersionedReadyQueue[Pack] = VersionedReadyQueue(c.prefetch.version_window, c.prefetch.queue_limit)
        gate = RequestGate(self.version)
        client = HTTPRolloutClient(self.url, c.rollout.model, c.rollout.decoding(), api_key=c.rollout.api_key,
                               timeout_s=c.rollout.timeout_s, max_split_depth=c.rollout.max_split_depth)
        b_samples = sample_stream(train, me.rank, me.world_size, c.train.seed + B_STREAM_SEED_OFFSET)
        prefetch = PrefetchWorker(b_samples, client, gate, self._render, preprocess, self._encode, Packer(*packing),
                                  queue, c.prefetch.rollout_batch_size)
        model: torch.nn.Module = self.model
        if me.world_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(self.model)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.train.lr, weight_decay=c.train.weight_decay)
        return ActorLearner(
            model=model, optimizer=optimizer, gradient_accumulation_steps=c.train.gradient_accumulation_steps,
            a_packs=a_packs, schedule=BresenhamSchedule(c.stage2_ab.schedule.b_ratio),
            gate=FeasibilityGate(c.train.gradient_accumulation_steps), queue=queue, prefetch=prefetch,
            fence=WeightSyncFence(gate, self.pusher), sync_every=c.sync.every_steps, version=self.version,
            asynchronous=c.prefetch.enabled, log=self._write)

    def _heldout_packs(self) -> list[Pack]:
        if self.config.data.heldout is None:
            return []
        samples = load_jsonl(self.config.resolve(self.config.data.heldout))
        return [make_pack([self._encode(s, s["answer"], 0)]) for s in samples]

    def _write(self, record: dict[str, Any]) -> None:
        record = {"rank": self.me.rank, "time": time.time(), **record}
        if self._log is not None:
            self._log.write(json.dumps(record) + "\n")
            self._log.flush()
        if self.me.is_main:
            logger.info("step %s", json.dumps(record))

    def run(self) -> dict[str, Any]:
        c = self.config
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_dir / f"rank{self.me.rank}.jsonl", "w", encoding="utf-8")
        heldout = self._heldout_packs() if self.me.is_main else []
        before = heldout_loss(self.model, heldout) if heldout else None
        started = time.perf_counter()
        if c.prefetch.enabled:
            self.learner.prefetch.start()
        try:
            rank_summary = self.learner.run(c.train.steps)
        finally:
            self.learner.prefetch.stop()
        rank_summary["wall_s"] = time.perf_counter() - started
        gathered = [rank_summary]
        if dist.is_initialized():
            gathered = [None] * self.me.world_size
            dist.all_gather_object(gathered, rank_summary)
        summary = merge_summaries(gathered)
        wall = max(r["wall_s"] for r in gathered)  # the run lasts as long as its slowest rank
        summary.update(wall_s=round(wall, 3), decoding=c.rollout.decoding(), steps_per_s=round(c.train.steps / wall, 4),
                       asynchronous=c.prefetch.enabled, per_rank_channels=[r["channels"] for r in gathered])
        if heldout:
            summary["heldout_loss"] = {"before": round(before, 5), "after": round(heldout_loss(self.model, heldout), 5)}
        if self.pusher is not None:
            summary["pushes"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()}
                                 for p in self.pusher.pushes]
        summary["sync_windows"] = self.learner.fence.windows
        return summary

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
        if self.pusher is not None:
            self.pusher.close()
        # DDP's reducer holds the gloo group and its async work: left to the interpreter's exit, its
        # teardown aborts the rank ("terminate called without an active exception", SIGABRT) in
        # 6 of 40 two-rank runs here; dropped before the group goes, in none of 40.
        self.learner = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
