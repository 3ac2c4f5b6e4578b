"""Adding routes and middleware to the app vLLM built, ahead of its own."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware


def include_router_first(app: FastAPI, router: APIRouter) -> FastAPI:
    """Include ``router`` so its routes match before vLLM's (a shared path is ours)."""
    before = list(app.router.routes)
    app.include_router(router)
    ours = [r for r in app.router.routes if r not in before]
    app.router.routes[:] = ours + before
    app.openapi_schema = None
    return app


def add_middleware_first(app: Starlette, middleware_class: Any) -> Starlette:
    """Install ``middleware_class`` outermost on the app vLLM built (its stack is built already)."""
    app.user_middleware.insert(0, Middleware(middleware_class))
    if app.middleware_stack is not None:
        app.middleware_stack = app.build_middleware_stack()
    return app
