"""The teacher side of two-model mixing (the seed's optimal sampling): a logits processor
in the teacher's vLLM engine core that writes log q ∝ (1-α)·log π_θ + α·log π_t into each
live request's row.

Per step it sends one ``ScoreBatch`` per theta replica (every live request's tokens
since the last step; a request stays on one replica, picked from its id), waits for
the rows, mixes, and records each request's α. Theta's prompt is the request's own
(``extra_args`` / ``vllm_xargs``: ``theta_prompt``, or ``theta_messages`` as a JSON list
of chat messages), never a list shared across requests. When a request leaves the batch
its α history is appended to the JSONL file as one line, and theta forgets its tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from omni_engine.logits.alpha import choose_alpha, log_softmax, mix
from omni_engine.logits.messages import PushSockets, ReleaseRequests, ScoreBatch, ScoreItem, encode, read_rows
from omni_engine.logits.mixing_wiring import MIXING_KEY
from omni_engine.logits.request_keyed import RequestKeyedLogitsProcessor
from omni_engine.logits.slot_table import LiveRequest

logger = logging.getLogger(__name__)

@dataclass
class MixState:
    """One request's mixing: its theta prompt, its replica, what theta has seen, its α so far."""

    theta_prompt: str | None
    theta_messages: str | None
    replica: int
    method: str
    alpha_value: float | None
    record: bool = False
    sent: int = 0  # output tokens theta has been sent
    last_row: np.ndarray | None = None  # theta's latest row (reused by a step with no new token)
    alphas: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Seconds its steps waited for theta's rows, and the transport's part of that wait.
    theta_wait_s: float = 0.0
    transport_s: float = 0.0
    # Steps whose batch theta's replica ran in more than one forward pass (its engine core
    # began with part of the batch): each such step costs theta a second pass.
    theta_split_steps: int = 0


def mixing_params_problem(extra: dict[str, Any]) -> str | None:
    """What is wrong with a request's mixing arguments (``extra_args`` / ``vllm_xargs``), or None."""
    from omni_engine.logits.mixing_wiring import ALPHA_METHODS

    method, value = extra.get("mixing_alpha"), extra.get("mixing_alpha_value")
    if method is not None and method not in ALPHA_METHODS:
        return f"vllm_xargs.mixing_alpha must be one of {list(ALPHA_METHODS)}, got {method!r}"
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
        return f"vllm_xargs.mixing_alpha_value must be a number in [0, 1], got {value!r}"
    if method == "fixed" and value is None:
        return "vllm_xargs.mixing_alpha 'fixed' needs vllm_xargs.mixing_alpha_value (in [0, 1])"
    prompt, messages = extra.get("theta_prompt"), extra.get("theta_messages")
    if prompt is None and messages is None:
        return ("a mixing request needs its theta prompt: vllm_xargs (extra_args) theta_prompt (text) or "
                "theta_messages (a JSON list of chat messages)")
    if prompt is not None and not isinstance(prompt, str):
        return f"vllm_xargs.theta_prompt must be a string, got {type(prompt).__name__}"
    if messages is not None:
        try:
            parsed = json.loads(messages) if isinstance(messages, str) else None
        except ValueError as exc:
            return f"vllm_xargs.theta_messages is not valid JSON: {exc}"
        if not (isinstance(parsed, list) and parsed and all(isinstance(m, dict) and "role" in m for m in parsed)):
            return "vllm_xargs.theta_messages must be a JSON list of chat messages ({\"role\": ..., \"content\": ...})"
    return None


def replica_for(request_id: str, replicas: int) -> int:
    """The theta replica of a request: fixed by its id, spread evenly even over ids that
    differ in one character (crc32's low bit alternates over "req-0", "req-1", ...)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") % replicas


def append_line(path: str, record: dict[str, Any]) -> None:
    """One JSON line, in one write to a file opened for appending: lines of concurrent
    writers (replicas of the teacher) never interleave, and nothing is overwritten."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


class ThetaMixingProcessor(RequestKeyedLogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        if (problem := mixing_params_problem(sampling_params.extra_args or {})) is not None:
            raise ValueError(problem)

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        super().__init__(vllm_config, *runner_args)
        settings = (getattr(vllm_config, "additional_config", None) or {}).get(MIXING_KEY)
        if not settings:
            raise ValueError(f"ThetaMixingProcessor needs additional_config[{MIXING_KEY!r}] (a pipeline stage's "
                             "mixing section sets it)")
        self.method, self.alpha_value = settings["alpha"], settings.get("alpha_value")
        self.timeout_ms = int(float(settings.get("timeout_s", 60.0)) * 1000)
        self.history = settings.get("alpha_history")
        self.record = Path(settings["record_rows"]) if settings.get("record_rows") else None
        overlap = settings.get("overlap", "auto")
        self.overlap = self.device.type != "cpu" if overlap == "auto" else bool(overlap)
        self.step = 0
        self._theta_prompts: dict[str, list[int]] = {}  # theta's prompt tokens, by request
        self._unresponsive: set[int] = set()  # theta replicas that missed a step
        # Sent before the forward pass (V1): request id -> output length theta was sent.
        self._in_flight: dict[str, int] = {}
        self._known: dict[str, np.ndarray] = {}
        self._ctx = zmq.Context()
        self.reply = f"ipc://{settings['socket_dir']}/reply-{os.getpid()}-{id(self):x}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.reply)
        self._pushes = PushSockets()
        self._thetas = [self._pushes.get(address) for address in settings["theta"]]

    # ------------------------------------------------------------ hooks
    def new_state(self, request: LiveRequest) -> MixState | None:
        extra = request.params.extra_args or {}
        replica = replica_for(request.request_id, len(self._thetas))
        method = extra.get("mixing_alpha") or self.method
        value = extra.get("mixing_alpha_value", self.alpha_value if method == self.method else None)
        return MixState(extra.get("theta_prompt"), extra.get("theta_messages"), replica, method, value,
                        record=bool(extra.get("mixing_record")) and self.record is not None)

    def release(self, request: LiveRequest) -> None:
        state: MixState = request.state
        self._send(state.replica, ReleaseRequests([request.request_id]))
        theta_prompt = self._theta_prompts.pop(request.request_id, None)
        if self.history:
            append_line(self.history, {"request_id": request.request_id, "alpha_method": state.method,
                                       "steps": len(state.alphas), "alpha": state.alphas,
                                       "theta_prompt_token_ids": theta_prompt,
                                       "theta_wait_s": round(state.theta_wait_s, 6),
                                       "transport_s": round(state.transport_s, 6),
                                       "theta_split_steps": state.theta_split_steps,
                                       **({"errors": state.errors} if state.errors else {})})

    def batch_ready(self, requests: Sequence[LiveRequest]) -> None:
        """Ask theta now, so theta's step runs while the teacher's forward pass does (on
        accelerators; on CPUs the two would share the cores, which measured 2x slower)."""
        if not self.overlap:
            return
        self.step += 1
        self._known = self._send_batches(requests)
        self._in_flight = {r.request_id: len(r.output_token_ids) for r in requests}

    def apply_rows(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[LiveRequest]) -> torch.Tensor:
        started = time.monotonic()
        if any(self._in_flight.get(r.request_id) != len(r.output_token_ids) for r in requests):
            # Not asked before the forward pass (Model Runner V2), or the tokens changed since.
            self.step += 1
            self._known = self._send_batches(requests)
        self._in_flight = {}
        theta, errors, transport = self._theta_rows(requests)
        waited = time.monotonic() - started
        for request in requests:
            request.state.theta_wait_s += waited
            request.state.transport_s += transport
        rows_t = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
        log_teacher = log_softmax(logits[rows_t])
        if theta.shape[-1] != log_teacher.shape[-1]:
            problem = (f"theta's rows have {theta.shape[-1]} entries, the teacher's {log_teacher.shape[-1]}: mixing "
                       "needs models with one vocabulary")
            errors = {request.request_id: problem for request in requests}
            theta = np.zeros((len(requests), log_teacher.shape[-1]), np.float32)
        log_theta = torch.from_numpy(theta).to(log_teacher.device)
        alpha = self._alphas(requests, log_theta, log_teacher)
        # A request theta could not score this step decodes from the teacher alone (α = 1).
        for i, request in enumerate(requests):
            if request.request_id in errors:
                alpha[i] = 1.0
                request.state.errors.append(f"step {len(request.output_token_ids)}: {errors[request.request_id]}")
        log_q = mix(log_theta, log_teacher, alpha)
        logits[rows_t] = log_q.to(logits.dtype)
        for request, a in zip(requests, alpha.tolist()):
            request.state.alphas.append(a)
        if any(request.state.record for request in requests):
            self._record(requests, log_theta, log_teacher, alpha, log_q)
        return logits

    def _alphas(self, requests: Sequence[LiveRequest], log_theta: torch.Tensor,
                log_teacher: torch.Tensor) -> torch.Tensor:
        """Each row's α by its request's method (one vectorized call per method in use)."""
        alpha = torch.empty(len(requests), dtype=log_theta.dtype, device=log_theta.device)
        by_method: dict[tuple[str, float | None], list[int]] = {}
        for i, request in enumerate(requests):
            by_method.setdefault((request.state.method, request.state.alpha_value), []).append(i)
        for (method, value), picks in by_method.items():
            index = torch.tensor(picks, dtype=torch.long, device=log_theta.device)
            alpha[index] = choose_alpha(method, value, log_theta[index], log_teacher[index])
        return alpha

    # ------------------------------------------------------------ theta
    def _theta_rows(self, requests: Sequence[LiveRequest]) -> tuple[np.ndarray, dict[str, str], float]:
        """One batch per replica out, every row back (or an error per missing request), and the
        seconds of that spent in transport (to theta, and back from theta's engine core)."""
        known = self._known
        got, errors, transport = self._collect([r for r in requests if r.request_id not in known])
        for request in requests:
            if request.request_id in got:
                request.state.last_row = got[request.request_id]
        got.update(known)
        if errors:
            logger.error("mixing step %d: %s", self.step, "; ".join(sorted(set(errors.values()))))
        vocab = next((len(r) for r in got.values()), None) or self._vocab()
        return np.stack([got.get(r.request_id, np.zeros(vocab, np.float32)) for r in requests]), errors, transport

    def _send_batches(self, requests: Sequence[LiveRequest]) -> dict[str, np.ndarray]:
        """Send each replica its batch; the rows already known (no token since theta's last
        row, e.g. a step of the teacher's chunked prefill) instead of asking again."""
        batches: dict[int, list[ScoreItem]] = {}
        known: dict[str, np.ndarray] = {}
        for request in requests:
            state: MixState = request.state
            output = request.output_token_ids
            first = state.sent == 0 and state.last_row is None
            if not first and len(output) == state.sent and state.last_row is not None:
                known[request.request_id] = state.last_row
                continue
            item = ScoreItem(request.request_id, list(output[state.sent:]),
                             state.theta_prompt if first else None, state.theta_messages if first else None)
            state.sent = len(output)
            batches.setdefault(state.replica, []).append(item)
        for replica, items in batches.items():
            self._send(replica, ScoreBatch(self.step, self.reply, items, time.time(), replica))
        return known

    def _send(self, replica: int, message: Any) -> None:
        """Never blocks: a replica whose queue is full (gone for a long time) is not answering."""
        try:
            self._thetas[replica].send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self._unresponsive.add(replica)

    def _collect(self, requests: Sequence[LiveRequest]) -> tuple[dict[str, np.ndarray], dict[str, str], float]:
        """This step's rows until all came or the timeout passed. A replica that missed a step is
        not waited for again until it answers (late answers still count): a dead theta costs
        one timeout, not one per step."""
        replica_of = {r.request_id: r.state.replica for r in requests}
        errors = {rid: f"theta replica {rep} missed an earlier step (not answering)"
                  for rid, rep in replica_of.items() if rep in self._unresponsive}
        got: dict[str, np.ndarray] = {}
        passes: dict[int, int] = {}  # row messages (theta forward passes) per replica
        transport = 0.0
        deadline = time.monotonic() + self.timeout_ms / 1000
        while missing := set(replica_of) - got.keys() - errors.keys():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._pull.poll(left_ms):
                for rid in missing:
                    errors[rid] = f"no row from theta replica {replica_of[rid]} within {self.timeout_ms / 1000:g} s"
                    self._unresponsive.add(replica_of[rid])
                break
            header, rows = read_rows(self._pull.recv_multipart(copy=False))
            self._unresponsive.discard(header.replica)
            self._theta_prompts.update(header.prompts)
            if header.step != self.step:
                continue  # a late answer to a step that already gave up on it
            got.update(zip(header.request_ids, rows))
            errors.update(header.errors)
            if header.request_ids:
                transport = max(transport, header.outbound_s + max(0.0, time.time() - header.sent_at))
                passes[header.replica] = passes.get(header.replica, 0) + 1
        for request in requests:
            if passes.get(request.state.replica, 0) > 1:
                request.state.theta_split_steps += 1
        return got, errors, transport

    def _vocab(self) -> int:
        return int(self.vllm_config.model_config.get_vocab_size())

    def _record(self, requests: Sequence[LiveRequest], log_theta: torch.Tensor, log_teacher: torch.Tensor,
                alpha: torch.Tensor, log_q: torch.Tensor) -> None:
        self.record.mkdir(parents=True, exist_ok=True)
        for i, request in enumerate(requests):
            if not request.state.record:
                continue
            path = self.record / f"{request.request_id}.step{len(request.output_token_ids)}.npz"
            np.savez(path, log_theta=log_theta[i].cpu().numpy(), log_teacher=log_teacher[i].cpu().numpy(),
                     alpha=float(alpha[i]), log_q=log_q[i].cpu().numpy())

    def __del__(self) -> None:
        try:
            self._pull.close(0)
            self._pushes.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
