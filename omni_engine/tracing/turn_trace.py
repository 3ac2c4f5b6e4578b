"""One turn of a realtime session as a span: ``TurnTrace``.

A turn runs from the user starting to speak (or a commit, or ``response.create``) to the end of
the answer. Its events are the moments a voice product is judged by: ``speech_started``,
``vad_stop`` (the server's VAD ends the user's turn), ``transcript_ready``, ``first_word`` (the
answer's first text), ``first_audio`` and ``barge_in`` (the user spoke over the answer). The
pipeline requests the turn makes (its transcription, its answer) are children of the turn's span:
the session hands them the turn's ``headers``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import Status, StatusCode

from omni_engine.tracing.propagation import headers_of, parent_context

TURN_SPAN = "realtime_turn"


class TurnTrace:
    """The span of one turn (see the module docstring); each event is recorded once, the first time."""

    def __init__(self, tracer: Any, item_id: str | None, parent_headers: Mapping[str, str] | None) -> None:
        self.span = tracer.start_span(TURN_SPAN, context=parent_context(parent_headers), start_time=time.time_ns(),
                                      attributes={"omni.realtime.item_id": item_id or ""})
        self.headers = headers_of(self.span)
        self._seen: set[str] = set()
        self.ended = False

    def event(self, name: str) -> None:
        if name not in self._seen and not self.ended:
            self._seen.add(name)
            self.span.add_event(name, timestamp=time.time_ns())

    def set(self, key: str, value: Any) -> None:
        if not self.ended:
            self.span.set_attribute(f"omni.realtime.{key}", value)

    def end(self, status: str) -> None:
        """The answer ended with the response ``status`` (completed, cancelled, failed, incomplete)."""
        if self.ended:
            return
        self.ended = True
        self.span.set_attribute("omni.realtime.status", status)
        if status == "failed":
            self.span.set_status(Status(StatusCode.ERROR, "response failed"))
        self.span.end(end_time=time.time_ns())
