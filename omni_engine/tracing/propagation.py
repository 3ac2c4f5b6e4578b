"""W3C trace context in and out of spans: the caller's headers as a parent, a span as headers.

Shared by the request spans (``request_trace``) and the realtime turn spans (``turn_trace``):
both continue a context they were given and hand their own on (to a stage, to a turn's requests).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def parent_context(headers: Mapping[str, str] | None) -> Any:
    """The context ``traceparent``/``tracestate`` name (None without headers: a new trace)."""
    return _PROPAGATOR.extract(dict(headers)) if headers else None


def headers_of(span: Any) -> dict[str, str]:
    """The W3C headers that make ``span`` the parent of what receives them."""
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
    return headers
