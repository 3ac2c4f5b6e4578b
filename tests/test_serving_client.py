"""What vLLM's OpenAI server hands ``OpenAIServingEngineClient.generate``, and how it reaches a stage (no engine)."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreRequest

from omni_engine.entrypoints.openai.serving_client import engine_core_request_to_prompt
from omni_engine.wire.protocol import StageGenerateRequest
from omni_engine.wire.stage_serialization import (
    StageMsgpackDecoder,
    StageMsgpackEncoder,
)


def _round_trip(msg):
    return StageMsgpackDecoder(type(msg)).decode(StageMsgpackEncoder().encode(msg))


def test_a_rendered_token_input_crosses_to_the_stage_unchanged():
    # What OpenAIServingChat passes in vLLM 0.32: a rendered EngineInput dict.
    prompt = {"type": "token", "prompt_token_ids": [1, 9690, 198, 2], "prompt": "<|im_start|>system\n",
              "arrival_time": 1234.5}
    params = SamplingParams(max_tokens=7, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    got = _round_trip(StageGenerateRequest("chatcmpl-1", prompt, params))
    assert got.prompt == prompt
    assert isinstance(got.sampling_params, SamplingParams)
    assert got.sampling_params.max_tokens == 7 and got.sampling_params.output_kind == RequestOutputKind.DELTA


def test_an_engine_core_request_becomes_a_token_input_and_its_params():
    params = SamplingParams(max_tokens=5)
    request = EngineCoreRequest(
        request_id="r1", prompt_token_ids=[5, 6, 7], mm_features=None, sampling_params=params,
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt="salt", data_parallel_rank=None,
    )
    prompt, got_params = engine_core_request_to_prompt(request)
    assert prompt == {"type": "token", "prompt_token_ids": [5, 6, 7], "cache_salt": "salt"}
    assert got_params is params
    assert _round_trip(StageGenerateRequest("r1", prompt, got_params)).prompt == prompt
