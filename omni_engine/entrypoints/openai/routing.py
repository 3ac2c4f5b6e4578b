"""Adding routes to the app vLLM built, ahead of its own."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI


def include_router_first(app: FastAPI, router: APIRouter) -> FastAPI:
    """Include ``router`` so its routes match before vLLM's (a shared path is ours)."""
    before = list(app.router.routes)
    app.include_router(router)
    ours = [r for r in app.router.routes if r not in before]
    app.router.routes[:] = ours + before
    app.openapi_schema = None
    return app
