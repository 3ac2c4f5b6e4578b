"""The README's main job: ``omni-engine generate`` on the speech pipeline, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import wave

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
def test_generate_text_only_pipeline_writes_the_answer_once(tmp_path, smollm2_path):
    """The text pipeline's config leaves vLLM's default (CUMULATIVE) output kind: the
    command still prints and saves each piece of text once."""
    result = subprocess.run(
        [*CLI, "generate", "--config", "stage_configs/smollm2_text.yaml", "--max-tokens", "24",
         "--prompt", "What is the capital of France?", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = (tmp_path / "answer.txt").read_text().strip()
    assert "Paris" in answer and answer.count("capital of France") == 1, answer
    assert result.stdout.strip() == answer
    assert not (tmp_path / "answer.wav").exists()


def test_generate_rejects_a_bad_config_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage_args:\n  - stage_id: 0\n    stage_type: llm\n    engine_args: {}\n    final_output: true\n"
                   "    final_output_type: text\n    max_batch: 3\n")
    result = subprocess.run([*CLI, "generate", "--config", str(bad), "--prompt", "hi"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "bad.yaml" in result.stderr and "stage 0" in result.stderr and "max_batch" in result.stderr
    assert "starting" not in result.stderr
