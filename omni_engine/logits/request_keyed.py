"""A logits processor whose state is keyed by request, on either of vLLM's model runners.

Subclass :class:`RequestKeyedLogitsProcessor` and write three hooks:

- ``new_state(request)``: the state of a request entering the batch, or None when the
  processor does not act on it (read its arguments from ``request.params.extra_args``);
- ``apply_rows(logits, rows, requests)``: change the logits rows of those requests
  (``rows[i]`` is the current row of ``requests[i]``) and return the tensor;
- ``release(request)``: the request left the batch (finished, aborted or preempted:
  vLLM does not say which; a preempted request comes back through ``new_state``).

The class is a subclass of both vLLM's V1 ``LogitsProcessor`` (the CPU runner and
``VLLM_USE_V2_MODEL_RUNNER=0``) and Model Runner V2's (the GPU default), so one
``"pkg.module:Class"`` name passes either runner's loader and the frontend's params
validator. Which runner built it is told by its constructor's arguments; each
runner's row bookkeeping is then translated into the same ``SlotTable``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate
from vllm.v1.sample.logits_processor.interface import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

from omni_engine.logits.slot_table import LiveRequest, SlotTable, request_id_of


class RequestKeyedLogitsProcessor(V1LogitsProcessor, V2LogitsProcessor):
    """Per-request state that stays with its request however vLLM moves rows."""

    # True only for a processor that never changes which token is the largest.
    argmax_invariant: ClassVar[bool] = False

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        # V1 calls (vllm_config, device, is_pin_memory); V2 (vllm_config, req_states).
        self.vllm_config = vllm_config
        self.runner = "v2" if len(runner_args) == 1 else "v1"
        self.req_states = runner_args[0] if self.runner == "v2" else None
        self.device = self.req_states.device if self.runner == "v2" else runner_args[0]
        self.table = SlotTable(release=self.release)

    # ------------------------------------------------------------ the hooks
    def new_state(self, request: LiveRequest) -> Any | None:
        """The state of a request entering the batch; None: leave this request alone."""
        raise NotImplementedError

    def apply_rows(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[LiveRequest]) -> torch.Tensor:
        """Change the rows of ``requests`` (``rows[i]`` belongs to ``requests[i]``)."""
        raise NotImplementedError

    def release(self, request: LiveRequest) -> None:
        """The request left the batch; free what its state holds."""

    def batch_ready(self, requests: Sequence[LiveRequest]) -> None:
        """V1 only: this step's batch is known, before the forward pass (e.g. to start work
        that ``apply_rows`` will need, overlapped with the model)."""

    # ------------------------------------------------------------ V1 runner
    def is_argmax_invariant(self) -> bool:
        return self.argmax_invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        # vLLM calls this before every forward pass (batch_update None: same requests).
        if batch_update is not None:
            self.table.apply_batch_update(batch_update, self._admit)
        if len(self.table) and type(self).batch_ready is not RequestKeyedLogitsProcessor.batch_ready:
            self.batch_ready([request for _, request in self.table.items()])

    def _admit(self, row: int, params: Any, prompt: Sequence[int] | None, output: Sequence[int]) -> LiveRequest | None:
        request = LiveRequest(request_id_of(params), params, prompt, output)
        request.state = self.new_state(request)
        return request if request.state is not None else None

    # ------------------------------------------------------------ V2 runner
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        # V2 reports no removals: a slot's previous holder leaves when the slot is reused.
        request = LiveRequest(request_id_of(sampling_params), sampling_params,
                              _V2Tokens(self.req_states, req_idx, prompt=True),
                              _V2Tokens(self.req_states, req_idx, prompt=False))
        request.state = self.new_state(request)
        self.table.assign(req_idx, request if request.state is not None else None)
        return request.state is not None

    def apply_staged_writes(self) -> None:
        pass

    # ------------------------------------------------------------ both
    def apply(self, logits: torch.Tensor, ctx: LogitsContext | None = None) -> torch.Tensor:
        if not len(self.table):
            return logits
        if ctx is None:  # V1: the rows are the batch's slots, kept condensed by vLLM
            held = [(row, request) for row, request in self.table.items() if row < logits.shape[0]]
        else:
            held = self._v2_rows(logits, ctx)
        if not held:
            return logits
        rows, requests = zip(*held)
        return self.apply_rows(logits, rows, requests)

    def _v2_rows(self, logits: torch.Tensor, ctx: LogitsContext) -> list[tuple[int, LiveRequest]]:
        """V2 reorders rows every step: ``ctx`` maps each row to its request's slot."""
        if logits.shape[0] == len(ctx.idx_mapping_np):
            slots = ctx.idx_mapping_np.tolist()  # host copy: no device sync
        else:  # several rows per request (speculative decoding)
            slots = ctx.expanded_idx_mapping.tolist()
        held = []
        for row, slot in enumerate(slots):
            request = self.table.get(slot)
            if request is not None:
                held.append((row, request))
        if len(slots) == len(ctx.seq_lens_upper_bound_np):
            for row, request in held:
                request.output_token_ids.set_length(int(ctx.seq_lens_upper_bound_np[row]))
        return held


class _V2Tokens(Sequence[int]):
    """A request's prompt or output tokens on Model Runner V2: its slot's row of the
    runner's token buffer, read from the device only when a processor asks for tokens
    (``len`` is free: the step's sequence length comes with the batch)."""

    def __init__(self, req_states: Any, slot: int, prompt: bool) -> None:
        self._states, self._slot, self._prompt = req_states, slot, prompt
        self._seq_len: int | None = None
        self._cache: list[int] | None = None

    def set_length(self, seq_len: int) -> None:
        if seq_len != self._seq_len:
            self._seq_len, self._cache = seq_len, None

    def _bounds(self) -> tuple[int, int]:
        prompt_len = int(self._states.prompt_len.np[self._slot])
        if self._prompt:
            return 0, prompt_len
        return prompt_len, max(prompt_len, self._seq_len if self._seq_len is not None else prompt_len)

    def __len__(self) -> int:
        start, end = self._bounds()
        return end - start

    def _tokens(self) -> list[int]:
        if self._cache is None:
            start, end = self._bounds()
            self._cache = self._states.all_token_ids.gpu[self._slot, start:end].tolist()
        return self._cache

    def __getitem__(self, index: Any) -> Any:
        return self._tokens()[index]

    def __iter__(self):
        return iter(self._tokens())
