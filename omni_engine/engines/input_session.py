"""A vLLM request whose input comes in parts: a talker that starts on the thinker's first states.

vLLM's streaming input (``AsyncLLM.generate`` over an async generator of ``StreamingInput``) runs a
request one chunk at a time: a chunk generates up to its ``max_tokens``, then the request waits,
its KV cache kept, for the next chunk, whose prompt tokens are appended after what it made. vLLM
drops the last token a chunk sampled (it was never forwarded), so the next chunk's prompt is that
token given back: the request's tokens, its positions and (with a seed) its sampler's draws are
then exactly those of one uninterrupted request.

How far a request may run is its adapter's to say (``allowed``: tokens it may have made by now,
None: up to its ``max_tokens``): a talker may make a frame only once the thinker's token for that
frame is known. A chunk is yielded only when the previous one has run out and the allowance has
grown, so a talker that keeps up with its thinker costs one chunk per thinker token, and one that
falls behind takes everything known in one chunk. The session ends on the stop token or the request's
``max_tokens``; vLLM then ends the stream with no final output of its own, so the engine makes the
output it ended on the final one (``ended_output``): a consumer then knows its tokens are the last
(a token-less final after a partial left code2wav's edge cutting the last codes into a piece of
their own). ``final_output`` stays for a stream vLLM ends without the session seeing an end.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from vllm.engine.protocol import StreamingInput
from vllm.sampling_params import RequestOutputKind


class InputSession:
    """One request fed in parts: what it may make, what it has made, and its chunks for vLLM."""

    def __init__(self, stage_id: int, request_id: str, lead: Any = None) -> None:
        self.where = f"stage {stage_id}: request {request_id!r}"
        self.lead = lead  # the stage's LeadLimit, if any (lead_limit.py): when a chunk may start, how long
        self.first_at: float | None = None  # when its first token came (the lead limit's clock)
        self.allowed: int | None = 0
        self.prepare: Callable[[], None] | None = None  # called before each chunk (the adapter writes its inputs)
        self.pending: list[tuple[Any, bool]] = []  # parts that came before the first was taken
        self.made = 0  # tokens generated so far, over every chunk
        self.last_token: int | None = None
        self.finish_reason: str | None = None  # set once the request has ended
        self._granted = 0  # tokens the chunks yielded so far allow
        self._changed = asyncio.Event()

    def allow(self, allowed: int | None) -> None:
        """The adapter's new allowance (it only grows; None: no bound but ``max_tokens``)."""
        self.allowed = allowed
        self._changed.set()

    def chunks(self, prompt: Any, params: Any) -> tuple[AsyncGenerator[StreamingInput, None], Any]:
        """vLLM's input stream for the request, and the params it runs under: deltas (a chunk's
        cumulative outputs would start again at each chunk); the outputs go back as the caller
        asked (``as_asked``)."""
        self.asked = params.output_kind
        self.tokens: list[int] = []
        self.max_tokens = int(params.max_tokens or 1 << 30)
        self.min_tokens = int(params.min_tokens or 0)
        self.stop_ids = frozenset(params.stop_token_ids or ())
        params = copy.copy(params)
        params.output_kind = RequestOutputKind.DELTA
        return self._chunks(prompt, params), params

    def _limit(self) -> int:
        return self.max_tokens if self.allowed is None else min(self.allowed, self.max_tokens)

    async def _chunks(self, prompt: Any, params: Any) -> AsyncGenerator[StreamingInput, None]:
        while self.finish_reason is None:
            while not self.finish_reason and not (self.made == self._granted and self._limit() > self._granted):
                self._changed.clear()
                await self._changed.wait()
            if self.finish_reason:
                return
            if self.lead is not None:
                await self.lead.admit(self)
                if self.finish_reason:
                    return
            more = (self._limit() if self.lead is None else self.lead.chunk(self, self._limit())) - self._granted
            if self.prepare is not None:
                self.prepare()
            chunk = copy.copy(params)
            chunk.max_tokens = more
            # vLLM counts a chunk's tokens from its start: the request's min_tokens, less those made
            chunk.min_tokens = min(max(self.min_tokens - self._granted, 0), more)
            yield StreamingInput(prompt if self._granted == 0 else {"prompt_token_ids": [self.last_token]}, chunk)
            self._granted += more

    def observe(self, token_ids: Sequence[int], finish_reason: str | None) -> None:
        """An output's new tokens; ``finish_reason``: its chunk ended (vLLM's "length" at the chunk's
        bound, "stop" at a stop token; any other, or a chunk cut short, ends the request)."""
        before = self.made
        if token_ids:
            self.made += len(token_ids)
            self.last_token = int(token_ids[-1])
            self.tokens.extend(token_ids)
        if finish_reason is None:
            if self.lead is not None:
                self.lead.observed(self, before)
            return
        if finish_reason == "stop" or (self.last_token in self.stop_ids):
            self.finish_reason = "stop"
        elif self.made >= self.max_tokens:
            self.finish_reason = "length"
        elif finish_reason != "length" or self.made < self._granted:
            self.finish_reason = finish_reason  # (the model's length bound, an error): it ends here
        if self.lead is not None:
            self.lead.observed(self, before)
        self._changed.set()

    def as_asked(self, output: Any) -> Any | None:
        """A delta output of vLLM's as the caller's ``output_kind`` has it (None: not sent)."""
        if self.asked is RequestOutputKind.DELTA:
            return output
        if self.asked is RequestOutputKind.FINAL_ONLY and not output.finished:
            return None
        output.outputs = [copy.copy(c) for c in output.outputs]
        for completion in output.outputs:
            completion.token_ids = list(self.tokens)
            completion.logprobs = None  # (a chunk's; the whole request's are not kept)
        return output

    def ended_output(self, output: Any) -> Any:
        """vLLM's output on which the request ended (``finish_reason`` set by ``observe``) as its
        final one: finished, its tokens kept, the session's finish reason."""
        final = copy.copy(output)
        final.finished = True
        final.outputs = [copy.copy(c) for c in output.outputs]
        for completion in final.outputs:
            completion.finish_reason = self.finish_reason
        return final

    def final_output(self, last: Any) -> Any:
        """vLLM's last output of the request as its final one: finished, no new tokens, the
        session's finish reason."""
        final = copy.copy(last)
        final.finished = True
        final.outputs = [copy.copy(c) for c in last.outputs]
        for completion in final.outputs:
            completion.token_ids = []
            completion.logprobs = None
            completion.finish_reason = self.finish_reason or "stop"
            completion.text = ""
        return self.as_asked(final)
