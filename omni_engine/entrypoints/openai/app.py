"""What ``omni-engine serve`` adds to the app vLLM's server builds.

vLLM (0.32) has no hook for extra routes or middleware: ``build_and_serve``
builds its app with the module-level function ``VLLM_BUILD_APP``, which is
therefore wrapped where it is looked up. The wrapper registers every route family
(``add_omni_routes``: one module each, built on ``served_pipeline``), replaces
vLLM's ``/abort_requests`` where it has one (``rl_routes``), when an API key is
set swaps vLLM's authentication middleware for one guarding every route
(``auth``), tags completions with the weight version that made them
(``weight_versions``), hands every route its caller's trace context (``trace_context``), and
makes the text stage's ``default_sampling_params`` the defaults of vLLM's handlers once they
exist (``served_defaults``).

This is the one module that imports the route families; none of them imports
another.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from omni_engine.entrypoints.openai import (
    chat_audio,
    completions,
    images,
    realtime,
    speech,
    speech_stream,
    transcription,
)
from omni_engine.entrypoints.openai.auth import guard_every_route
from omni_engine.entrypoints.openai.rl_routes import replace_abort_requests_route
from omni_engine.entrypoints.openai.routing import include_router_first
from omni_engine.entrypoints.openai.served_defaults import apply_on_startup
from omni_engine.entrypoints.openai.trace_context import add_trace_context
from omni_engine.entrypoints.openai.weight_versions import add_weight_versions

VLLM_BUILD_APP = "vllm.entrypoints.launchers.api_server.entry.build_app"

# The route families whose routers go ahead of vLLM's: chat_audio shadows ``POST /v1/chat/completions``
# (it hands every request without audio to vLLM's handler), completions ``POST /v1/completions`` (it
# hands every request to vLLM's handler unless a stage refuses the route), realtime vLLM's
# transcription-only ``/v1/realtime`` WebSocket. Each family goes ahead of those before it, so the
# app lists them last first (the order the serving tests check).
ROUTE_FAMILIES = (chat_audio, completions, speech, images, transcription, realtime, speech_stream)


def add_omni_routes(app: FastAPI) -> FastAPI:
    """Every route family's routes on ``app``, ahead of vLLM's (a path both have is ours)."""
    for family in ROUTE_FAMILIES:
        app = include_router_first(app, family.router)
    return app


class _OmniBuildApp:
    """vLLM's ``build_app``, then our routes and our API-key guard on the app it built."""

    def __init__(self, build_app: Callable[..., FastAPI]) -> None:
        self.wrapped = build_app

    def __call__(self, *args: Any, **kwargs: Any) -> FastAPI:
        app = add_omni_routes(self.wrapped(*args, **kwargs))
        replace_abort_requests_route(app)
        guard_every_route(app)
        return apply_on_startup(add_trace_context(add_weight_versions(app)))


def install_app_extensions() -> None:
    """Make vLLM's ``build_and_serve`` build its app through ``_OmniBuildApp`` (idempotent).

    The one place that reaches into vLLM's server. A vLLM whose
    ``build_and_serve`` no longer builds through ``VLLM_BUILD_APP`` fails here,
    naming the function, instead of serving without our routes or the key.
    """
    module_name, _, name = VLLM_BUILD_APP.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RuntimeError(f"cannot extend vLLM's server: {module_name} does not import ({exc}); "
                           f"this vLLM moved {VLLM_BUILD_APP}") from exc
    build_app = getattr(module, name, None)
    serve = getattr(module, "build_and_serve", None)
    if not callable(build_app) or serve is None or name not in serve.__code__.co_names:
        raise RuntimeError(f"cannot extend vLLM's server: this vLLM has no {VLLM_BUILD_APP} that "
                           f"{module_name}.build_and_serve builds its app with (vLLM moved it; "
                           "omni_engine.entrypoints.openai.app.install_app_extensions must follow)")
    if not isinstance(build_app, _OmniBuildApp):
        setattr(module, name, _OmniBuildApp(build_app))
