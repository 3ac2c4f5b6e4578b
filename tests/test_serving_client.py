"""What vLLM's OpenAI server hands ``MultiStageEngineClient.generate``, and how it reaches a stage (no engine)."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreRequest

from omni_engine.entrypoints.multi_stage_engine_client import engine_core_request_to_prompt
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


def test_our_routes_and_key_guard_hook_into_the_app_vllm_builds(smollm2_path, monkeypatch):
    """``omni-engine serve`` extends vLLM's app by wrapping its ``build_app``: the app that
    ``build_and_serve`` builds has our routes first and, with ``--api-key``, our guard in place
    of vLLM's. A vLLM that moves the function fails here, naming it."""
    import importlib

    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from omni_engine.entrypoints.cli.serve_args import parse_serve_args, server_args_for
    from omni_engine.entrypoints.openai.app import VLLM_BUILD_APP, install_app_extensions
    from omni_engine.entrypoints.openai.auth import ApiKeyMiddleware

    module = importlib.import_module(VLLM_BUILD_APP.rpartition(".")[0])
    monkeypatch.setattr(module, "build_app", module.build_app)  # restored after the test
    install_app_extensions()
    install_app_extensions()  # idempotent: wrapped once
    args = server_args_for(parse_serve_args(["pipeline.yaml", "--api-key", "k1"]), str(smollm2_path), ["smollm2"])
    app = module.build_app(args, ("generate",))
    paths = [getattr(r, "path", None) for r in app.routes]
    assert paths.count("/v1/audio/speech") == 1 and "/v1/chat/completions" in paths
    assert paths.index("/v1/audio/speech") < paths.index("/v1/chat/completions")  # ours first
    guards = [m for m in app.user_middleware if issubclass(m.cls, AuthenticationMiddleware)]
    assert [m.cls for m in guards] == [ApiKeyMiddleware] and guards[0].kwargs == {"tokens": ["k1"]}
    built, classes = app.middleware_stack, []  # vLLM builds the stack in build_app: ours must be in it
    while built is not None:
        classes.append(type(built))
        built = getattr(built, "app", None)
    assert ApiKeyMiddleware in classes and AuthenticationMiddleware not in classes


def test_a_vllm_without_the_build_app_hook_fails_loudly(monkeypatch):
    import importlib

    import pytest

    from omni_engine.entrypoints.openai.app import VLLM_BUILD_APP, install_app_extensions

    module = importlib.import_module(VLLM_BUILD_APP.rpartition(".")[0])
    monkeypatch.delattr(module, "build_app")
    with pytest.raises(RuntimeError, match=VLLM_BUILD_APP.replace(".", r"\.")):
        install_app_extensions()
