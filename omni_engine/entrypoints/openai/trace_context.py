"""Every route continues its caller's trace: the W3C headers of the request being served.

vLLM's routes hand ``trace_headers`` to the engine client themselves; ours (speech, chat
with audio, transcription, images, the realtime WebSocket) get them from this middleware,
which puts the request's ``traceparent``/``tracestate`` into
``omni_engine.tracing.context.REQUEST_TRACE_HEADERS`` for the route's context. A request
without them (or a server that does not trace) costs one scan of its headers.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from omni_engine.entrypoints.openai.routing import add_middleware_first
from omni_engine.tracing.context import REQUEST_TRACE_HEADERS, trace_headers_of


class TraceContextMiddleware:
    """Sets ``REQUEST_TRACE_HEADERS`` for HTTP requests and WebSockets that carry trace headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = trace_headers_of(scope.get("headers", ())) if scope["type"] in ("http", "websocket") else None
        if headers is None:
            await self.app(scope, receive, send)
            return
        token = REQUEST_TRACE_HEADERS.set(headers)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_TRACE_HEADERS.reset(token)


def add_trace_context(app: Starlette) -> Starlette:
    """Install ``TraceContextMiddleware`` on the app vLLM built."""
    return add_middleware_first(app, TraceContextMiddleware)
