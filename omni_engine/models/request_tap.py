"""Per-request tensors into and out of vLLM's forward pass (runs in vLLM's worker, imports vLLM).

vLLM hands a model a flat batch of tokens and no request identity, has no CPU path that exports
hidden states, and no way to give one request's forward tensors of its own. Two of its plugin
points together give all three:

- ``RequestTap``, a logits processor that changes no logits: vLLM tells it, before every forward,
  which request holds which row of the batch (its batch updates, applied by request in a
  ``SlotTable``). A request that wants its states carries a file path in its params
  (``STATES_PATH_KEY``); one that brings tensors of its own carries the path of a safetensors file
  (``INPUTS_PATH_KEY``), read when the request enters the batch.
- ``batch_segments()``, for a model of ours inside its forward: the forward context's attention
  metadata says where each row's tokens start in the flat batch (``query_start_loc``) and at which
  position (``seq_lens`` minus this step's tokens). ``record(inputs_embeds, hidden_states,
  positions)`` writes each request's rows to its files at their positions; a model reads
  ``RequestIO.inputs``.

States: ``<path>.embeds`` (each position's input embedding), ``<path>.hidden`` (its last hidden
state) and ``<path>.positions`` (its rope position in each of three channels: a multimodal rope's
T/H/W, or the plain position three times), rows of float32, written with ``pwrite`` at the position's offset, so a request recomputed
after preemption writes the same rows again and a chunked prompt lands in order. The files live in
``/dev/shm`` and the stage process reads them when the request's final output arrives: the forward
that wrote the last row ran before that output was sampled, so no other signal is needed
(``omni_engine.engines.hidden_states``).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from omni_engine.logits.request_keyed import RequestKeyedLogitsProcessor
from omni_engine.logits.slot_table import LiveRequest

logger = logging.getLogger(__name__)

# Keys of a request's SamplingParams.extra_args: where its states go, where its own inputs are,
# where a model of ours writes rows of its own per generated token (``RowFile``).
STATES_PATH_KEY = "omni_states_path"
INPUTS_PATH_KEY = "omni_inputs_path"
OUTPUTS_PATH_KEY = "omni_outputs_path"
TAP_CLASS = "omni_engine.models.request_tap:RequestTap"
STATE_KINDS = ("embeds", "hidden", "positions")


def create_files(*paths: str) -> None:
    """Create (empty) the files a worker will write a request's rows to: the stage does, when it
    names them, and the worker only opens them. So a write racing the request's end (an abort
    while its step runs) finds its files removed and stops, instead of creating them again where
    nothing would remove them."""
    for path in paths:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))


def open_existing(path: str, flags: int) -> int | None:
    """An fd on ``path``, which the stage created; None if it has been removed (the request ended)."""
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        logger.debug("%s: removed (its request has ended); its rows are not written", path)
        return None


class StateFile:
    """The files one request's rows are written to (created by the stage: ``create_files``).

    A write that fails (``/dev/shm`` full) is logged and ends this request's writes only: the
    stage then finds its rows short and fails that request, naming it; vLLM's engine goes on.
    Files already removed (the request ended) end its writes quietly.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fds: tuple[int, ...] = ()
        self.failed = False

    def write(self, position: int, *rows: torch.Tensor) -> None:
        """``rows`` of each kind (``STATE_KINDS``' order) for the positions from ``position`` on."""
        if self.failed:
            return
        try:
            if not self.fds:
                fds = [open_existing(f"{self.path}.{kind}", os.O_WRONLY) for kind in STATE_KINDS]
                if None in fds:
                    for fd in fds:
                        if fd is not None:
                            os.close(fd)
                    self.failed = True
                    return
                self.fds = tuple(fds)
            for fd, part in zip(self.fds, rows):
                data = part.detach().to(torch.float32).contiguous().cpu().numpy()
                os.pwrite(fd, data.tobytes(), position * data.shape[1] * 4)
        except OSError as exc:
            self.failed = True
            logger.error("states of %s not written: %s", self.path, exc)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = ()


class RowFile:
    """Fixed-width rows of one request, at their index (``pwrite``: a recomputed row lands on itself).

    For what a model of ours makes beside the sampled token (Qwen3-Omni's talker: a frame's residual
    codes and the hidden state that made it); the stage process creates the file (``create_files``)
    and reads it with ``read_rows`` when an output arrives, as it reads states. A failed write is
    logged and ends this file's writes; a file already removed (the request ended) ends them quietly.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.failed = False

    def write(self, index: int, row: torch.Tensor) -> None:
        if self.failed:
            return
        data = row.detach().contiguous().cpu().numpy()
        try:
            if self.fd is None:
                self.fd = open_existing(self.path, os.O_RDWR)
                if self.fd is None:
                    self.failed = True
                    return
            os.pwrite(self.fd, data.tobytes(), index * data.nbytes)
        except OSError as exc:
            self.failed = True
            logger.error("rows of %s not written: %s", self.path, exc)

    def read(self, index: int, like: torch.Tensor) -> torch.Tensor | None:
        """Row ``index`` (shaped and typed as ``like``), or None where it was never written."""
        nbytes = like.numel() * like.element_size()
        try:
            fd = self.fd if self.fd is not None else os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            data = os.pread(fd, nbytes, index * nbytes)
        finally:
            if fd != self.fd:
                os.close(fd)
        if len(data) < nbytes:
            return None
        return torch.frombuffer(bytearray(data), dtype=like.dtype).view(like.shape).clone()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_rows(path: str, count: int, width: int, dtype: Any, start: int = 0) -> Any:
    """Rows ``[start, count)`` of a ``RowFile`` as a numpy array ``[rows, width]`` (short: the rows there are)."""
    import numpy as np

    itemsize = np.dtype(dtype).itemsize
    try:
        with open(path, "rb") as f:
            f.seek(start * width * itemsize)
            data = f.read(max(count - start, 0) * width * itemsize)
    except FileNotFoundError:
        data = b""
    rows = len(data) // (width * itemsize)
    return np.frombuffer(data[:rows * width * itemsize], dtype=dtype).reshape(rows, width).copy()


class RequestIO:
    """What the tap holds for one request: where its states go, the tensors it brought, where its
    model's own rows go, and ``memo``: what a model keeps between one forward and the next."""

    def __init__(self, params: Any) -> None:
        extra = getattr(params, "extra_args", None) or {}
        self.params = params
        states = extra.get(STATES_PATH_KEY)
        self.states = StateFile(states) if isinstance(states, str) else None
        outputs = extra.get(OUTPUTS_PATH_KEY)
        self.outputs = RowFile(outputs) if isinstance(outputs, str) else None
        self.memo: dict[str, Any] = {}
        self.side_files: dict[str, RowFile] = {}
        self.inputs_path = extra.get(INPUTS_PATH_KEY)

    def side_file(self, suffix: str) -> RowFile:
        """Another row file of the request's (``<row file>.<suffix>``), closed with the others."""
        if suffix not in self.side_files:
            self.side_files[suffix] = RowFile(f"{self.outputs.path}.{suffix}")
        return self.side_files[suffix]

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The tensors the request brought (its inputs file, read at the first use and kept in its
        memo, which outlives a re-entry into the batch: ``RequestTap.KEPT_MEMO``)."""
        if "inputs" not in self.memo:
            self.memo["inputs"] = {}
            if isinstance(self.inputs_path, str):
                from safetensors.torch import load_file

                try:
                    self.memo["inputs"] = load_file(self.inputs_path)
                except Exception as exc:  # noqa: BLE001  (safetensors raises its own error types)
                    # Removed by an abort that raced the request's admission (its output goes nowhere),
                    # or damaged: the model leaves a request without inputs alone; the engine goes on.
                    logger.warning("inputs %s not read: %s", self.inputs_path, exc)
        return self.memo["inputs"]

    @property
    def key(self) -> str | None:
        """What names the request across its stays in the batch (a request fed in parts re-enters
        it at every part): the path of its inputs file, or of its row file; None for a request with
        only states out. The stage removes both when the request ends."""
        if isinstance(self.inputs_path, str):
            return self.inputs_path
        return self.outputs.path if self.outputs is not None else None

    def close(self) -> None:
        if self.states is not None:
            self.states.close()
        if self.outputs is not None:
            self.outputs.close()
        for side in self.side_files.values():
            side.close()


class RequestTap(RequestKeyedLogitsProcessor):
    """Row -> request for the requests that carry tensors in or want states out; logits untouched."""

    argmax_invariant = True
    # The worker's tap (one engine per worker process); the model's forward finds it here.
    current: ClassVar[RequestTap | None] = None
    # What of a request's memo outlives its leaving the batch: a request fed in parts leaves and
    # re-enters it at every part (vLLM re-adds it), and its sampler's draws must go on, not restart;
    # nor should a part cost the whole request so far (its inputs read again, its prompt and reply
    # rows made again: O(answer) a part), so what a model made of them is kept too.
    KEPT_MEMO = ("generator", "inputs", "prompt", "reply", "last_hidden", "last_frame")
    KEPT_REQUESTS = 256  # bounded: a kept memo is dropped in time, its request ended or not

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        super().__init__(vllm_config, *runner_args)
        self.kept: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # by ``RequestIO.key``: vLLM adds a re-added request's new row before it removes the old one
        self.live: dict[str, RequestIO] = {}
        RequestTap.current = self

    def new_state(self, request: LiveRequest) -> RequestIO | None:
        extra = getattr(request.params, "extra_args", None) or {}
        if STATES_PATH_KEY not in extra and INPUTS_PATH_KEY not in extra:
            return None
        io = RequestIO(request.params)
        if (key := io.key) is not None:
            before = self.live.get(key)
            kept = self.kept.pop(key, None) or (before.memo if before is not None else {})
            io.memo.update({name: kept[name] for name in self.KEPT_MEMO if name in kept})
            self.live[key] = io
        return io

    def apply_rows(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[LiveRequest]) -> torch.Tensor:
        return logits

    def release(self, request: LiveRequest) -> None:
        io = request.state
        io.close()
        key = io.key
        if key is None or self.live.get(key) is not io:
            return  # (re-added already: its successor holds what it kept)
        del self.live[key]
        kept = {name: io.memo[name] for name in self.KEPT_MEMO if name in io.memo}
        if kept:
            self.kept[key] = kept
            self.sweep_kept()

    def sweep_kept(self) -> None:
        """Drop the oldest kept memo if its request has ended (the stage removed its file), else move
        it last: one file looked at per release, so an ended request's memo goes within as many
        releases as memos are kept; and never more than ``KEPT_REQUESTS``."""
        oldest = next(iter(self.kept))
        if os.path.exists(oldest):
            self.kept.move_to_end(oldest)
        else:
            del self.kept[oldest]
        while len(self.kept) > self.KEPT_REQUESTS:
            self.kept.popitem(last=False)


def batch_segments() -> Iterator[tuple[RequestIO, int, int, int]]:
    """``(io, begin, end, first position)`` of each tapped request in this forward's flat batch."""
    tap = RequestTap.current
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
        if row + 1 < len(starts) and starts[row + 1] > starts[row]:
            begin, end = starts[row], starts[row + 1]
            yield request.state, begin, end, seq_lens[row] - (end - begin)


def record(inputs_embeds: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor) -> None:
    """Write this forward's rows of every request that asked for its states; ``positions`` is the
    forward's own (``[tokens]``, or ``[3, tokens]`` for a multimodal rope)."""
    channels = positions.view(1, -1).expand(3, -1) if positions.ndim == 1 else positions
    for io, begin, end, position in batch_segments():
        if io.states is not None:
            io.states.write(position, inputs_embeds[begin:end], hidden_states[begin:end], channels[:, begin:end].T)
