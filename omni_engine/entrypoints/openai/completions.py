"""``POST /v1/completions``, refused for a pipeline whose stages need the chat template's structure.

Qwen3-Omni's talker takes its rows by chat turn (user turns, then the closing assistant turn), so a
raw completion prompt has nothing it can speak from; vLLM-Omni removes the route for the model and
answers with the reason. A stage says so in its READY info (``refuses_endpoints``: path -> reason,
from its request adapter); every other pipeline's completions go to vLLM's handler unchanged.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from vllm.entrypoints.openai.completion import api_router as vllm_completion_api
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.utils.api_utils import validate_json_request

from omni_engine.entrypoints.openai.served_pipeline import engine_client, error_response

PATH = "/v1/completions"
router = APIRouter()


def endpoint_refusal(client: Any, path: str) -> str | None:
    """Why a stage of the pipeline refuses ``path`` (None: none does)."""
    for sid in client.stage_ids():
        reason = (client.stage_info(sid).get("refuses_endpoints") or {}).get(path)
        if reason:
            return reason
    return None


@router.post(PATH, dependencies=[Depends(validate_json_request)])
async def create_completion(request: CompletionRequest, raw_request: Request):
    reason = endpoint_refusal(engine_client(raw_request), PATH)
    if reason is not None:
        return error_response(reason)
    return await vllm_completion_api.create_completion(request, raw_request)
