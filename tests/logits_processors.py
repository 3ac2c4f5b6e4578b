"""Logits processors for the tests, importable by stage processes and the server
(``tests.logits_processors:...``).

Both force, at every step, a token that only the request and the step determine
(``fingerprint_token``), so any row given to the wrong request shows in the output.
``Fingerprint`` keys its state by request (``RequestKeyedLogitsProcessor``); ``SeedSlotFingerprint``
keeps it by slot index as the optimal-sampling seed did (its negative control).
A request opts in with ``extra_args`` (``vllm_xargs``) ``{"fingerprint": "request" | "slot"}``.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate
from vllm.v1.sample.logits_processor.interface import LogitsProcessor as V1LogitsProcessor

from omni_engine.logits import LiveRequest, RequestKeyedLogitsProcessor
from omni_engine.logits.slot_table import request_id_of

MODES = ("request", "slot")
# Where Fingerprint writes its SlotTable counters (set in the serving process's environment).
STATS_ENV = "OMNI_TEST_FINGERPRINT_STATS"


def fingerprint_token(request_id: str, step: int) -> int:
    """A token id in [1000, 21000) of SmolLM2's 49152, fixed by (request, step)."""
    return 1000 + zlib.crc32(f"{request_id}/{step}".encode()) % 20000


def _mode(params: Any) -> str | None:
    return (params.extra_args or {}).get("fingerprint")


def _validate(params: Any) -> None:
    mode = _mode(params)
    if mode is not None and mode not in MODES:
        raise ValueError(f"vllm_xargs.fingerprint must be one of {list(MODES)}, got {mode!r}")


def _force(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = float("-inf")
    logits[index, torch.tensor(tokens, dtype=torch.long, device=logits.device)] = 0.0
    return logits


class Fingerprint(RequestKeyedLogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        _validate(sampling_params)

    def new_state(self, request: LiveRequest) -> Any | None:
        return True if _mode(request.params) == "request" else None

    def apply_rows(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[LiveRequest]) -> torch.Tensor:
        return _force(logits, rows, [fingerprint_token(r.request_id, len(r.output_token_ids)) for r in requests])

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        super().update_state(batch_update)
        if batch_update is not None and (path := os.environ.get(STATS_ENV)):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.table.stats.as_dict(), f)
            os.replace(tmp, path)


class SeedSlotFingerprint(V1LogitsProcessor):
    """The seed's fix, kept as a negative control: state by the slot a request was added
    at, rows indexed by that slot, ``moved`` ignored."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        _validate(sampling_params)

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.slots: dict[int, tuple[str, Sequence[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.slots.pop(index, None)
        for index, params, _, output in batch_update.added:
            if _mode(params) == "slot":
                self.slots[index] = (request_id_of(params), output)
            else:
                self.slots.pop(index, None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        held = [(index, fingerprint_token(rid, len(out))) for index, (rid, out) in self.slots.items()
                if index < logits.shape[0]]
        if held:
            rows, tokens = zip(*held)
            _force(logits, rows, tokens)
        return logits
