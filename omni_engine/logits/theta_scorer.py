"""The theta stage's side of two-model mixing: one vLLM streaming-input session per request.

Each teacher step brings one ``ScoreBatch`` per theta replica. A request's first item
opens a session on theta's ``AsyncLLM`` with its theta prompt (tokenized with theta's
own template) plus the tokens so far; every later step appends only the tokens the
teacher generated since. vLLM keeps a session's KV cache between chunks and discards the
one token each chunk samples, so a step costs theta the new tokens alone, as a decode
step would, however long the sequence. ``ThetaCaptureProcessor`` (theta.py) sends each
chunk's row to the teacher.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from omni_engine.logits.messages import (
    CAPTURE_KEY,
    TO_THETA,
    PushSockets,
    ReleaseRequests,
    ScoreBatch,
    ScoreItem,
    rows_frames,
)

logger = logging.getLogger(__name__)


# The longest theta's scheduler stays paused for a batch whose chunks never all reached its
# engine core (a session that failed between being given its chunk and sending it). Each
# chunk normally releases its batch's hold at once; this bounds what a lost one costs.
HOLD_LIMIT_S = 0.5


class _BatchHold:
    """Theta's scheduler, paused for one batch: resumed once every chunk of the batch is in
    the engine core's input socket (or the limit passed). Releases past the count are no-ops."""

    def __init__(self, resume: Callable[[], None], chunks: int, live: set[_BatchHold]) -> None:
        self._resume: Callable[[], None] | None = resume
        self._left, self._live = chunks, live
        self._timer = asyncio.get_running_loop().call_later(HOLD_LIMIT_S, self._finish)
        live.add(self)

    def release(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._finish()

    def _finish(self) -> None:
        if self._resume is not None:
            resume = self._resume
            self.cancel()
            resume()

    def cancel(self) -> None:
        """Forget the resume (the engine is going)."""
        self._timer.cancel()
        self._resume = None
        self._live.discard(self)


@dataclass
class _Session:
    """A request's open vLLM session: its chunks go in through ``inputs``, each with the hold
    of its batch (or None)."""

    engine_id: str
    tokens: list[int]
    inputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    batch: ScoreBatch | None = None  # the step its latest chunk answers (for errors)

    async def stream(self) -> AsyncIterator[Any]:
        while (item := await self.inputs.get()) is not None:
            chunk, hold = item
            try:
                yield chunk
            finally:
                # vLLM asks for the next chunk only once it has sent this one to the engine
                # core (its input task awaits the send), or closes the stream on an error.
                if hold is not None:
                    hold.release()

    def drop_inputs(self) -> None:
        """Release the holds of chunks that will never be sent (the session has ended)."""
        while not self.inputs.empty():
            if (item := self.inputs.get_nowait()) is not None and item[1] is not None:
                item[1].release()


class ThetaScorer:
    """Serves teachers' score batches from theta's ``AsyncLLM`` (runs on the stage's loop)."""

    def __init__(self, engine: Any, address: str, chat_template: bool) -> None:
        self.engine, self.address, self.chat_template = engine, address, chat_template
        self.sessions: dict[str, _Session] = {}
        self._opened = 0
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(address)
        # Plain sockets, sent with NOBLOCK: a teacher that is gone must not hold theta up.
        self._pushes = PushSockets()
        self._tokenizer: Any = None
        self._task: asyncio.Task | None = None
        self._utility_calls: set[asyncio.Task] = set()
        self._holds: set[_BatchHold] = set()  # batches whose resume has not gone yet

    @property
    def tokens(self) -> dict[str, list[int]]:
        """Each live request's sequence as theta has it (prompt + tokens so far)."""
        return {rid: session.tokens for rid, session in self.sessions.items()}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="theta-scorer")

    async def _serve(self) -> None:
        tokenizer = self.engine.get_tokenizer()
        self._tokenizer = await tokenizer if asyncio.iscoroutine(tokenizer) else tokenizer
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
                    self._close(rid)
            else:
                self._score_batch(message)

    # ------------------------------------------------------------ sessions
    def _score_batch(self, batch: ScoreBatch) -> None:
        from vllm import SamplingParams
        from vllm.engine.protocol import StreamingInput

        outbound = max(0.0, time.time() - batch.sent_at) if batch.sent_at else 0.0
        errors: dict[str, str] = {}
        prompts: dict[str, list[int]] = {}
        hold = None
        if len(batch.items) > 1:
            # Before any session of this batch opens: a new session's task sends its first chunk.
            self._engine_utility("pause_scheduler", "keep", False)
            hold = _BatchHold(lambda: self._engine_utility("resume_scheduler"), len(batch.items), self._holds)
        for item in batch.items:
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={
                CAPTURE_KEY: [batch.reply, batch.step, item.request_id, outbound, batch.replica]})
            try:
                session, chunk = self._session_for(item, prompts)
            except Exception as exc:  # noqa: BLE001 - reported to the teacher, per request
                errors[item.request_id] = f"theta could not take request {item.request_id!r}: {exc}"
                if hold is not None:
                    hold.release()  # no chunk to wait for
                continue
            session.tokens.extend(item.new_tokens)
            session.batch = batch
            session.inputs.put_nowait((StreamingInput({"prompt_token_ids": chunk}, params), hold))
        if errors or prompts:
            self._send(batch, errors, prompts)

    def _engine_utility(self, method: str, *args: Any) -> None:
        """Call an engine core utility, in order with the sessions' chunks.

        The chunks of one batch reach theta's engine core one by one, as each session's
        input task processes its own; an idle engine core steps as soon as the first
        arrives, so a batch of 8 ran as two or more forward passes. Pausing the scheduler
        (``keep``: nothing is dropped) before the chunks and resuming after them makes the
        batch one forward pass. The calls are tasks on the loop, sent on the same socket as
        the chunks: the pause is created before the chunks are queued, the resume once each
        session's stream has been asked for its next chunk (vLLM asks after sending the
        last), so the engine core receives pause, chunks, resume in that order and nothing
        here waits for a round trip. A session that fails before sending its chunk releases
        its hold when it ends, and ``HOLD_LIMIT_S`` bounds the rest: the resume always goes."""
        task = asyncio.get_running_loop().create_task(self.engine.engine_core.call_utility_async(method, *args))
        self._utility_calls.add(task)
        task.add_done_callback(self._utility_done)

    def _utility_done(self, task: asyncio.Task) -> None:
        self._utility_calls.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("theta scorer %s: engine utility failed: %s", self.address, task.exception())

    def _session_for(self, item: ScoreItem, prompts: dict[str, list[int]]) -> tuple[_Session, list[int]]:
        """The request's session and this step's chunk; a prompt (re)opens the session."""
        if item.theta_prompt is None and item.theta_messages is None:
            session = self.sessions.get(item.request_id)
            if session is None:
                raise ValueError("no theta prompt was sent with its first step")
            return session, list(item.new_tokens)
        self._close(item.request_id)
        prompt = self._encode_prompt(item)
        prompts[item.request_id] = prompt
        self._opened += 1
        session = _Session(f"theta-{item.request_id}-{self._opened}", list(prompt))
        session.task = asyncio.get_running_loop().create_task(self._run(item.request_id, session))
        self.sessions[item.request_id] = session
        return session, prompt + list(item.new_tokens)

    async def _run(self, rid: str, session: _Session) -> None:
        from vllm import SamplingParams

        base = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            async for _ in self.engine.generate(session.stream(), base, session.engine_id):
                pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the teacher for the step it failed
            if session.batch is not None:
                self._send(session.batch, {rid: f"theta failed to score request {rid!r}: {type(exc).__name__}: {exc}"})
        finally:
            session.drop_inputs()
            if self.sessions.get(rid) is session:
                del self.sessions[rid]

    def _close(self, rid: str) -> None:
        session = self.sessions.pop(rid, None)
        if session is not None:
            session.inputs.put_nowait(None)  # vLLM ends the session and frees its KV cache

    def _encode_prompt(self, item: ScoreItem) -> list[int]:
        if item.theta_messages is not None:
            messages = json.loads(item.theta_messages)
        elif self.chat_template:
            messages = [{"role": "user", "content": item.theta_prompt}]
        else:
            return list(self._tokenizer.encode(item.theta_prompt))
        return list(self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))

    def _send(self, batch: ScoreBatch, errors: dict[str, str], prompts: dict[str, list[int]] | None = None) -> None:
        """Errors and opened prompts, to the teacher that sent ``batch`` (rows come from the engine core)."""
        try:
            self._pushes.get(batch.reply).send_multipart(rows_frames(batch.step, [], np.zeros((0, 0), np.float32), errors, prompts,
                                            replica=batch.replica), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("theta scorer: teacher %s is not reading; dropped %s", batch.reply, errors or prompts)

    async def close(self) -> None:
        for rid in list(self.sessions):
            self._close(rid)
        for hold in list(self._holds):
            hold.cancel()
        for call in list(self._utility_calls):  # the engine is going: no answer will come
            call.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pull.close(0)
        self._pushes.close()
