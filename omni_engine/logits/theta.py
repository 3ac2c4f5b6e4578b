"""The theta side of two-model mixing: a scorer in the theta stage and a capture processor
in theta's vLLM engine core.

Each teacher step brings one ``ScoreBatch`` per theta replica. The ``ThetaScorer`` keeps
each request's token list (its theta prompt, tokenized with theta's own template, plus
the tokens generated so far) and submits it to theta's vLLM as a one-token request; the
prefix cache makes that the cost of the tokens past the last full block, not of the whole
sequence. ``ThetaCaptureProcessor`` takes the logits row of every such request, turns it
into log-probabilities and sends the step's rows to the teacher in one message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio

from omni_engine.logits.alpha import log_softmax
from omni_engine.logits.messages import (
    CAPTURE_KEY,
    TO_THETA,
    ReleaseRequests,
    ScoreBatch,
    ScoreItem,
    rows_frames,
)
from omni_engine.logits.request_keyed import RequestKeyedLogitsProcessor
from omni_engine.logits.slot_table import LiveRequest

logger = logging.getLogger(__name__)


class ThetaCaptureProcessor(RequestKeyedLogitsProcessor):
    """Sends the log-probabilities of each scoring request's row to its teacher; changes nothing."""

    argmax_invariant = True

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        super().__init__(vllm_config, *runner_args)
        self._ctx = zmq.Context()
        self._pushes: dict[str, zmq.Socket] = {}

    def new_state(self, request: LiveRequest) -> Any | None:
        capture = (request.params.extra_args or {}).get(CAPTURE_KEY)
        return tuple(capture) if capture else None  # (reply address, step, teacher's request id)

    def apply_rows(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[LiveRequest]) -> torch.Tensor:
        logprobs = log_softmax(logits[list(rows)]).cpu().numpy()
        by_reply: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            reply, step, _ = request.state
            by_reply[(reply, step)].append(i)
        for (reply, step), picks in by_reply.items():
            self._push(reply).send_multipart(
                rows_frames(step, [requests[i].state[2] for i in picks], pick_rows(logprobs, picks)), copy=False)
        return logits

    def _push(self, address: str) -> zmq.Socket:
        sock = self._pushes.get(address)
        if sock is None:
            sock = self._pushes[address] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock

    def __del__(self) -> None:
        for sock in self._pushes.values():
            sock.close(0)


def pick_rows(logprobs: np.ndarray, picks: list[int]) -> np.ndarray:
    return logprobs if len(picks) == len(logprobs) else logprobs[picks]


class ThetaScorer:
    """Serves teachers' score batches from theta's ``AsyncLLM`` (runs on the stage's loop)."""

    def __init__(self, engine: Any, address: str, chat_template: bool) -> None:
        self.engine, self.address, self.chat_template = engine, address, chat_template
        self.tokens: dict[str, list[int]] = {}
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(address)
        self._pushes: dict[str, zmq.asyncio.Socket] = {}
        self._tokenizer: Any = None
        self._task: asyncio.Task | None = None
        self._scoring: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="theta-scorer")

    async def _serve(self) -> None:
        from vllm import SamplingParams

        self._tokenizer = self.engine.get_tokenizer() if hasattr(self.engine, "get_tokenizer") else None
        if asyncio.iscoroutine(self._tokenizer):
            self._tokenizer = await self._tokenizer
        self._sampling = SamplingParams
        while True:
            try:
                message = TO_THETA.decode(await self._pull.recv())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a malformed message must not stop scoring
                logger.exception("theta scorer %s: malformed message dropped", self.address)
                continue
            if isinstance(message, ReleaseRequests):
                for rid in message.request_ids:
                    self.tokens.pop(rid, None)
            else:
                self._score_batch(message)

    def _score_batch(self, batch: ScoreBatch) -> None:
        errors: dict[str, str] = {}
        prompts: dict[str, list[int]] = {}
        for item in batch.items:
            try:
                tokens = self._tokens_of(item)
            except Exception as exc:  # noqa: BLE001 - reported to the teacher, per request
                errors[item.request_id] = f"theta could not take request {item.request_id!r}: {exc}"
                continue
            if item.theta_prompt is not None or item.theta_messages is not None:
                prompts[item.request_id] = tokens[:len(tokens) - len(item.new_tokens)]
            task = asyncio.get_running_loop().create_task(self._score(batch, item.request_id, tokens))
            self._scoring.add(task)
            task.add_done_callback(self._scoring.discard)
        if errors or prompts:
            self._send(batch, errors, prompts)

    def _tokens_of(self, item: ScoreItem) -> list[int]:
        if item.theta_prompt is not None or item.theta_messages is not None:
            self.tokens[item.request_id] = self._encode_prompt(item)
        tokens = self.tokens.get(item.request_id)
        if tokens is None:
            raise ValueError("no theta prompt was sent with its first step")
        tokens.extend(item.new_tokens)
        return list(tokens)

    def _encode_prompt(self, item: ScoreItem) -> list[int]:
        if item.theta_messages is not None:
            messages = json.loads(item.theta_messages)
        elif self.chat_template:
            messages = [{"role": "user", "content": item.theta_prompt}]
        else:
            return list(self._tokenizer.encode(item.theta_prompt))
        return list(self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))

    async def _score(self, batch: ScoreBatch, rid: str, tokens: list[int]) -> None:
        params = self._sampling(max_tokens=1, detokenize=False,
                                extra_args={CAPTURE_KEY: [batch.reply, batch.step, rid]})
        try:
            async for _ in self.engine.generate({"prompt_token_ids": tokens}, params, f"theta-{rid}-{batch.step}"):
                pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the teacher, per request
            self._send(batch, {rid: f"theta failed to score request {rid!r}: {type(exc).__name__}: {exc}"})

    def _send(self, batch: ScoreBatch, errors: dict[str, str], prompts: dict[str, list[int]] | None = None) -> None:
        """Errors and started prompts, to the teacher that sent ``batch`` (rows come from the engine core)."""
        sock = self._pushes.get(batch.reply)
        if sock is None:
            sock = self._pushes[batch.reply] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(batch.reply)
        sock.send_multipart(rows_frames(batch.step, [], np.zeros((0, 0), np.float32), errors, prompts))

    async def close(self) -> None:
        for task in [self._task, *self._scoring]:
            if task is not None:
                task.cancel()
        self._pull.close(0)
        for sock in self._pushes.values():
            sock.close(0)
