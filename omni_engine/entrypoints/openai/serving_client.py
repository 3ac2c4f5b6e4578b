"""``OpenAIServingEngineClient``: a ``MultiStageEngineClient`` as vLLM's OpenAI server calls it.

vLLM's serving code (0.32) renders the chat or completion itself and calls
``engine_client.generate(engine_input, sampling_params, request_id,
lora_request=..., trace_headers=..., priority=..., data_parallel_rank=...,
session_id=..., reasoning_ended=..., ...)`` where ``engine_input`` is a rendered
``EngineInput`` dict, for text ``{"type": "token", "prompt_token_ids": [...],
"prompt": "...", ...}``. That dict (ints, strs, floats) crosses to the text
stage as it is, and the stage's ``AsyncLLM.generate`` takes it without
tokenizing again. A (deprecated) ``EngineCoreRequest`` is turned into the same
kind of dict plus its own ``SamplingParams`` here, in the client.

For a text-only server the request ends at the text stage: later stages (speech)
are not run, and only the text stage's outputs reach vLLM's serving code.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest

from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageRequestError
from omni_engine.outputs import OmniRequestOutput

# Errors a stage reports for a request that vLLM treats as the client's fault (HTTP 400).
_VALIDATION_ERROR_TYPES = frozenset({"VLLMValidationError", "ValueError", "TypeError", "OverflowError"})


def engine_core_request_to_prompt(request: EngineCoreRequest) -> tuple[dict[str, Any], Any]:
    """A ``TokensInput`` dict and the sampling params of an ``EngineCoreRequest``."""
    if request.prompt_token_ids is None:
        raise VLLMValidationError("an EngineCoreRequest without prompt_token_ids (embeddings) cannot be served")
    if request.mm_features:
        raise VLLMValidationError("multimodal EngineCoreRequests are not supported by omni_engine pipelines yet")
    prompt: dict[str, Any] = {"type": "token", "prompt_token_ids": list(request.prompt_token_ids)}
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt, request.sampling_params


class OpenAIServingEngineClient(MultiStageEngineClient):
    """A pipeline served by vLLM's OpenAI server: text from the text stage."""

    # What a request gets when it does not say: only text, so the request ends at the text stage
    # (``text_stage_id``: from the text stage config given to the constructor; None: the pipeline's finals).
    default_modalities: tuple[str, ...] = ("text",)

    def final_stages_for(self, modalities: Sequence[str] | None) -> int | list[int] | None:
        """The stage(s) a request ends at: the text stage for text only, else the pipeline's finals."""
        wanted = tuple(modalities) if modalities else self.default_modalities
        if self.text_stage_id is not None and set(wanted) <= {"text"}:
            return self.text_stage_id
        return None

    def _params_by_stage(self, sampling_params: Any, entry_stage_id: int | None) -> Any:
        """vLLM's one ``SamplingParams`` is the text stage's (the others use their defaults)."""
        if self.text_stage_id is None or entry_stage_id is not None:
            return self.sampling_params_by_stage(sampling_params, entry_stage_id)
        return self.sampling_params_by_stage(sampling_params, self.text_stage_id)

    async def generate(  # type: ignore[override]
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        final_stage_id: int | Sequence[int] | None = None,
        execution_mode: str | None = None,
        modalities: Sequence[str] | None = None,
        entry_stage_id: int | None = None,
        lora_request: Any = None,
        data_parallel_rank: int | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        if lora_request is not None:
            raise VLLMValidationError("LoRA adapters are not supported by omni_engine pipelines", parameter="model")
        if isinstance(prompt, EngineCoreRequest):
            prompt, sampling_params = engine_core_request_to_prompt(prompt)
        self.validate_request(prompt, sampling_params, request_id)
        if final_stage_id is None and entry_stage_id is None:
            final_stage_id = self.final_stages_for(modalities)
        stream = super().generate(prompt, self._params_by_stage(sampling_params, entry_stage_id), request_id,
                                  final_stage_id=final_stage_id, execution_mode=execution_mode,
                                  entry_stage_id=entry_stage_id)
        try:
            async for output in stream:
                yield output
        except StageRequestError as exc:
            if exc.error_type in _VALIDATION_ERROR_TYPES:
                raise VLLMValidationError(exc.message) from exc
            raise
        finally:
            await stream.aclose()

    def validate_request(self, prompt: Any, sampling_params: Any, request_id: str) -> None:
        """Reject a bad request here with vLLM's own checks (HTTP 400), before any stage sees it.

        Only for rendered inputs (cheap: no tokenizing); the stage repeats the
        checks anyway.
        """
        if self.input_processor is None or not isinstance(sampling_params, SamplingParams):
            return
        if isinstance(prompt, dict) and "type" in prompt:
            self.input_processor.process_inputs(request_id, prompt, sampling_params, supported_tasks=("generate",))
