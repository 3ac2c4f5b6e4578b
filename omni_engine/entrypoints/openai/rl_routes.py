"""vLLM's RL route ``POST /abort_requests`` (``VLLM_SERVER_DEV_MODE=1``) for a pipeline.

vLLM's handler aborts "every in-flight request" when no ids are given by
reading ``AsyncLLM``'s output processor (``assert isinstance(engine,
AsyncLLM)``), which fails as a bare 500 behind any other engine client. This
route takes its place where vLLM registered it: the same body and answer;
without ids it aborts every request in the pipeline. Each aborted stream ends
with its partial output (``finish_reason="abort"``), as under ``AsyncLLM``.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from omni_engine.entrypoints.openai.routing import include_router_first

router = APIRouter()
PATH = "/abort_requests"


def _error(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status.value)


@router.post(PATH)
async def abort_requests(raw_request: Request) -> JSONResponse:
    try:
        body = await raw_request.json()
    except json.JSONDecodeError:
        return _error("abort_requests: the body is not valid JSON; send {\"request_ids\": [...]} "
                      "(or {} to abort every request)")
    if not isinstance(body, dict):
        return _error("abort_requests: the body must be a JSON object: {\"request_ids\": [...]}")
    request_ids = body.get("request_ids")
    if request_ids is not None and (not isinstance(request_ids, list)
                                    or not all(isinstance(r, str) for r in request_ids)):
        return _error(f"abort_requests: request_ids must be a list of strings, got {request_ids!r}")
    client = raw_request.app.state.engine_client
    if not request_ids:
        request_ids = client.in_flight_request_ids()  # none given: every request, as vLLM does
    await client.abort(request_ids)
    return JSONResponse({"status": "aborted", "aborted": len(request_ids)})


def replace_abort_requests_route(app: FastAPI) -> bool:
    """Put our ``/abort_requests`` ahead of vLLM's where vLLM registered one; True if it did."""
    if not any(getattr(route, "path", None) == PATH for route in app.router.routes):
        return False
    include_router_first(app, router)
    return True
