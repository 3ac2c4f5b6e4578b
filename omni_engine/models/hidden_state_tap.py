"""Per-request states out of vLLM's forward pass (runs in vLLM's worker, imports vLLM).

vLLM hands a model a flat batch of tokens and no request identity, and has no CPU path that
exports hidden states. Two of its plugin points together give both:

- ``HiddenStateTap``, a logits processor that changes no logits: vLLM tells it, before every
  forward, which request holds which row of the batch (its batch updates, applied by request in a
  ``SlotTable``), and a request asks for its states by carrying a file path in its params;
- ``record(inputs_embeds, hidden_states)``, called by a model of ours at the end of its forward:
  the forward context's attention metadata says where each row's tokens start in the flat batch
  (``query_start_loc``) and at which position (``seq_lens`` minus the tokens of this step), so each
  request's rows go to its file at their positions.

A request's path names two files, ``<path>.embeds`` (each position's input embedding) and
``<path>.hidden`` (its last hidden state), rows of float32. Writes are ``pwrite`` at the position's
offset: a request recomputed after preemption writes the same rows again, and a chunked prompt
lands in order. The file lives in ``/dev/shm`` and the stage
process reads it when the request's final output arrives: the forward that wrote the last row ran
before that output was sampled, so no other signal is needed (``omni_engine.engines.hidden_states``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from omni_engine.logits.request_keyed import RequestKeyedLogitsProcessor
from omni_engine.logits.slot_table import LiveRequest

# The key of a request's SamplingParams.extra_args that holds the path its states go to.
STATES_PATH_KEY = "omni_states_path"
TAP_CLASS = "omni_engine.models.hidden_state_tap:HiddenStateTap"


STATE_KINDS = ("embeds", "hidden")


class StateFile:
    """The files one request's rows are written to (opened on its first rows)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fds: tuple[int, ...] = ()

    def write(self, position: int, *rows: torch.Tensor) -> None:
        """``rows`` of each kind (``STATE_KINDS``' order) for the positions from ``position`` on."""
        if not self.fds:
            self.fds = tuple(os.open(f"{self.path}.{kind}", os.O_WRONLY | os.O_CREAT, 0o600) for kind in STATE_KINDS)
        for fd, part in zip(self.fds, rows):
            data = part.detach().to(torch.float32).contiguous().cpu().numpy()
            os.pwrite(fd, data.tobytes(), position * data.shape[1] * 4)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = ()


class HiddenStateTap(RequestKeyedLogitsProcessor):
    """Row -> request for the requests that asked for their states; the logits stay as they are."""

    argmax_invariant = True
    # The worker's tap (one engine per worker process); the model's forward finds it here.
    current: ClassVar[HiddenStateTap | None] = None

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        super().__init__(vllm_config, *runner_args)
        HiddenStateTap.current = self

    def new_state(self, request: LiveRequest) -> StateFile | None:
        path = (getattr(request.params, "extra_args", None) or {}).get(STATES_PATH_KEY)
        return StateFile(path) if isinstance(path, str) else None

    def apply_rows(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[LiveRequest]) -> torch.Tensor:
        return logits

    def release(self, request: LiveRequest) -> None:
        request.state.close()


def record(inputs_embeds: torch.Tensor, hidden_states: torch.Tensor) -> None:
    """Write this forward's rows of every request that asked for them (no-op otherwise)."""
    tap = HiddenStateTap.current
    if tap is None or not len(tap.table):
        return
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # micro-batches: not used with one device on CPU
        metadata = metadata[0]
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    if metadata is None:  # a dummy run (profiling, warm-up): no requests
        return
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    for row, request in tap.table.items():
        if row + 1 >= len(starts):
            continue
        begin, end = starts[row], starts[row + 1]
        if end > begin:
            request.state.write(seq_lens[row] - (end - begin), inputs_embeds[begin:end], hidden_states[begin:end])
