"""The caller's W3C trace context, from an HTTP request to ``MultiStageEngineClient.generate``.

vLLM's own routes hand ``trace_headers`` to ``generate``; ours (speech, chat with audio,
transcription, images, realtime) need not each do so: the server's middleware puts the
headers of the request it serves into ``REQUEST_TRACE_HEADERS`` (a ``ContextVar``: every
route runs in the context of its request), where ``generate`` finds them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")

# The W3C Trace Context headers (what vLLM's server extracts too).
TRACE_HEADERS = ("traceparent", "tracestate")

REQUEST_TRACE_HEADERS: ContextVar[Mapping[str, str] | None] = ContextVar("omni_request_trace_headers", default=None)


def trace_headers_of(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The trace headers among an ASGI scope's raw ``headers``; None when it has none."""
    found = {}
    for name, value in headers:
        key = name.decode("latin-1").lower()
        if key in TRACE_HEADERS:
            found[key] = value.decode("latin-1")
    return found or None


async def traced(headers: Mapping[str, str] | None, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` with ``headers`` as the trace context of the requests it makes. For the
    body of a task of its own: a task runs in a copy of the context, so the setting stays in it."""
    if headers:
        REQUEST_TRACE_HEADERS.set(headers)
    return await awaitable
