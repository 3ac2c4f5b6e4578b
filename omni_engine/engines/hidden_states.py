"""An llm stage's side of ``engine_output_type: latent``: each request's states, on its final output.

The stage gives each request a file in ``/dev/shm`` (named with the stage's shared-memory prefix,
so the client's hygiene checks and its clean-up of dead runs see it) and puts the path in the
request's params; the worker's ``RequestTap`` writes the rows (``models/request_tap.py``).
When the final output arrives, the rows are read into a slot of the stage's output pool (sent on
as a handle, with no further copy) and the file is removed; an aborted or failed request's file is
removed too. The output's ``multimodal_output`` then has, for the ``L`` prompt positions and each
generated token but the last (which is never forwarded), ``input_embeds`` (the embeddings the
model read, multimodal features merged in) and ``hidden_states`` (its last layer, after the final
norm): ``[L + N - 1, hidden]`` float32 each, as transformers' ``generate(output_hidden_states=True)``
gives ``hidden_states[i][0]`` and ``[-1]``; and ``positions`` ``[L + N - 1, 3]`` (float32), each
position's rope position in three channels (a multimodal rope's T/H/W: where an image's tokens sit
in its grid, which a talker downstream needs to place its own prompt the same way).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import torch

from omni_engine.connectors import shm
from omni_engine.models.request_tap import STATE_KINDS, STATES_PATH_KEY, TAP_CLASS, create_files

__all__ = ["LATENT", "StateFiles", "TokenCount", "configure_request_tap"]

LATENT = "latent"
# multimodal_output keys, in STATE_KINDS' order
OUTPUT_KEYS = ("input_embeds", "hidden_states", "positions")
ROPE_CHANNELS = 3  # the width of a positions row


def _unlink(path: str) -> None:
    for kind in STATE_KINDS:
        try:
            os.unlink(f"{path}.{kind}")
        except FileNotFoundError:
            pass


def configure_request_tap(stage_id: int, engine_args: dict[str, Any]) -> tuple[bool, str | None]:
    """Pop ``engine_output_type`` and ``request_adapter`` from an llm stage's ``engine_args``.

    With ``engine_output_type: latent`` or a request adapter (whose requests bring tensors of
    their own), the worker's ``RequestTap`` joins the logits processors and prefix caching is
    turned off: a cached prompt position is never forwarded (it would have no states), and a
    request whose embeddings are its own shares nothing with another's equal placeholder ids.
    Returns ``(latent, adapter)``.
    """
    kind = engine_args.pop("engine_output_type", "text")
    if kind not in ("text", LATENT):
        raise ValueError(f"stage {stage_id}: engine_args.engine_output_type must be 'text' or '{LATENT}', got {kind!r}")
    adapter = engine_args.pop("request_adapter", None)
    if kind != LATENT and adapter is None:
        return False, None
    if engine_args.get("enable_prefix_caching"):
        raise ValueError(f"stage {stage_id}: engine_args.enable_prefix_caching must be false where "
                         f"engine_output_type is {LATENT} or a request_adapter is set (a cached prompt position "
                         "is never forwarded, and requests with their own embeddings share no prefix)")
    engine_args["enable_prefix_caching"] = False
    engine_args["logits_processors"] = [*(engine_args.get("logits_processors") or []), TAP_CLASS]
    return kind == LATENT, adapter


class TokenCount:
    """A request's prompt length and generated ids so far, from its outputs (deltas or cumulative)."""

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self.prompt = 0
        self.generated: list[int] = []

    def observe(self, output: Any) -> None:
        if output.prompt_token_ids:  # a delta stream names them on its first output only
            self.prompt = len(output.prompt_token_ids)
        if self.delta:
            self.generated.extend(output.outputs[0].token_ids)  # in place: a long stream stays O(n)
        else:
            self.generated = list(output.outputs[0].token_ids)

    @property
    def total(self) -> int:
        return self.prompt + len(self.generated)


class StateFiles:
    """The state files of one stage process's requests."""

    def __init__(self, stage_id: int, hidden_size: int) -> None:
        self.stage_id = stage_id
        self.hidden_size = hidden_size
        self._prefix: str | None = None  # known at the first request: the stage's pool is set after start
        self._paths: dict[str, str] = {}
        self._counter = itertools.count()

    @property
    def prefix(self) -> str:
        if self._prefix is None:
            self._prefix = shm.stage_file_prefix("states")
        return self._prefix

    def tag(self, params: Any, request_id: str) -> Any:
        """``params`` (already the stage's own copy) asking for the request's states."""
        path = str(shm.SHM_DIR / f"{self.prefix}{next(self._counter)}")
        try:
            create_files(*(f"{path}.{kind}" for kind in STATE_KINDS))  # (the worker only opens them)
        except OSError as exc:
            _unlink(path)
            raise RuntimeError(f"stage {self.stage_id}: request {request_id!r}: its state files could not be "
                               f"made in {shm.SHM_DIR}: {exc}") from None
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
                width = ROPE_CHANNELS if kind == "positions" else self.hidden_size
                out[key] = self._read(f"{path}.{kind}", rows, width, request_id, arch)
        finally:
            _unlink(path)
        return out

    def rows(self, request_id: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``[start, stop)`` of the request's states, as ``take`` names them (its files stay):
        a consumer that starts on the first states gets them as the request generates."""
        path = self._paths[request_id]
        out = {}
        for kind, key in zip(STATE_KINDS, OUTPUT_KEYS):
            width = ROPE_CHANNELS if kind == "positions" else self.hidden_size
            row_bytes = width * 4
            buffer = shm.empty_output((stop - start) * row_bytes, request_id)
            with open(f"{path}.{kind}", "rb", buffering=0) as f:
                got = os.preadv(f.fileno(), [memoryview(buffer)], start * row_bytes)
            if got != buffer.nbytes:
                raise RuntimeError(f"stage {self.stage_id}: request {request_id!r} has states up to row "
                                   f"{start + got // row_bytes}, expected {stop} (prompt + generated - 1)")
            out[key] = torch.from_numpy(np.asarray(buffer).view(np.float32)).view(stop - start, width)
        return out

    def _read(self, path: str, rows: int, width: int, request_id: str, arch: str) -> torch.Tensor:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            size = 0
        if size == 0 and rows > 0:
            raise RuntimeError(
                f"stage {self.stage_id}: engine_output_type {LATENT} needs a model that records its states "
                f"(omni_engine.models.request_tap.record); {arch} wrote none for request {request_id!r}"
            )
        row_bytes = width * 4
        if size != rows * row_bytes:
            raise RuntimeError(f"stage {self.stage_id}: request {request_id!r} has {size / row_bytes:g} rows of "
                               f"states, expected {rows} (prompt + generated - 1); is prefix caching off?")
        buffer = shm.empty_output(size, request_id)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buffer))
        return torch.from_numpy(np.asarray(buffer).view(np.float32)).view(rows, width)

    def discard(self, request_id: str) -> None:
        path = self._paths.pop(request_id, None)
        if path is not None:
            _unlink(path)
