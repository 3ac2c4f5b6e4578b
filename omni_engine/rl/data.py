"""The learner's data: a JSONL of chat samples, and per-rank sample streams.

Channel A and channel B read the same dataset on *independent* streams: each is a
rank's shard of a per-epoch permutation (as ``DistributedSampler`` shards), seeded
differently, so B's prompts are not A's samples in the same order. The effective
mix is therefore a step-level policy, audited by the loop's counters, not a promise
that both channels see the same samples.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omni_engine.jsonl import jsonl_rows
from omni_engine.rl.packing import EncodedSample, Pack, Packer

Sample = dict[str, Any]  # {"messages": [{"role", "content"}...], "answer": ...}


def load_jsonl(path: str | Path) -> list[Sample]:
    """Samples with ``messages`` (a chat without the answer) and ``answer``; a bad line is named."""
    samples = []
    for number, sample in jsonl_rows(path):
        if not isinstance(sample, dict) or not isinstance(sample.get("messages"), list) or "answer" not in sample:
            raise ValueError(f"{path}:{number}: a sample needs 'messages' (a list of chat turns) and 'answer'")
        samples.append(sample)
    if not samples:
        raise ValueError(f"{path}: no samples")
    return samples


def sample_stream(samples: list[Sample], rank: int, world_size: int, seed: int) -> Iterator[Sample]:
    """Endless: epoch after epoch, this rank's every ``world_size``-th item of a seeded permutation."""
    epoch = 0
    while True:
        order = list(range(len(samples)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for i in order[rank::world_size]:
            yield samples[i]
        epoch += 1


def pack_stream(samples: Iterator[Sample], encode: Callable[[Sample], EncodedSample], packer: Packer) -> Iterator[Pack]:
    """Channel A: the reference answers, teacher-forced and packed."""
    for sample in samples:
        yield from packer.add(encode(sample))
