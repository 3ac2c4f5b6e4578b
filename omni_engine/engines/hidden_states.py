"""An llm stage's side of ``engine_output_type: latent``: each request's states, on its final output.

The stage gives each request a file in ``/dev/shm`` (named with the stage's shared-memory prefix,
so the client's hygiene checks and its clean-up of dead runs see it) and puts the path in the
request's params; the worker's ``HiddenStateTap`` writes the rows (``models/hidden_state_tap.py``).
When the final output arrives, the rows are read into a slot of the stage's output pool (sent on
as a handle, with no further copy) and the file is removed; an aborted or failed request's file is
removed too. The output's ``multimodal_output`` then has, for the ``L`` prompt positions and each
generated token but the last (which is never forwarded), ``input_embeds`` (the embeddings the
model read, multimodal features merged in) and ``hidden_states`` (its last layer, after the final
norm): ``[L + N - 1, hidden]`` float32 each, as transformers' ``generate(output_hidden_states=True)``
gives ``hidden_states[i][0]`` and ``[-1]``.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import torch

from omni_engine.connectors import shm
from omni_engine.models.hidden_state_tap import STATE_KINDS, STATES_PATH_KEY, TAP_CLASS

__all__ = ["LATENT", "StateFiles", "TokenCount", "latent_output"]

LATENT = "latent"
# multimodal_output keys, in STATE_KINDS' order
OUTPUT_KEYS = ("input_embeds", "hidden_states")


def _unlink(path: str) -> None:
    for kind in STATE_KINDS:
        try:
            os.unlink(f"{path}.{kind}")
        except FileNotFoundError:
            pass


def latent_output(stage_id: int, engine_args: dict[str, Any]) -> bool:
    """Pop ``engine_output_type`` from an llm stage's ``engine_args``; for ``latent``, add the tap
    to its logits processors and turn prefix caching off (a cached prompt position is never
    forwarded, so it would have no states). True for ``latent``."""
    kind = engine_args.pop("engine_output_type", "text")
    if kind not in ("text", LATENT):
        raise ValueError(f"stage {stage_id}: engine_args.engine_output_type must be 'text' or '{LATENT}', got {kind!r}")
    if kind != LATENT:
        return False
    if engine_args.get("enable_prefix_caching"):
        raise ValueError(f"stage {stage_id}: engine_args.enable_prefix_caching must be false where "
                         f"engine_output_type is {LATENT} (a cached prompt position is never forwarded, so it "
                         "would have no states)")
    engine_args["enable_prefix_caching"] = False
    engine_args["logits_processors"] = [*(engine_args.get("logits_processors") or []), TAP_CLASS]
    return True


class TokenCount:
    """A request's prompt + generated tokens so far, from its outputs (deltas or cumulative)."""

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self.prompt = 0
        self.generated = 0

    def observe(self, output: Any) -> None:
        if output.prompt_token_ids:  # a delta stream names them on its first output only
            self.prompt = len(output.prompt_token_ids)
        new = len(output.outputs[0].token_ids)
        self.generated = self.generated + new if self.delta else new

    @property
    def total(self) -> int:
        return self.prompt + self.generated


class StateFiles:
    """The state files of one stage process's requests."""

    def __init__(self, stage_id: int, hidden_size: int) -> None:
        self.stage_id = stage_id
        self.hidden_size = hidden_size
        self.prefix = f"{shm.output_pool_prefix() or shm.new_run_prefix()}_states"
        self._paths: dict[str, str] = {}
        self._counter = itertools.count()

    def tag(self, params: Any, request_id: str) -> Any:
        """``params`` (already the stage's own copy) asking for the request's states."""
        path = str(shm.SHM_DIR / f"{self.prefix}{next(self._counter)}")
        self._paths[request_id] = path
        params.extra_args = {**(params.extra_args or {}), STATES_PATH_KEY: path}
        return params

    def take(self, request_id: str, num_tokens: int, arch: str) -> dict[str, torch.Tensor]:
        """The request's rows as ``multimodal_output`` entries; its files are removed."""
        path = self._paths.pop(request_id)
        rows = num_tokens - 1
        out = {}
        try:
            for kind, key in zip(STATE_KINDS, OUTPUT_KEYS):
                out[key] = self._read(f"{path}.{kind}", rows, request_id, arch)
        finally:
            _unlink(path)
        return out

    def _read(self, path: str, rows: int, request_id: str, arch: str) -> torch.Tensor:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise RuntimeError(
                f"stage {self.stage_id}: engine_output_type {LATENT} needs a model that records its states "
                f"(omni_engine.models.hidden_state_tap.record); {arch} wrote none for request {request_id!r}"
            ) from None
        row_bytes = self.hidden_size * 4
        if size != rows * row_bytes:
            raise RuntimeError(f"stage {self.stage_id}: request {request_id!r} has {size / row_bytes:g} rows of "
                               f"states, expected {rows} (prompt + generated - 1); is prefix caching off?")
        buffer = shm.empty_output(size, request_id)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buffer))
        return torch.from_numpy(np.asarray(buffer).view(np.float32)).view(rows, self.hidden_size)

    def discard(self, request_id: str) -> None:
        path = self._paths.pop(request_id, None)
        if path is not None:
            _unlink(path)

    def discard_all(self) -> None:
        for request_id in list(self._paths):
            self.discard(request_id)
