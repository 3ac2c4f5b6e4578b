"""The text stage's ``default_sampling_params`` as the defaults of the requests vLLM's routes serve.

vLLM fills the sampling fields a request leaves unset from its handlers' ``default_sampling_params``
(the model's ``generation_config.json`` and ``--override-generation-config``, read once when the
handlers are built). A pipeline says its defaults in the text stage's config instead
(``default_sampling_params: {max_tokens: 128, temperature: 0.0}``), so those go into the same
dicts once vLLM has built its handlers (``apply_on_startup``, before the server takes a request):
a request's own value always wins, then ``--override-generation-config``'s, then the stage's, then
the model's ``generation_config.json``, then OpenAI's.

``stop`` is the one field vLLM's handlers never take from their defaults; the engine client fills
it (``fill_client_defaults``) where a request's params name no stop string.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

# The fields vLLM 0.32's request models read from a handler's ``default_sampling_params`` when a
# request leaves them unset (``to_sampling_params``'s ``_DEFAULT_SAMPLING_PARAMS``, ``get_max_tokens``'s
# fallback, ``stop_token_ids`` merged with the request's).
HANDLER_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_p",
                  "top_k", "min_p", "max_tokens", "stop_token_ids")
# The app-state names of vLLM's handlers that build sampling params from a request.
HANDLERS = ("openai_serving_chat", "openai_serving_chat_batch", "openai_serving_completion",
            "openai_serving_responses", "anthropic_serving_messages", "serving_tokens", "serving_render")


def handler_defaults(stage_defaults: Mapping[str, Any], overridden: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The part of a stage's defaults that vLLM's handlers apply themselves, less the fields
    ``overridden`` (an ``--override-generation-config`` on the command line, which is more
    specific than the pipeline's config) names."""
    taken = {"max_tokens" if name == "max_new_tokens" else name for name in overridden or {}}
    return {name: stage_defaults[name] for name in HANDLER_FIELDS
            if stage_defaults.get(name) is not None and name not in taken}


def apply_to_handlers(state: Any, defaults: Mapping[str, Any]) -> list[str]:
    """Put ``defaults`` into every handler's ``default_sampling_params`` on ``state`` (over the
    model's generation config); the names of the handlers changed."""
    changed = []
    for name in HANDLERS:
        handler = getattr(state, name, None)
        if handler is None or not isinstance(getattr(handler, "default_sampling_params", None), dict):
            continue
        handler.default_sampling_params.update(defaults)
        changed.append(name)
    return changed


def apply_on_startup(app: FastAPI) -> FastAPI:
    """Apply the text stage's defaults when ``app`` starts: vLLM builds its handlers after the app
    (``init_app_state``) and before serving it, so the app's lifespan is the first moment they exist."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(started: FastAPI) -> AsyncIterator[Any]:
        client = getattr(started.state, "engine_client", None)
        sid = getattr(client, "text_stage_id", None)
        if sid is not None:
            overridden = getattr(getattr(client, "model_config", None), "override_generation_config", None)
            defaults = handler_defaults(client.stage_default_params(sid), overridden)
            if defaults:
                handlers = apply_to_handlers(started.state, defaults)
                logger.info("stage %d's default_sampling_params %s are the defaults of %s", sid, defaults, handlers)
        async with inner(started) as value:
            yield value

    app.router.lifespan_context = lifespan
    return app


def fill_client_defaults(params: Any, stage_defaults: Mapping[str, Any]) -> Any:
    """``params`` (vLLM ``SamplingParams``) with the stage's ``stop`` where it names none (a copy;
    vLLM's ``__post_init__`` runs again, so the stop strings' hold-back is set as for a request's own)."""
    stop = stage_defaults.get("stop")
    if not stop or params.stop:
        return params
    return msgspec.structs.replace(params, stop=[stop] if isinstance(stop, str) else list(stop))
