"""``--api-key`` on every route, not only vLLM's guarded prefixes.

vLLM 0.32's ``AuthenticationMiddleware`` checks the key only under ``/v1``,
``/v2``, ``/inference`` and ``/cohere``; ``/tokenize``, ``/invocations``
(the same inference as ``/v1``), ``/load`` ... stay open, as its own docs
warn. In front of a pipeline every route that reaches the model requires the
key. Left open, as vLLM leaves them: the probes a supervisor polls
(``/health``, ``/ping``), ``/metrics`` for scrapers, and ``/version``;
CORS preflights (``OPTIONS``) pass as in vLLM.
"""

from __future__ import annotations

from collections.abc import Awaitable

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


class ApiKeyMiddleware(AuthenticationMiddleware):
    """vLLM's bearer-token check (same token hashing and comparison), on every route but ``OPEN_PATHS``."""

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if path not in OPEN_PATHS and not path.startswith("/metrics/") and not self.verify_token(Headers(scope=scope)):
            return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)


def guard_every_route(app: Starlette) -> int:
    """Replace vLLM's ``AuthenticationMiddleware`` of ``app`` by ours; returns how many were replaced."""
    middleware = app.user_middleware
    replaced = 0
    for i, entry in enumerate(middleware):
        if entry.cls is AuthenticationMiddleware:
            middleware[i] = Middleware(ApiKeyMiddleware, *entry.args, **entry.kwargs)
            replaced += 1
    # vLLM's build_app returns the app with its middleware stack already built from the old list.
    if replaced and app.middleware_stack is not None:
        app.middleware_stack = app.build_middleware_stack()
    return replaced
