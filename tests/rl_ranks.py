"""Learner-rank bodies for test_rl_ranks.py: each runs in a process of its own in a real gloo group."""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from omni_engine.rl.fence import RequestGate, WeightSyncFence
from omni_engine.rl.learner import ActorLearner
from omni_engine.rl.packing import EncodedSample, Packer, make_pack
from omni_engine.rl.prefetch import PrefetchWorker
from omni_engine.rl.ready_queue import VersionedReadyQueue
from omni_engine.rl.rollout_client import RolloutClient
from omni_engine.rl.schedule import BresenhamSchedule, FeasibilityGate


class TinyLM(torch.nn.Module):
    """A causal LM's calling convention over one embedding and one linear layer: real gradients for DDP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 64)

    def forward(self, input_ids, labels, position_ids=None, use_cache=None):
        logits = self.head(self.embed(input_ids))
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
        return type("Out", (), {"loss": loss})()


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _pack(ver: int = 0):
    return make_pack([EncodedSample([1, 2, 3, 4], [-100, 2, 3, 4], ver)])


def _learner(queue, fence=None, ga=2, b_ratio=0.5) -> ActorLearner:
    model = torch.nn.parallel.DistributedDataParallel(TinyLM())
    gate = RequestGate(0)
    # Never asked: this learner's packs are put by the test, as its prefetch thread would.
    client = RolloutClient({})
    prefetch = PrefetchWorker(iter(()), client, gate, str, lambda s, r: None, None, Packer(16, 0.5), queue, 1)
    a_packs = iter(lambda: _pack(), None)
    return ActorLearner(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        gradient_accumulation_steps=ga, a_packs=a_packs, schedule=BresenhamSchedule(b_ratio),
                        gate=FeasibilityGate(ga), queue=queue, prefetch=prefetch,
                        fence=fence or WeightSyncFence(gate, None), sync_every=0, version=0)


def unequal_queues(rank: int, world: int, port: int, out: str, steps: int) -> None:
    """Rank 0 gets a ready pack every step, rank 1 one every third step: the gate must keep them agreeing."""
    _init(rank, world, port)
    queue: VersionedReadyQueue = VersionedReadyQueue(version_window=100, queue_limit=50)
    learner = _learner(queue)
    records = []
    for step in range(steps):
        if rank == 0 or step % 3 == 0:
            queue.put(_pack(), 0)
        ready = queue.ready(0)
        record = learner.train_step(step)
        records.append({"step": step, "ready": ready, "channel": record["channel"], "wants_b": record["wants_b"],
                        "min_ready": record["min_ready"], "skipped": record["b_step_skipped_due_to_queue"]})
    # Every rank's parameters must still be equal: DDP saw the same collectives in the same order.
    flat = torch.cat([p.detach().reshape(-1) for p in learner.model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"records": records, "params_equal": all(torch.equal(g, gathered[0]) for g in gathered)}))
    del learner  # its DDP module must go before the group (leave_group)
    leave_group()


def leave_group() -> None:
    """Collects what the caller dropped, then leaves the group. A DDP reducer left to the
    interpreter's exit outlives the gloo group, and its teardown aborted a rank now and then
    (SIGABRT in ``mp.spawn``); ``ActorLearnerRun.close`` drops its module first for the same reason."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def fence_order(rank: int, world: int, port: int, out: str, fail_push: bool) -> None:
    """Rank 1 has a slow rollout in flight when the sync starts; rank 0's push must begin after it
    ended. With ``fail_push`` rank 0's push raises and every rank must raise, none hang."""
    _init(rank, world, port)
    gate = RequestGate(0)
    times: dict[str, float | str] = {}

    def push(version: int) -> None:
        times["push_start"] = time.time()
        if fail_push:
            raise RuntimeError("the server refused the weights")

    inside = threading.Event()

    def slow_request() -> None:
        with gate.request():
            inside.set()
            time.sleep(1.0)
            times["request_end"] = time.time()

    if rank == 1:
        worker = threading.Thread(target=slow_request)
        worker.start()
        inside.wait(5)
    fence = WeightSyncFence(gate, push if rank == 0 else None)
    try:
        fence.sync(1)
        times["result"] = f"synced to {gate.version}"
    except RuntimeError as exc:
        times["result"] = f"raised: {exc}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(times))
    leave_group()


def live_ddp_modules() -> int:
    import gc

    return sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())


def a_closed_run_keeps_no_ddp(rank: int, world: int, port: int, out: str, config_path: str) -> None:
    """The example's run on a rank (torchrun's environment, SmolLM2, no pushes), closed: no DDP module
    may outlive the group, or its reducer's teardown at interpreter exit can abort the rank."""
    import os

    from omni_engine.rl.config import load_actor_learner_config
    from omni_engine.rl.runner import ActorLearnerRun

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    config = load_actor_learner_config(config_path, {"sync.every_steps": 0, "data.heldout": None,
                                                       "rollout.model": "any"})
    run = ActorLearnerRun(config, lambda sample, rollout: None, "http://127.0.0.1:9")  # never asked
    before = live_ddp_modules()
    run.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"before": before, "after": live_ddp_modules(), "group_left": dist.is_initialized()}))
