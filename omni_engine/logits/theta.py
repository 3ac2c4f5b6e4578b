"""Theta's capture processor (in theta's vLLM engine core): the rows of scoring requests,
as log-probabilities, straight to the teacher that asked, one message per step.

Its requests come from ``ThetaScorer`` (theta_scorer.py): each carries, in its
``extra_args``, where its row goes and for which teacher step.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import zmq

from omni_engine.logits.alpha import log_softmax
from omni_engine.logits.messages import CAPTURE_KEY, PushSockets, rows_frames
from omni_engine.logits.request_keyed import RequestKeyedLogitsProcessor
from omni_engine.logits.slot_table import LiveRequest

logger = logging.getLogger(__name__)


class ThetaCaptureProcessor(RequestKeyedLogitsProcessor):
    """Sends the log-probabilities of each scoring request's row to its teacher; changes nothing.

    Not declared argmax-invariant, though it changes nothing: vLLM runs argmax-invariant
    processors only for randomly sampled rows, after temperature. Run with the others, it
    sees every row's raw logits whatever the request's sampling, so scoring chunks can be
    greedy (an argmax instead of a random draw over the vocabulary)."""

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        super().__init__(vllm_config, *runner_args)
        self._pushes = PushSockets()

    def new_state(self, request: LiveRequest) -> Any | None:
        capture = (request.params.extra_args or {}).get(CAPTURE_KEY)
        # (reply address, step, teacher's request id, seconds the batch took to reach theta, replica)
        return tuple(capture) if capture else None

    def apply_rows(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[LiveRequest]) -> torch.Tensor:
        logprobs = log_softmax(logits[list(rows)]).cpu().numpy()
        by_reply: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            reply, step = request.state[:2]
            by_reply[(reply, step)].append(i)
        for (reply, step), picks in by_reply.items():
            outbound = max(requests[i].state[3] for i in picks)
            frames = rows_frames(step, [requests[i].state[2] for i in picks], pick_rows(logprobs, picks),
                                 outbound_s=outbound, replica=requests[picks[0]].state[4])
            try:  # never block theta's engine on a teacher that is gone
                self._pushes.get(reply).send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                logger.warning("theta rows for step %d dropped: teacher %s is not reading", step, reply)
        return logits

    def __del__(self) -> None:
        self._pushes.close()


def pick_rows(logprobs: np.ndarray, picks: list[int]) -> np.ndarray:
    return logprobs if len(picks) == len(logprobs) else logprobs[picks]
