"""``POST /v1/images/generations`` (OpenAI's images API), served by the pipeline's image stage.

The request runs the image stage and the non-LLM stages before it that take text
(``client.text_entry_stage``), as ``/v1/audio/speech`` does: for ``faces.yaml`` the face GAN
alone; for ``smollm2_eyes.yaml`` the colour picker then the eye GAN (the prompt's colour word
picks the label; the LLM runs for whole-pipeline requests, not here). Images come back as
``b64_json`` PNGs; ``url`` is refused, since the server keeps no files to link to.
Every refusal is a 400 naming the field (``n``, ``size``, ``response_format``, ``prompt``);
a pipeline without an image stage answers 404.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from vllm.entrypoints.serve.utils.api_utils import validate_json_request

from omni_engine.entrypoints.openai.served_pipeline import check_model, engine_client, error_response
from omni_engine.errors import StageRequestError

router = APIRouter()
RESPONSE_FORMATS = ("b64_json",)


class ImageGenerationRequest(BaseModel):
    # OpenAI's other fields (quality, style, background, user, ...) are accepted and have no effect:
    # a DCGAN has no such knobs.
    model_config = ConfigDict(extra="allow")

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None  # None or "auto": the model's one size
    response_format: str = "b64_json"  # OpenAI's default for dall-e is url, which is refused here
    seed: int | None = None  # not OpenAI's: the same seed gives the same images


def image_stage_id(client: Any) -> int | None:
    """The pipeline's image stage: the first final stage with image output."""
    return client.stage_for_output("image")


def png_bytes(image: np.ndarray) -> bytes:
    """One uint8 [H, W, 3] image as PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8), mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _check_request(request: ImageGenerationRequest, info: dict[str, Any]) -> JSONResponse | None:
    """The first thing wrong with ``request`` for the stage that ``info`` describes, as a 400 naming it."""
    if not request.prompt.strip():
        return error_response("prompt must not be empty", param="prompt")
    max_images = int(info.get("max_images", 1))
    if not 1 <= request.n <= max_images:
        return error_response(f"n must be between 1 and {max_images} for this image stage, got {request.n}",
                              param="n")
    sizes = list(info.get("sizes", ()))
    if request.size not in (None, "auto") and request.size not in sizes:
        return error_response(f"size {request.size!r} is not supported: this model makes {sizes}", param="size")
    if request.response_format not in RESPONSE_FORMATS:
        why = " (this server keeps no image files to link to)" if request.response_format == "url" else ""
        return error_response(f"response_format {request.response_format!r} is not supported{why}; "
                              f"use one of {list(RESPONSE_FORMATS)}", param="response_format")
    if request.seed is not None and not 0 <= request.seed < 2**63:
        return error_response(f"seed must be in 0..2**63-1, got {request.seed}", param="seed")
    return None


@router.post("/v1/images/generations", dependencies=[Depends(validate_json_request)])
async def create_image(request: ImageGenerationRequest, raw_request: Request) -> Response:
    client = engine_client(raw_request)
    sid = image_stage_id(client)
    if sid is None:
        return error_response("this pipeline has no image stage", 404, err_type="NotFoundError")
    if (bad := check_model(client, request.model)) is not None:
        return bad
    if (bad := _check_request(request, client.stage_info(sid))) is not None:
        return bad
    params: dict[str, Any] = {"n": request.n}
    if request.seed is not None:
        params["seed"] = request.seed
    request_id = f"image-{uuid.uuid4().hex}"
    try:
        images = await generate_images(client, sid, request.prompt, params, request_id)
    except StageRequestError as exc:  # e.g. a prompt that names no colour the eye GAN knows
        return error_response(str(exc), param="prompt")
    encoded = await asyncio.to_thread(lambda: [base64.b64encode(png_bytes(img)).decode("ascii") for img in images])
    return JSONResponse({"created": int(time.time()), "data": [{"b64_json": data} for data in encoded]})


async def generate_images(client: Any, sid: int, prompt: str, params: dict[str, Any],
                          request_id: str) -> list[np.ndarray]:
    """The image stage's images for ``prompt``, entering at the first non-LLM stage before it."""
    images: list[np.ndarray] = []
    async for out in client.generate(prompt, {sid: params}, request_id, entry_stage_id=client.text_entry_stage(sid),
                                     final_stage_id=sid):
        mm = out.multimodal_output
        if mm and mm.get("images") is not None:
            # Copied: a view would hold the stage's shared-memory slot until the PNGs are encoded.
            images.extend(np.array(mm["images"], dtype=np.uint8, copy=True))
    return images
