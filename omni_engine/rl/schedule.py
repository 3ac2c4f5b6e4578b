"""Which channel an optimizer step trains on: the ``b_ratio`` policy, then the feasibility gate.

The policy is Bresenham's: step ``s`` wants B when ``floor((s + 1) * r) > floor(s * r)``,
so over any ``S`` steps exactly ``floor(S * r)`` want B, spread as evenly as integers
allow, and every rank computes the same answer without talking.

The gate commits to B only if *every* rank holds at least ``gradient_accumulation_steps``
fresh packs: an all-reduce MIN of the ready counts, so all ranks take the same decision
and DDP sees the same collectives everywhere (a rank short of packs would otherwise train
on A while the others run B, and the ranks' gradient buckets would mismatch in count or
order). A step that wanted B and could not have it runs A and is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist


class Channel(str, Enum):
    A = "A"  # the learner's own dataloader (hot path)
    B = "B"  # rollouts of the served model, from the ready queue


class BresenhamSchedule:
    def __init__(self, b_ratio: float) -> None:
        if not 0.0 <= b_ratio <= 1.0:
            raise ValueError(f"b_ratio must be within [0, 1], got {b_ratio}")
        self.b_ratio = b_ratio

    def wants_b(self, step: int) -> bool:
        # Integer arithmetic on a scaled ratio would be exact; floats are exact enough for the
        # ratios a YAML holds (0.25, 0.5, 0.3...) over any number of steps a run has.
        return math.floor((step + 1) * self.b_ratio + 1e-9) > math.floor(step * self.b_ratio + 1e-9)

    def b_steps(self, steps: int) -> int:
        """How many of the first ``steps`` steps want B."""
        return math.floor(steps * self.b_ratio + 1e-9)


@dataclass
class Decision:
    step: int
    wants_b: bool
    channel: Channel
    min_ready: int | None  # the all-ranks minimum of ready packs (None: B was not wanted, nothing asked)

    @property
    def skipped_due_to_queue(self) -> bool:
        return self.wants_b and self.channel is Channel.A


class FeasibilityGate:
    """All-reduce MIN of the ranks' ready counts over ``group`` (gloo on CPU, nccl on GPUs)."""

    def __init__(self, required: int, group: dist.ProcessGroup | None = None) -> None:
        self.required = required
        self.group = group

    def min_ready(self, ready: int) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return ready
        count = torch.tensor([ready], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.group)
        return int(count.item())

    def decide(self, step: int, wants_b: bool, ready: int) -> Decision:
        """Every rank calls this at every step with the same ``wants_b`` (the schedule is global), so
        the all-reduce happens on all ranks or on none."""
        if not wants_b:
            return Decision(step, False, Channel.A, None)
        low = self.min_ready(ready)
        return Decision(step, True, Channel.B if low >= self.required else Channel.A, low)
