"""Teacher-forced encoding and packing: samples -> one packed micro-batch per queue item.

A pack is one row of up to ``packing_length`` tokens holding several samples back to
back, with ``position_ids`` restarting at 0 for each. Hugging Face models (transformers
5) read restarting positions as packed sequences and mask attention across samples, so
a pack trains exactly like its samples one by one, in one forward/backward (without a KV
cache: see ``Pack.model_inputs``). Labels are
-100 outside each sample's target, so no sample learns to predict its neighbour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100
# Samples that may wait for a well-filled pack: beyond this many, the best pack first-fit finds is let
# out under-filled (counted), so a packing_length the samples do not divide well cannot stall channel B.
MAX_PENDING = 8


@dataclass
class EncodedSample:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX where the token is not a target
    ver: int = 0  # weight version of the rollout it came from (channel A: the learner's current)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Pack:
    input_ids: torch.Tensor  # [1, n]
    labels: torch.Tensor  # [1, n]
    position_ids: torch.Tensor  # [1, n], restarting at each sample
    samples: int
    ver: int  # the oldest version among its samples: a pack is as stale as its stalest sample

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def model_inputs(self) -> dict[str, Any]:
        # No KV cache: transformers reads restarting positions as packed sequences only without one
        # (with a cache, which models make by default even in training, the samples attend to each other).
        return {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids,
                "use_cache": False}


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]], target: str, ver: int = 0) -> EncodedSample:
    """``messages`` then an assistant turn ``target``, through the model's chat template; only the
    assistant turn's tokens (its end-of-turn token included) are targets."""
    prompt = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": target}], tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the conversation with the answer differently from the prompt "
                         "alone: cannot tell the target tokens apart")
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
    return EncodedSample(prompt_ids + target_ids, [IGNORE_INDEX] * len(prompt_ids) + target_ids, ver)


class Packer:
    """Greedy first-fit over the samples waiting, in arrival order. A pack is let out once it is at
    least ``min_fill_ratio`` full and a waiting sample does not fit in it (or it is exactly full)."""

    def __init__(self, packing_length: int, min_fill_ratio: float) -> None:
        self.packing_length = packing_length
        self.min_tokens = int(packing_length * min_fill_ratio)
        self._pending: list[EncodedSample] = []
        self.truncated = 0
        self.underfilled = 0

    def add(self, sample: EncodedSample) -> list[Pack]:
        """Take one sample; the packs it completed (often none)."""
        if len(sample) > self.packing_length:
            self.truncated += 1
            sample = EncodedSample(sample.input_ids[:self.packing_length], sample.labels[:self.packing_length],
                                   sample.ver)
        self._pending.append(sample)
        packs = []
        while (pack := self._next_pack()) is not None:
            packs.append(pack)
        return packs

    def _next_pack(self) -> Pack | None:
        chosen, used, left_out = [], 0, False
        for i, sample in enumerate(self._pending):
            if used + len(sample) <= self.packing_length:
                chosen.append(i)
                used += len(sample)
            else:
                left_out = True
        full_enough = used >= self.min_tokens and (left_out or used == self.packing_length)
        if not full_enough and len(self._pending) <= MAX_PENDING:
            return None
        if not full_enough:
            self.underfilled += 1
        taken = [self._pending[i] for i in chosen]
        chosen_set = set(chosen)
        self._pending = [s for i, s in enumerate(self._pending) if i not in chosen_set]
        return make_pack(taken)

    @property
    def pending(self) -> int:
        return len(self._pending)


def make_pack(samples: Sequence[EncodedSample]) -> Pack:
    ids = [t for s in samples for t in s.input_ids]
    labels = [t for s in samples for t in s.labels]
    positions = [p for s in samples for p in range(len(s))]
    return Pack(torch.tensor([ids]), torch.tensor([labels]), torch.tensor([positions]), len(samples),
                min(s.ver for s in samples))
