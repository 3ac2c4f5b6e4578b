"""The README's main job: ``omni-engine generate`` on the speech pipeline, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main"]


@pytest.mark.llm
@pytest.mark.tts
def test_generate_writes_the_answer_and_a_playable_wav(tmp_path, smollm2_path):
    result = subprocess.run(
        [*CLI, "generate", "--config", "stage_configs/smollm2_speech.yaml",
         "--prompt", "What is the capital of France?", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    assert "Paris" in (tmp_path / "answer.txt").read_text()
    with wave.open(str(tmp_path / "answer.wav")) as w:
        assert w.getframerate() == 22050 and w.getnframes() > 22050 // 2
    # Per-stage progress on stderr.
    for line in ("stage 0: ready", "stage 1: ready", "stage 0: first text", "stage 1: first audio"):
        assert line in result.stderr, result.stderr[-3000:]


@pytest.mark.llm
def test_generate_runs_a_mixing_pipeline_and_writes_its_text_answer_once(tmp_path, smollm2_path):
    """The example mixing pipeline (a teacher and a theta stage; its theta prompt from
    --extra-args) is text only and leaves vLLM's default (CUMULATIVE) output kind: the
    command still prints and saves each piece of text once, and the α history is written
    where the command runs."""
    result = subprocess.run(
        [*CLI, "generate", "--config", str(Path("stage_configs/smollm2_mixing.yaml").resolve()), "--max-tokens", "24",
         "--prompt", "What is the capital of France? (Reference answer: Paris.)",
         "--extra-args", '{"theta_prompt": "What is the capital of France?"}', "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = (tmp_path / "out" / "answer.txt").read_text().strip()
    assert "Paris" in answer and answer.count("capital of France") <= 1, answer
    assert result.stdout.strip() == answer
    assert not (tmp_path / "out" / "answer.wav").exists()
    (line,) = [json.loads(text) for text in (tmp_path / "alpha_history.jsonl").read_text().splitlines()]
    assert line["request_id"] == "cli-0" and line["steps"] == len(line["alpha"]) > 0


def test_generate_rejects_a_bad_config_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage_args:\n  - stage_id: 0\n    stage_type: llm\n    engine_args: {}\n    final_output: true\n"
                   "    final_output_type: text\n    max_batch: 3\n")
    result = subprocess.run([*CLI, "generate", "--config", str(bad), "--prompt", "hi"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "bad.yaml" in result.stderr and "stage 0" in result.stderr and "max_batch" in result.stderr
    assert "starting" not in result.stderr


def test_serve_takes_vllm_serve_flags_and_shows_them_beside_its_own(capsys):
    from omni_engine.entrypoints.cli.main import main as cli_main

    def help_text(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as done:
            cli_main(argv)
        assert done.value.code == 0
        return capsys.readouterr().out

    full = help_text(["serve", "--help=all"])
    for flag in ("--api-key", "--ssl-keyfile", "--root-path", "--allowed-origins", "--chat-template",
                 "--uvicorn-log-level", "--engine-metrics-timeout", "PIPELINE_CONFIG"):
        assert flag in full, flag
    groups = help_text(["serve", "--help"])
    assert "Frontend" in groups and "omni-engine" in groups and "--api-key" in groups


@pytest.mark.parametrize("argv, message", [
    (["stage_configs/smollm2_mixing.yaml", "--max-model-len", "4096", "--max-logprobs", "30"],
     ("--max-model-len, --max-logprobs: vLLM engine flags set the engine of a pipeline's one llm stage, and "
      "stage_configs/smollm2_mixing.yaml has 2 (stage 0, stage 1); a flag cannot say which: set "
      "engine_args.max_model_len, engine_args.max_logprobs of the stage you mean")),
    (["stage_configs/smollm2_text.yaml", "--model", "x"],
     "a pipeline's models are set in its config (engine_args.model of a stage)"),
    (["stage_configs/smollm2_text.yaml", "--api-server-count", "2"], "--api-server-count is not supported"),
    (["stage_configs/smollm2_text.yaml", "--enable-auto-tool-choice"], "requires --tool-call-parser"),
    (["--api-key", "k"], "the pipeline config or model is required"),
])
def test_serve_refuses_what_it_cannot_honour_before_starting_anything(argv, message, capsys):
    from omni_engine.entrypoints.cli.main import main as cli_main

    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "starting" not in err


def test_serve_checks_the_model_first_and_serves_it_under_the_name_the_yaml_gives(smollm2_path):
    """``serve`` loads and checks the config before vLLM's parser; the model is prepared
    (a directory), and the API still serves it as the YAML names it (``smollm2``)."""
    from omni_engine.entrypoints.cli.serve import _load_checked

    config = _load_checked(Path("stage_configs/smollm2_text.yaml"))
    stage = config.stage(0)
    assert stage.engine_args["model"] == str(smollm2_path)
    assert stage.engine_args["served_model_name"] == ["smollm2"]
