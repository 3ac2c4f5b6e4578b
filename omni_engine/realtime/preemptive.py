"""Preemptive answers: the LLM starts on a user turn before the VAD has confirmed that it ended.

With server VAD a turn ends after ``silence_duration_ms`` of silence (500 ms by default). The
session already transcribes the turn during that wait; once that early transcript is in, the
answer to it is started too, into a buffer, with nothing sent. When the VAD then ends the turn
and the response it creates asks the engine for exactly the same thing (same messages, voice and
limits), the response reads the buffered stream instead of starting a request: its events go out
as they would have, only sooner. Anything else (speech resuming, a request that differs because
the session changed meanwhile, the connection closing) aborts the preemptive request on every
stage. LiveKit Agents' ``preemptive_generation`` makes the same trade: a little wasted compute
on pauses that were not the end of the turn, for the LLM's first sentence hidden in the silence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from omni_engine.realtime.engine import RealtimeEngine, ResponsePiece
from omni_engine.tracing.context import traced

_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class PreemptiveAnswer:
    """``engine.respond(**request)`` running ahead into a buffer, until adopted or cancelled."""

    def __init__(self, engine: RealtimeEngine, request: dict[str, Any], request_id: str,
                 trace_headers: dict[str, str] | None = None) -> None:
        """``trace_headers``: the trace context of the turn it answers (its request's spans go there)."""
        self.request = request
        self._pieces = engine.respond(**request, request_id=request_id)
        self._buffer: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.ensure_future(traced(trace_headers, self._pump()))
        self.adopted = False

    async def _pump(self) -> None:
        try:
            async for piece in self._pieces:
                self._buffer.put_nowait(piece)
            self._buffer.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the response that adopts it
            self._buffer.put_nowait(_Failed(exc))
        finally:
            await self._pieces.aclose()  # leaving the engine's generator aborts its request

    def adopt(self, request: dict[str, Any]) -> AsyncGenerator[ResponsePiece, None] | None:
        """The answer's stream if it was asked for ``request``; else None (and it is cancelled)."""
        if self.adopted or request != self.request:
            self.cancel()
            return None
        self.adopted = True
        return self._stream()

    async def _stream(self) -> AsyncGenerator[ResponsePiece, None]:
        """The buffered pieces, then the live ones; closing it early aborts the request."""
        try:
            while (piece := await self._buffer.get()) is not _END:
                if isinstance(piece, _Failed):
                    raise piece.exc
                yield piece
        finally:
            await self.aclose()

    def cancel(self) -> None:
        """Abort the request (the task's cancellation closes the engine's generator)."""
        self._task.cancel()

    async def aclose(self) -> None:
        """``cancel`` and wait until the engine's generator is closed."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
