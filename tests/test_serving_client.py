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


def test_audio_routes_hook_into_the_app_vllm_builds(smollm2_path, monkeypatch):
    """``omni-engine serve`` adds its routes by wrapping vLLM's ``build_app``: the app that
    ``build_and_serve`` builds has them. A vLLM that moves the function fails here, naming it."""
    import argparse
    import importlib

    from omni_engine.entrypoints.cli.serve import vllm_server_args
    from omni_engine.entrypoints.openai.audio import VLLM_BUILD_APP, install_audio_routes

    module = importlib.import_module(VLLM_BUILD_APP.rpartition(".")[0])
    monkeypatch.setattr(module, "build_app", module.build_app)  # restored after the test
    install_audio_routes()
    install_audio_routes()  # idempotent: wrapped once
    args = vllm_server_args(str(smollm2_path), "smollm2",
                            argparse.Namespace(host="127.0.0.1", port=8000, uvicorn_log_level="info"))
    paths = [getattr(r, "path", None) for r in module.build_app(args, ("generate",)).routes]
    assert paths.count("/v1/audio/speech") == 1 and "/v1/chat/completions" in paths
    assert paths.index("/v1/audio/speech") < paths.index("/v1/chat/completions")  # ours first


def test_a_vllm_without_the_build_app_hook_fails_loudly(monkeypatch):
    import importlib

    import pytest

    from omni_engine.entrypoints.openai.audio import VLLM_BUILD_APP, install_audio_routes

    module = importlib.import_module(VLLM_BUILD_APP.rpartition(".")[0])
    monkeypatch.delattr(module, "build_app")
    with pytest.raises(RuntimeError, match=VLLM_BUILD_APP.replace(".", r"\.")):
        install_audio_routes()
