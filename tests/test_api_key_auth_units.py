"""``--api-key`` on every route (``omni_engine/entrypoints/openai/auth.py``) as plain ASGI calls:
which requests pass, which get a 401, and the swap of vLLM's middleware (the mutation run's
selection for that module; docs/mutation.md). No server: tests/test_serve_audio.py has the served one."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from omni_engine.entrypoints.openai.auth import (
    OPEN_PATHS,
    ApiKeyMiddleware,
    guard_every_route,
)

KEY = "s3cret"


async def call(path: str, *, key: str | None = None, method: str = "GET", kind: str = "http",
               root_path: str | None = None) -> int:
    """The status the guarded app answers with (200: the app behind the guard was reached, with the
    request's own scope and receive; a 401 carries vLLM's error body)."""
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def app(got_scope, got_receive, got_send):
        assert got_scope is scope and got_receive is receive
        await got_send({"type": "http.response.start", "status": 200, "headers": []})
        await got_send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict[str, Any]] = []

    async def send(message):
        sent.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    scope: dict[str, Any] = {"type": kind, "path": path, "method": method, "headers": headers}
    if root_path is not None:
        scope["root_path"] = root_path
    await ApiKeyMiddleware(app, tokens=[KEY])(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"].endswith("http.response.start"))
    if status == 401:
        body = b"".join(m.get("body", b"") for m in sent if m["type"].endswith("http.response.body"))
        assert json.loads(body) == {"error": "Unauthorized"}
    return status


@pytest.mark.parametrize("path", ["/tokenize", "/invocations", "/v1/chat/completions", "/load", "/", "/metricsx", "/healthX"])
async def test_every_route_but_the_open_ones_needs_the_key(path):
    assert await call(path) == 401
    assert await call(path, key="wrong") == 401
    assert await call(path, key=KEY) == 200


@pytest.mark.parametrize("path", [*sorted(OPEN_PATHS), "/health/", "/metrics/extra"])
async def test_probes_and_metrics_stay_open(path):
    assert await call(path) == 200


async def test_a_websocket_needs_the_key_too():
    assert await call("/v1/realtime", kind="websocket") == 401
    assert await call("/v1/realtime", kind="websocket", key=KEY) == 200


async def test_cors_preflights_and_other_scopes_pass():
    assert await call("/v1/chat/completions", method="OPTIONS") == 200
    assert await call("/v1/chat/completions", kind="lifespan") == 200


async def test_the_root_path_is_not_part_of_the_route():
    assert await call("/api/health", root_path="/api") == 200
    assert await call("/api/v1/models", root_path="/api") == 401
    assert await call("/api/v1/models", root_path="/api", key=KEY) == 200


def test_guard_every_route_replaces_vllms_middleware_and_rebuilds_a_built_stack():
    app = Starlette(middleware=[Middleware(GZipMiddleware), Middleware(AuthenticationMiddleware, tokens=[KEY]),
                                Middleware(AuthenticationMiddleware, ["other"])])
    app.middleware_stack = app.build_middleware_stack()
    assert guard_every_route(app) == 2
    assert [m.cls for m in app.user_middleware] == [GZipMiddleware, ApiKeyMiddleware, ApiKeyMiddleware]
    assert app.user_middleware[1].kwargs == {"tokens": [KEY]} and app.user_middleware[2].args == (["other"],)
    built, classes = app.middleware_stack, []
    while built is not None:
        classes.append(type(built))
        built = getattr(built, "app", None)
    assert ApiKeyMiddleware in classes and AuthenticationMiddleware not in classes


def test_guard_every_route_leaves_an_app_without_a_key_alone():
    app = Starlette(middleware=[Middleware(GZipMiddleware)])
    assert guard_every_route(app) == 0
    assert app.middleware_stack is None  # nothing built that was not built
    built = app.middleware_stack = app.build_middleware_stack()
    assert guard_every_route(app) == 0
    assert app.middleware_stack is built  # nor rebuilt
