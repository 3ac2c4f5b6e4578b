"""``AsyncOmni`` on both architectures: the seed's integration tests (rfc967,
测试计划), the flag, and the errors both paths must share."""

from __future__ import annotations

import asyncio
import warnings

import pytest
from vllm import SamplingParams

from omni_engine.config import ConfigError
from omni_engine.entrypoints.async_omni import AsyncOmni, pipeline_config_for
from omni_engine.errors import StageStartupError
from tests.helpers import llm_engine_args

async_test = pytest.mark.asyncio(loop_scope="session")

SPEECH_CONFIG = "stage_configs/smollm2_speech.yaml"


def engine_kwargs(smollm2_path):
    args = llm_engine_args(smollm2_path)
    args.pop("model")
    return args


@async_test
@pytest.mark.llm
async def test_single_stage_pipeline(monkeypatch, smollm2_path):
    """The seed's test_single_stage_pipeline, on the new architecture (the flag set)."""
    monkeypatch.setenv("VLLM_OMNI_USE_NEW_ARCHITECTURE", "1")
    async_omni = AsyncOmni(model=str(smollm2_path), **engine_kwargs(smollm2_path))

    outputs = []
    async with async_omni:
        async for output in async_omni.generate(
            prompt="Hello",
            request_id="test-1",
            sampling_params_list=[SamplingParams(max_tokens=8)],
        ):
            outputs.append(output)
        assert async_omni.engine.orchestrator.stages[0].client.replicas[0].__class__.__name__ == "StageEngineCoreClient"

    assert len(outputs) > 0
    assert outputs[-1].finished
    assert not async_omni.is_running


@async_test
@pytest.mark.llm
@pytest.mark.tts
async def test_two_stage_pipeline(monkeypatch, smollm2_path, chat_prompt):
    """The seed's test_two_stage_pipeline, on the legacy architecture (the flag at 0)."""
    monkeypatch.setenv("VLLM_OMNI_USE_NEW_ARCHITECTURE", "0")
    with pytest.warns(DeprecationWarning, match="legacy multiprocessing.Queue architecture"):
        async_omni = AsyncOmni(model=str(smollm2_path), stage_configs_path=SPEECH_CONFIG,
                               **engine_kwargs(smollm2_path))

    outputs = []
    async with async_omni:
        async for output in async_omni.generate(
            prompt=chat_prompt("What is the capital of France?"),
            request_id="test-1",
            sampling_params_list=[SamplingParams(temperature=0.0, max_tokens=32), SamplingParams()],
        ):
            outputs.append(output)
        assert async_omni.engine.orchestrator.stages[0].client.replicas[0].__class__.__name__ == "OmniStage"
        # abort of an unknown id is harmless; health is checked on every stage
        await async_omni.abort("unknown")
        await async_omni.check_health()

    assert len(outputs) > 0
    assert outputs[-1].finished
    assert outputs[-1].final_output_type in ("text", "audio")
    text = "".join(o.outputs[0].text for o in outputs if o.final_output_type == "text")
    assert "Paris" in text
    assert any(o.final_output_type == "audio" and o.multimodal_output for o in outputs)


def test_model_and_engine_args_go_to_llm_stages_only():
    cfg = pipeline_config_for("/models/x", SPEECH_CONFIG, {"max_model_len": 512})
    assert cfg.stage(0).engine_args["model"] == "/models/x"
    assert cfg.stage(0).engine_args["max_model_len"] == 512
    assert cfg.stage(0).engine_args["enforce_eager"] is True  # the file's other args stay
    assert "model" not in cfg.stage(1).engine_args
    one = pipeline_config_for("/models/y", None, {})
    assert [s.stage_type for s in one.stage_args] == ["llm"] and one.stage(0).final_output


def test_bad_construction_is_a_clear_error():
    with pytest.raises(ValueError, match="model= .* or stage_configs_path="):
        AsyncOmni()
    with pytest.raises(ConfigError, match="not found"):
        AsyncOmni(stage_configs_path="stage_configs/missing.yaml")


def test_new_architecture_is_the_default_and_legacy_warns(monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_USE_NEW_ARCHITECTURE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AsyncOmni(stage_configs_path=SPEECH_CONFIG).use_new_architecture
    with pytest.warns(DeprecationWarning):
        assert not AsyncOmni(stage_configs_path=SPEECH_CONFIG, use_new_architecture=False).use_new_architecture


@async_test
@pytest.mark.parametrize("new", [True, False], ids=["new", "legacy"])
async def test_a_stage_that_fails_to_start_names_itself_on_both(tmp_path, new):
    config = tmp_path / "broken.yaml"
    config.write_text(
        "stage_args:\n"
        "  - stage_id: 0\n"
        "    stage_type: generation\n"
        "    engine_args: {model_factory: 'omni_engine.engines.tts:make_espeak_tts', default_voice: no-such-voice}\n"
        "    final_output: true\n"
        "    final_output_type: audio\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        omni = AsyncOmni(stage_configs_path=config, use_new_architecture=new)
    with pytest.raises(StageStartupError) as info:
        async with asyncio.timeout(120):
            await omni.start()
    assert info.value.stage_id == 0
    assert "stage 0" in str(info.value) and "no-such-voice" in str(info.value)
    await omni.shutdown_async()
