"""A model alone names its pipeline: its family's stage config by ``architectures``, or one vLLM stage;
a checkpoint that neither serves is refused in one line, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from omni_engine.config import ConfigError, load_pipeline_config
from omni_engine.config.for_model import pipeline_config_for_model
from omni_engine.entrypoints.async_omni import AsyncOmni
from omni_engine.models.families import FAMILY_CONFIGS, family_config_file
from tests.stress.pipeline import REPO


def _checkpoint(tmp_path, name, **config):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_qwen2_5_omni_checkpoint_runs_as_its_family_s_three_stages(tmp_path):
    for arch in ("Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel"):  # transformers', the published
        ckpt = _checkpoint(tmp_path, arch, architectures=[arch], model_type="qwen2_5_omni")
        config = pipeline_config_for_model(str(ckpt))
        assert [(s.stage_type, s.engine_args.get("model_stage"), s.final_output_type) for s in config.stage_args] == [
            ("llm", "thinker", "text"), ("llm", "talker", None), ("generation", None, "audio")]
        assert {s.engine_args["model"] for s in config.stage_args} == {str(ckpt)}
    # the family's file is the one stage_configs/ shows (a link to the package's copy)
    assert family_config_file(["Qwen2_5OmniModel"]).resolve() == (REPO / "stage_configs" / "qwen2_5_omni.yaml").resolve()
    shipped = load_pipeline_config(REPO / "stage_configs" / "qwen2_5_omni.yaml")
    assert [s.engine_args for s in pipeline_config_for_model("qwen2.5-omni-tiny").stage_args] == [
        s.engine_args for s in shipped.stage_args]  # the recipe name: its architecture is known unbuilt


def test_a_qwen3_omni_checkpoint_runs_as_its_family_s_three_stages_streaming_codec_chunks(tmp_path):
    ckpt = _checkpoint(tmp_path, "qwen3", architectures=["Qwen3OmniMoeForConditionalGeneration"],
                       model_type="qwen3_omni_moe")
    config = pipeline_config_for_model(str(ckpt))
    assert config.runtime.execution_mode == "async_chunk"
    assert [(s.stage_type, s.engine_args.get("model_stage"), s.final_output_type) for s in config.stage_args] == [
        ("llm", "thinker", "text"), ("llm", "talker", None), ("generation", None, "audio")]
    assert {s.engine_args["model"] for s in config.stage_args} == {str(ckpt)}
    assert config.stage_args[1].default_sampling_params["stop_token_ids"] == [2150]  # the talker's codec eos
    assert family_config_file(["Qwen3OmniMoeForConditionalGeneration"]).resolve() == (
        REPO / "stage_configs" / "qwen3_omni_moe.yaml").resolve()


def test_async_omni_of_a_checkpoint_takes_its_family_s_pipeline_and_the_engine_args(tmp_path):
    ckpt = _checkpoint(tmp_path, "omni", architectures=["Qwen2_5OmniForConditionalGeneration"])
    omni = AsyncOmni(model=str(ckpt), max_model_len=2048)
    llm = [s for s in omni.config.stage_args if s.stage_type == "llm"]
    assert len(omni.config.stage_args) == 3 and len(llm) == 2
    assert all(s.engine_args["max_model_len"] == 2048 and s.engine_args["model"] == str(ckpt) for s in llm)


def test_a_text_model_is_one_vllm_stage(tmp_path):
    ckpt = _checkpoint(tmp_path, "llama", architectures=["LlamaForCausalLM"])
    config = pipeline_config_for_model(str(ckpt))
    assert [(s.stage_type, s.engine_args) for s in config.stage_args] == [("llm", {"model": str(ckpt)})]


@pytest.mark.parametrize(("config", "says"), [
    ({"architectures": ["NoSuchModelForCausalLM"]}, "is served neither by a model family"),
    ({"architectures": ["Qwen4OmniForConditionalGeneration"], "talker_config": {}, "code2wav_config": {}},
     "has speech parts (talker_config, code2wav_config) that no model family serves"),
])
def test_a_checkpoint_nothing_serves_is_refused_in_one_line_naming_the_families(tmp_path, config, says):
    ckpt = _checkpoint(tmp_path, "x", **config)
    with pytest.raises(ConfigError) as err:
        AsyncOmni(model=str(ckpt))
    message = str(err.value)
    assert "\n" not in message and says in message
    assert config["architectures"][0] in message and str(ckpt) in message
    assert all(arch in message for arch in FAMILY_CONFIGS)


def test_serve_and_generate_of_such_a_checkpoint_exit_2_with_that_line_and_start_nothing(tmp_path):
    ckpt = _checkpoint(tmp_path, "x", architectures=["NoSuchModelForCausalLM"])
    cli = [sys.executable, "-m", "omni_engine.entrypoints.cli.main"]
    for argv in (["serve", str(ckpt), "--port", "1"], ["generate", "--model", str(ckpt), "--prompt", "hi"]):
        started = time.monotonic()
        out = subprocess.run([*cli, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 2, out.stderr[-2000:]
        line = [line for line in out.stderr.splitlines() if "NoSuchModelForCausalLM" in line]
        assert len(line) == 1 and "is served neither by a model family" in line[0], out.stderr[-2000:]
        assert "Traceback" not in out.stderr and "starting" not in out.stderr
        assert time.monotonic() - started < 60


def test_generate_of_the_tiny_checkpoint_takes_per_stage_params_and_speaks_transformers_audio(
        tmp_path, omni_dir, reference):
    """``generate --model DIR --sampling-params-list``: a greedy talker in the voice asked for; the
    answer's text and WAV are transformers' (the WAV is 16-bit: within a step)."""
    import wave

    import numpy as np

    from tests.qwen_omni_reference import MAX_TOKENS, TALKER_TOKENS, chat, reference_codes, reference_run, reference_wav

    question = "What is the capital of France?"
    per_stage = [{"max_tokens": MAX_TOKENS}, {"temperature": 0.0, "max_tokens": TALKER_TOKENS,
                                              "extra_args": {"voice": "Ethan"}}]
    cli = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "generate", "--model", str(omni_dir),
           "--prompt", question, "--output-dir", str(tmp_path)]
    bad = subprocess.run([*cli, "--sampling-params-list", '[null, {"temprature": 0}]'], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "--sampling-params-list[1] (stage 1)" in bad.stderr, bad.stderr[-2000:]
    assert "temprature" in bad.stderr and "starting" not in bad.stderr
    out = subprocess.run([*cli, "--sampling-params-list", json.dumps(per_stage)], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    prompt = (chat(question), {})
    want_ids, _, _ = reference_run(reference, prompt)
    assert (tmp_path / "answer.txt").read_text().strip() == reference[1].tokenizer.decode(
        want_ids, skip_special_tokens=True).strip()
    want = reference_wav(reference, reference_codes(reference, prompt, "Ethan"), "Ethan")
    with wave.open(str(tmp_path / "answer.wav")) as w:
        rate, wav = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    assert rate == 24000 and wav.shape == want.shape
    np.testing.assert_allclose(wav, np.clip(want, -1, 1), atol=1e-4 + 1 / 32768, rtol=0)
